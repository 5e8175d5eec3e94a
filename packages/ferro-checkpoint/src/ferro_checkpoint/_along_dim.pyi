from collections.abc import Buffer

def copy_slab(src: Buffer, dst: Buffer, outer: int, src_len: int, dst_len: int,
              inner_bytes: int, src_start: int, dst_start: int, count: int) -> None: ...

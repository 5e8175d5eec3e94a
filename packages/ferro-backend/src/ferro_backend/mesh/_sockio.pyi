from collections.abc import Buffer

HEADER_BYTES: int
PEEKED: int
OTHER: int
TIMEOUT: int
UNSURE: int

def peek_frame(fd: int, other: int, header: Buffer, timeout: float) -> int: ...
def take_frame(fd: int, other: int, out: Buffer, timeout: float) -> int: ...
def send_frame(fd: int, kind: int, tag: int, payload: Buffer) -> int: ...

from collections.abc import Callable

class FastPlan:
    name: str
    header: bytes
    shape: tuple[int, ...]
    root: int
    staged: Callable[..., None] | None
    def __init__(self, name: str, header: bytes, shape: tuple[int, ...], hash: int) -> None: ...
    @staticmethod
    def fold(name: str, header: bytes, shape: tuple[int, ...], hash: int, code: int,
             kernel: int, div: float, offset: int, count: int) -> FastPlan: ...
    @staticmethod
    def copy(name: str, header: bytes, shape: tuple[int, ...], hash: int, root: int,
             one_step: bool, staged: Callable[..., None]) -> FastPlan: ...

class SeqCounter:
    value: int
    def __call__(self) -> int: ...

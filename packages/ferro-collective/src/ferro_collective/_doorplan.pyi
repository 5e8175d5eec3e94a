from typing import Any

class DoorPlan:
    name: str
    shape: tuple[int, ...]
    call: Any
    out_shape: tuple[int, ...]
    def __init__(self, name: str, shape: tuple[int, ...], out_shape: tuple[int, ...],
                 call: Any) -> None: ...
    @staticmethod
    def not_taken() -> DoorPlan: ...

class SeqCounter:
    value: int
    def __call__(self) -> int: ...
    def catch_up(self, seq: int, count: int) -> bool: ...

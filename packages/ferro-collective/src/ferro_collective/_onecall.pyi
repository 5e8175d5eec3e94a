from typing import Any

from ._doorplan import DoorPlan

NOT_TAKEN: object
ALLREDUCE: int
REDUCE_SCATTER: int
BROADCAST: int
ALL_GATHER: int
SCATTER: int
ALL_TO_ALL_SINGLE: int
ALL_TO_ALL: int
ALL_GATHER_V: int
BROADCAST_OBJECT: int
ALL_GATHER_OBJECT: int
BARRIER: int
GATHER: int

def overlaps(kind: int, x: Any, out: Any, me: int) -> bool: ...

class Core:
    broken: BaseException | None
    n: int
    me: int
    twin: Any
    def _bind(self, backend: Any, comm: Any) -> None: ...
    def still_broken(self, name: str, seq: int | None = None) -> BaseException: ...
    def cached(self, kind: int, tensor: Any, arg: Any) -> DoorPlan | None: ...
    def _resolve(self, timeout: Any, name: str) -> float: ...
    def _raise(self, rc: int, name: str, seq: int, timeout: float) -> None: ...

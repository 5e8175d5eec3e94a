from collections.abc import Callable
from typing import Any

from ._fastplan import FastPlan

NOT_TAKEN: object
ALLREDUCE: int
REDUCE_SCATTER: int
BROADCAST: int
ALL_GATHER: int
BARRIER: int
GATHER: int

class Core:
    broken: BaseException | None
    n: int
    me: int
    def _bind(self, backend: Any, comm: Any) -> None: ...
    def cached(self, kind: int, tensor: Any, arg: Any) -> FastPlan | None: ...
    def _resolve(self, timeout: Any, name: str) -> float: ...
    def _raise(self, rc: int, name: str, seq: int, timeout: float) -> None: ...

def run(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
        algorithm: Any = None, out: Any = None) -> Any: ...
def set_general(general: Callable[..., Any]) -> None: ...
def run_direct(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
               algorithm: Any = None, out: Any = None) -> Any: ...
def set_tracer(tracer: Callable[..., Any] | None) -> None: ...

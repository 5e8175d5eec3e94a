from collections.abc import Callable
from typing import Any

import numpy as np

from ._fastplan import FastPlan

API_SIGNATURE: str
NOT_TAKEN: object
ALLREDUCE: int
REDUCE_SCATTER: int
BROADCAST: int
ALL_GATHER: int
BARRIER: int
GATHER: int

def register(kind: int, maker: Callable[[Any, np.ndarray, Any], FastPlan | None]) -> None: ...

class Core:
    _next_seq: int
    _waiting: int
    broken: BaseException | None
    n: int
    me: int
    def _bind(self, backend: Any, slots: Any, counter: Callable[[], int], barrier_header: bytes,
              barrier_hash: int) -> None: ...
    def _done(self, seq: int) -> None: ...
    def cached(self, kind: int, tensor: Any, arg: Any) -> FastPlan | None: ...

def run(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
        algorithm: Any = None, out: Any = None) -> Any: ...
def set_general(general: Callable[..., Any]) -> None: ...
def run_direct(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
               algorithm: Any = None, out: Any = None) -> Any: ...
def set_tracer(tracer: Callable[..., Any] | None) -> None: ...

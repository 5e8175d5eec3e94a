from typing import Any

BARRIER: int
ALLREDUCE: int
REDUCE: int
REDUCE_SCATTER: int
ALL_GATHER: int
GATHER: int
SCATTER: int
BROADCAST: int
ALL_TO_ALL: int
RESERVE: int
RUN_AT: Any  # a PyCapsule: Call.run_at as a C function

class Call:
    comm: Any
    ticket: int
    def __init__(self, comm: Any, kind: int, dtype: int, op: int = 0, root: int = 0,
                 shape: Any = None, type_name: bytes | None = None, span: int = 0,
                 names_call: int = 0, names_op: int = 0) -> None: ...
    def run_at(self, send: int, send_bytes: int, recv: int, recv_bytes: int,
               timeout: float) -> int: ...
    def run(self, send: Any, recv: Any, ticket: int = ..., timeout: float = 0.0) -> int: ...

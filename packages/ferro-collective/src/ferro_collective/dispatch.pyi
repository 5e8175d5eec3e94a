from collections.abc import Callable
from typing import Any

from .work import Work

submit: Callable[..., Work]

def run(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
        algorithm: Any = None, out: Any = None, span: int = 0) -> Any: ...
def run_barrier(coll: Any, backend: Any, timeout: Any = None) -> None: ...
def run_direct(coll: Any, tensor: Any, backend: Any, arg: Any = None, timeout: Any = None,
               algorithm: Any = None, out: Any = None, span: int = 0) -> Any: ...

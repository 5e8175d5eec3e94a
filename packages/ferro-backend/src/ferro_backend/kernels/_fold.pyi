from typing import Any

OP_SUM: int
OP_PROD: int
OP_MAX: int
OP_MIN: int
OP_BAND: int
OP_BOR: int
OP_BXOR: int
OP_AVG: int
DTYPE_CODES: dict[str, int]
SIMD_AVX2: bool

def op_fits(code: int, op: int) -> bool: ...
def fold(out: Any, inputs: list[Any], code: int, op: int, mean_divisor: float = ...) -> None: ...
def accumulate(acc: Any, x: Any, code: int, op: int) -> None: ...
def accumulate_mean(acc: Any, x: Any, code: int, divisor: float) -> None: ...

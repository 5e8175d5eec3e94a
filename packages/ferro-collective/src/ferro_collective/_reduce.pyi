import numpy as np

OP_SUM: int
OP_PROD: int
OP_MAX: int
OP_MIN: int
OP_BAND: int
OP_BOR: int
OP_BXOR: int
DTYPE_CODES: dict[str, int]

def accumulate(acc: np.ndarray, x: np.ndarray, op: int) -> None: ...
def accumulate_mean(acc: np.ndarray, x: np.ndarray, divisor: float) -> None: ...
def fold(out: np.ndarray, inputs: list[np.ndarray], op: int, mean_divisor: float) -> None: ...

FOLD_SIGNATURE: str
FOLD: object  # a PyCapsule named FOLD_SIGNATURE holding the address of the fold

"""The fused compiled optimizer step (ferro_fsdp._optim_step) against the numpy step it replaces
(the same optimizer with ``fused=False``), on one flat parameter of 64 Ki elements (in cache)
and of 4 Mi elements.

Both produce the same bits (tests/test_optim_step.py); the compiled step reads and writes each
array once, where the numpy step makes a pass (and often a temporary) per operation. Each group
pairs ``numpy`` (the baseline) with ``ferro`` for one optimizer, dtype and size.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferro_fsdp import Parameter, optim

CONFIGS = {
    "sgd_momentum_wd": lambda ps, fused: optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4,
                                                   fused=fused),
    "adam": lambda ps, fused: optim.Adam(ps, lr=1e-3, fused=fused),
    "adamw": lambda ps, fused: optim.AdamW(ps, lr=1e-3, fused=fused),
}


@pytest.mark.parametrize("impl", ["numpy", "ferro"])
def _label(n: int) -> str:
    return f"{n >> 20}Mi" if n >= 1 << 20 else f"{n >> 10}Ki"


@pytest.mark.parametrize("size", [1 << 16, 1 << 22], ids=_label)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", list(CONFIGS))
def bench_optimizer_step(benchmark, config, dtype, size, impl):
    benchmark.group = f"{config} step {dtype} {_label(size)} elements"
    benchmark.extra_info["role"] = "baseline" if impl == "numpy" else "ferro"
    rng = np.random.default_rng(0)
    p = Parameter(rng.standard_normal(size).astype(dtype))
    p.grad = rng.standard_normal(size).astype(dtype) * 1e-3
    opt = CONFIGS[config]([p], impl == "ferro")
    arrays = 2 + len(optim.SGD.array_state_keys if config.startswith("sgd")
                     else optim.Adam.array_state_keys)
    benchmark.extra_info["bytes"] = size * np.dtype(dtype).itemsize * arrays
    opt.step()                                   # create the state outside the timing
    benchmark(opt.step)
    # check after timing: the other implementation, from the same start, gives the same bits
    q = Parameter(rng.standard_normal(64).astype(dtype))
    r = Parameter(q.data.copy())
    a, b = CONFIGS[config]([q], True), CONFIGS[config]([r], False)
    for _ in range(3):
        q.grad = r.grad = rng.standard_normal(64).astype(dtype)
        a.step()
        b.step()
    np.testing.assert_array_equal(q.data, r.data)

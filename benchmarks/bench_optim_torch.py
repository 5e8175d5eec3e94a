"""ferro's fused compiled optimizer step (ferro_fsdp._optim_step) against torch's CPU steps on
the same flat parameter: torch's single-tensor loop (``foreach=False``), its multi-tensor
``foreach`` path and its ``fused`` CPU kernel, one thread each (``torch.set_num_threads(1)``,
as a rank runs under ferrorun), float32, 4 Mi elements (bench_optim.py holds the numpy
baseline and the other sizes).
"""

from __future__ import annotations

import numpy as np
import pytest

from ferro_fsdp import Parameter, optim

torch = pytest.importorskip("torch")

N = 1 << 22

FERRO = {
    "sgd_momentum_wd": lambda ps: optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-3),
}
TORCH = {
    "sgd_momentum_wd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.01, momentum=0.9,
                                                        weight_decay=1e-4, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw),
}
TORCH_KW = {"torch_single": {"foreach": False}, "torch_foreach": {"foreach": True},
            "torch_fused": {"fused": True}}


@pytest.mark.parametrize("impl", ["ferro_fused", *TORCH_KW])
@pytest.mark.parametrize("config", list(FERRO))
def bench_step_against_torch(benchmark, config, impl):
    benchmark.group = f"{config} step float32 4Mi elements: ferro vs torch (1 thread)"
    benchmark.extra_info["bytes"] = N * 4 * (3 if config.startswith("sgd") else 4)
    rng = np.random.default_rng(0)
    data, grad = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N)
    grad = (grad * 1e-3).astype(np.float32)
    if impl == "ferro_fused":
        p = Parameter(data)
        p.grad = grad
        opt = FERRO[config]([p])
        step = opt.step
    else:
        benchmark.extra_info["role"] = "peer"
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        t = torch.nn.Parameter(torch.from_numpy(data))
        t.grad = torch.from_numpy(grad)
        try:
            opt = TORCH[config]([t], **TORCH_KW[impl])
            opt.step()
        except (RuntimeError, TypeError) as exc:  # a torch without this CPU path
            torch.set_num_threads(threads)
            pytest.skip(f"torch {torch.__version__}: {impl}: {exc}")
        step = opt.step
    step()  # the state exists before timing
    try:
        benchmark(step)
    finally:
        if impl != "ferro_fused":
            torch.set_num_threads(threads)

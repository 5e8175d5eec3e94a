"""DDP and FSDP check at construction that every rank wraps the same parameters (names, shapes,
dtypes, requires_grad), as torch's DDP verifies them: where one rank's differ, every rank raises
CollectiveMismatchError at once, naming the rank and the parameter, instead of one rank waiting
in a collective its peers never call until its deadline."""

import time

import numpy as np
import pytest
from _helpers import make_mlp, run

from ferro_backend import CollectiveMismatchError
from ferro_fsdp import DDP, FSDP, ShardingStrategy, nn

WRAPPERS = {"DDP": lambda m, b: DDP(m, b),
            "FSDP": lambda m, b: FSDP(m, b),
            "FSDP per layer": lambda m, b: FSDP(m, b, wrap=nn.Linear),
            "SHARD_GRAD_OP": lambda m, b: FSDP(m, b, strategy=ShardingStrategy.SHARD_GRAD_OP)}


def _differ(kind, rank):
    if rank != 1:
        return make_mlp(dims=(4, 6, 3))
    if kind == "count":
        return make_mlp(dims=(4, 6, 6, 3))
    if kind == "shape":
        return make_mlp(dims=(4, 5, 3))
    m = make_mlp(dims=(4, 6, 3))
    if kind == "frozen":
        m.parameters()[0].requires_grad = False
    else:  # dtype
        m = make_mlp(dims=(4, 6, 3), dtype=np.float32)
    return m


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("kind, said", [
    ("count", "rank 0 has 4 parameters, rank 1 6"),
    ("shape", r"parameter 0: rank 0's is \('0.weight', \(6, 4\), '<f8', True\), "
              r"rank 1's \('0.weight', \(5, 4\)"),
    ("frozen", r"rank 1's \('0.weight', \(6, 4\), '<f8', False\)"),
    ("dtype", "'<f4'")], ids=["count", "shape", "frozen", "dtype"])
def test_every_rank_raises_at_once_naming_what_differs(wrapper, kind, said):
    name = wrapper.split()[0] if wrapper != "SHARD_GRAD_OP" else "FSDP"

    def fn(b):
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError, match=said) as info:
            WRAPPERS[wrapper](_differ(kind, b.rank), b)
        assert str(info.value).startswith(f"{name}: the ranks wrap different parameters")
        return time.monotonic() - start

    assert max(run(fn, 3, timeout=30)) < 10  # at once, not at a deadline


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_the_same_parameters_pass(wrapper):
    def fn(b):
        return len(WRAPPERS[wrapper](make_mlp(dims=(4, 6, 3)), b).parameters())

    assert run(fn, 2) == [4, 4]

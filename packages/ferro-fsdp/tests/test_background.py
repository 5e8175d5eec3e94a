"""Where DDP's and FSDP's collectives run (ferro_fsdp.background): the choice, and the same bits
either way, on simulated ranks and on real processes over the same-host engine."""

import os
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from _helpers import FS, HS, SGO, make_data, make_mlp, make_opt, run, train_steps

from ferro_backend import settings
from ferro_backend.testing import run_processes
from ferro_fsdp import DDP, FSDP, nn
from ferro_fsdp.background import ranks_on_this_host, runs_in_background, usable_cores

EVEN = (8, 12, 16, 4)


def test_the_ranks_on_this_host_come_from_the_hierarchy_the_engine_or_the_launcher():
    engine = SimpleNamespace(engine=SimpleNamespace(nranks=3))
    assert ranks_on_this_host(engine) == 3
    multi = SimpleNamespace(hierarchy=SimpleNamespace(local_world=2), engine=None)
    assert ranks_on_this_host(multi) == 2
    sub = SimpleNamespace(parent=engine)  # a subgroup counts its whole job's ranks
    assert ranks_on_this_host(sub) == 3
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "5"}):
        assert ranks_on_this_host(SimpleNamespace()) == 5
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": ""}):
        assert ranks_on_this_host(SimpleNamespace()) is None
    with settings.override(HOST_RANKS=8):  # emulated nodes sharing this host
        assert ranks_on_this_host(engine) == 8 and ranks_on_this_host(multi) == 8
        assert runs_in_background(multi, None) is (usable_cores() > 8)
        # one rank a node over TCP (no engine, no hierarchy): the launcher's count, and the
        # other emulated nodes' ranks on this host too (it counted 1 of 2 on 2 cores before,
        # so FSDP's collectives ran in the background beside a core-bound peer)
        with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "1"}):
            assert ranks_on_this_host(SimpleNamespace()) == 8
            assert runs_in_background(SimpleNamespace(), None) is (usable_cores() > 8)


def test_auto_runs_in_background_only_with_a_core_to_spare():
    cores = usable_cores()
    fills = SimpleNamespace(engine=SimpleNamespace(nranks=cores))
    spare = SimpleNamespace(engine=SimpleNamespace(nranks=cores - 1))
    unknown = SimpleNamespace()
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": ""}):
        assert runs_in_background(fills, None) is False
        assert runs_in_background(spare, None) is (cores > 1)
        assert runs_in_background(unknown, None) is True
        assert runs_in_background(fills, True) is True
        assert runs_in_background(spare, False) is False
        with settings.override(BACKGROUND="on"):
            assert runs_in_background(fills, None) is True
        with settings.override(BACKGROUND="off"):
            assert runs_in_background(unknown, None) is False
    with pytest.raises(TypeError, match="background='yes'"):
        runs_in_background(fills, "yes")


def test_the_setting_names_what_it_takes():
    with mock.patch.dict(os.environ, {"FERRO_BACKGROUND": "sometimes"}), \
            pytest.raises(Exception, match="FERRO_BACKGROUND"):
        settings.BACKGROUND.get()


def train(b, kind, background, strategy=FS, intra=None):
    x, y = make_data(8 * b.world_size, dims=EVEN)
    model = make_mlp(EVEN, seed=3)
    if kind == "ddp":
        w = DDP(model, b, bucket_cap_mb=0.0005, background=background)  # several buckets
    else:
        w = FSDP(model, b, strategy, wrap=nn.Linear, intra_node_size=intra,
                 background=background)
    assert w._background is background
    o = make_opt("adam", w.module.parameters())
    lo = slice(8 * b.rank, 8 * b.rank + 8)
    losses = train_steps(w, o, nn.CrossEntropyLoss(), x[lo], y[lo], 3)
    state = (w.full_state_dict() if kind == "fsdp"
             else {n: p.data for n, p in w.module.named_parameters()})
    return losses, {k: np.asarray(v).tobytes() for k, v in state.items()}


@pytest.mark.parametrize("kind,strategy,world,intra", [("ddp", None, 2, None),
                                                       ("fsdp", FS, 2, None),
                                                       ("fsdp", SGO, 3, None),
                                                       ("fsdp", HS, 4, 2)])
def test_the_training_thread_gives_the_bits_of_the_background(kind, strategy, world, intra):
    bg = run(lambda b: train(b, kind, True, strategy, intra), world)
    fg = run(lambda b: train(b, kind, False, strategy, intra), world)
    assert bg == fg


def _both(b):
    return train(b, "ddp", True), train(b, "ddp", False), train(b, "fsdp", True), \
        train(b, "fsdp", False)


def test_the_same_bits_on_real_processes_over_the_engine():
    for ddp_bg, ddp_fg, fsdp_bg, fsdp_fg in run_processes(_both, 2, transport="shm",
                                                          timeout=120):
        assert ddp_bg == ddp_fg
        assert fsdp_bg == fsdp_fg
    assert np.isfinite(ddp_bg[0]).all()

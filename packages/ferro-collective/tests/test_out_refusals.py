"""A bad ``out=`` is refused before any data moves, so every rank of the call raises: the rank
that passed it its own error, its peers CollectiveMismatchError naming it."""

import numpy as np
import out_fns
import pytest
from test_rooted import collect

import ferro_collective as fc
from ferro_backend import CollectiveMismatchError
from ferro_backend.testing import run_processes, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")


def _refused_by_rank_1(errors, own_type, own_text):
    assert sorted(errors) == [0, 1], errors
    assert isinstance(errors[1], own_type) and own_text in str(errors[1]), repr(errors[1])
    assert isinstance(errors[0], CollectiveMismatchError), repr(errors[0])
    assert "rank 1 refused the call" in str(errors[0]), str(errors[0])


# ------------------------------------------------------------------------ out= an ndarray subclass
@pytest.mark.parametrize("call", ["allreduce", "all_gather", "broadcast", "reduce_scatter"])
def test_a_matrix_out_is_refused_before_any_data_moves(call):
    def body(b):
        x = np.arange(4, dtype=np.float32).reshape(2, 2) + b.rank
        shape = {"all_gather": (4, 2), "reduce_scatter": (1, 2)}.get(call, (2, 2))
        out = np.zeros(shape, np.float32)
        getattr(fc, call)(x, b, out=np.matrix(out) if b.rank == 1 else out, timeout=10)

    _refused_by_rank_1(collect(body, 2), TypeError, "numpy.matrix")


def test_a_memmap_or_masked_out_is_still_written(tmp_path):
    def body(b):
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + b.rank
        mm = np.memmap(tmp_path / f"out{b.rank}", dtype=np.float32, mode="w+", shape=(2, 3))
        masked = np.ma.zeros((2, 3), np.float32)
        a = fc.allreduce(x, b, out=mm, timeout=10)
        c = fc.allreduce(x, b, out=masked, timeout=10)
        return a is mm and c is masked and np.asarray(mm).tolist() == np.asarray(c).tolist()

    assert run_ranks(body, 2, timeout=30) == [True, True]


# ------------------------------------------------------ the uneven and rooted calls' out= checks
@pytest.mark.parametrize("transport", ["threads", "shm", "tcp"])
def test_an_out_known_wrong_before_the_data_moves_is_refused_on_every_rank(transport):
    if transport == "threads":
        res = run_ranks(out_fns.early, 2, timeout=60)
    else:
        res = run_processes(out_fns.early, 2, transport=transport, timeout=120)
    for name in out_fns.EARLY:
        (peer, peer_text, after0), (own, own_text, after1) = res[0][name], res[1][name]
        assert own in ("TypeError", "ValueError", "SizeMismatchError"), (name, own, own_text)
        assert peer == "CollectiveMismatchError", (name, peer, peer_text)
        assert "rank 1 refused the call" in peer_text and own in peer_text, (name, peer_text)
        assert after0 == after1 == [2.0], name


@pytest.mark.parametrize("transport", ["threads", "shm"])
@pytest.mark.parametrize("bad", [1, 2, 3])
def test_a_non_roots_out_known_wrong_only_from_the_root_raises_there_alone(transport, bad):
    """broadcast(None) and scatter: the rank still takes part (a tree's children wait for it:
    rank 2's broadcast timed out on rank 3), then raises; its peers return."""
    if transport == "threads":
        res = run_ranks(lambda b: out_fns.late(b, bad), 4, timeout=60)
    else:
        res = run_processes(out_fns.late, 4, bad, transport=transport, timeout=120)
    for name, chunk in (("broadcast", list(range(8))), ("scatter", None)):
        for r, got in enumerate(res):
            what, value, after = got[name]
            assert after == [4.0], (name, r, got)
            if r == bad:
                assert what == "SizeMismatchError" and "out is float64" in value, (name, got)
            else:
                want = chunk if chunk is not None else [2.0 * r, 2.0 * r + 1]
                assert (what, value) == ("returned", want), (name, r, got)

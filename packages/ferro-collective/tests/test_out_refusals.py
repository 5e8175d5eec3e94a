"""A bad ``out=`` is refused before any data moves, so every rank of the call raises: the rank
that passed it its own error, its peers CollectiveMismatchError naming it."""

import numpy as np
import pytest
from test_rooted import collect

import ferro_collective as fc
from ferro_backend import CollectiveMismatchError
from ferro_backend.testing import run_ranks

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

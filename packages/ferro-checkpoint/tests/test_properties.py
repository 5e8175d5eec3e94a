"""Hypothesis: save with N ranks, load with M (1..8), random shapes, shard dims and dtypes, every
way of reading (copies, zero-copy views verified up front or on lookup, the caller's arrays,
threads) and checksum chunk sizes; the kernels against numpy; the shard-split rule against
ferro-backend's, where it is installed."""

import numpy as np
import pytest
from _util import save_all, shards_of, spec_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_checkpoint import (
    compute_shard_sizes,
    concat_along_dim,
    copy_plan,
    load_distributed,
    safetensors_io,
    slice_along_dim,
)

READS = [{}, {"mmap": True}, {"mmap": True, "verify": "lazy"}, {"verify": False}, {"out": True},
         {"threads": 3}]

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.bool_]
try:
    import ml_dtypes

    DTYPES.append(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    pass


@st.composite
def state_dicts(draw):
    n = draw(st.integers(1, 4))
    full, dims = {}, {}
    for i in range(n):
        dt = draw(st.sampled_from(DTYPES))
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9))
        raw = draw(hnp.arrays(np.float32 if np.dtype(dt).kind == "V" else dt, shape))
        full[f"t{i}"] = raw.astype(dt)
        dims[f"t{i}"] = draw(st.integers(0, len(shape) - 1))
    return full, dims


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sd=state_dicts(), n=st.integers(1, 8), m=st.integers(1, 8),
       read=st.sampled_from(READS), chunk=st.sampled_from([1, 8, 40, 1 << 20]))
def test_save_n_load_m(tmp_path_factory, sd, n, m, read, chunk):
    full, dims = sd
    d = tmp_path_factory.mktemp("ckpt")
    saved = safetensors_io.CHUNK, copy_plan.THREAD_MIN, copy_plan.PIECE_MIN
    safetensors_io.CHUNK = chunk  # several chunks per tensor, and reshard windows inside them
    copy_plan.THREAD_MIN = copy_plan.PIECE_MIN = 0  # threads even for these small loads
    try:
        save_all(full, d, n, dims)
        new_spec = spec_for(full, m, dims)
        for r in range(m):
            want = shards_of(full, new_spec, r)
            kwargs = dict(read)
            if kwargs.pop("out", False):
                kwargs["out"] = {k: np.full_like(v, 1) for k, v in want.items()}
            got = load_distributed(d, r, m, **kwargs)
            check(got, want, full, kwargs)
    finally:
        safetensors_io.CHUNK, copy_plan.THREAD_MIN, copy_plan.PIECE_MIN = saved


def check(got, want, full, kwargs):
    if "out" in kwargs:
        assert all(got[k] is kwargs["out"][k] for k in full)
    if kwargs.get("mmap"):
        assert all(not got[k].flags.writeable for k in full)
    for k in full:
        assert got[k].dtype == full[k].dtype
        assert got[k].tobytes() == want[k].tobytes() and got[k].shape == want[k].shape


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(
    np.float32 if np.dtype(dt).kind == "V" else dt,
    hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5))), st.data())
def test_kernels_match_numpy(arr, data):
    dim = data.draw(st.integers(0, arr.ndim - 1))
    a = data.draw(st.integers(0, arr.shape[dim]))
    b = data.draw(st.integers(a, arr.shape[dim]))
    idx = [slice(None)] * arr.ndim
    idx[dim] = slice(a, b)
    np.testing.assert_array_equal(slice_along_dim(arr, dim, a, b), arr[tuple(idx)])
    parts = [slice_along_dim(arr, dim, 0, a), slice_along_dim(arr, dim, a, arr.shape[dim])]
    np.testing.assert_array_equal(concat_along_dim(parts, dim), np.concatenate(parts, axis=dim))


def test_kernel_errors_name_the_problem():
    from ferro_checkpoint import InvalidArgumentError, TensorError

    with pytest.raises(InvalidArgumentError, match="dim 2 is out of range"):
        slice_along_dim(np.zeros((2, 2)), 2, 0, 1)
    with pytest.raises(InvalidArgumentError, match=r"\[1, 5\) is out of range"):
        slice_along_dim(np.zeros(3), 0, 1, 5)
    with pytest.raises(TensorError, match="dtype"):
        concat_along_dim([np.zeros(2), np.zeros(2, np.float32)], 0)
    with pytest.raises(TensorError, match="incompatible"):
        concat_along_dim([np.zeros((2, 3)), np.zeros((2, 4))], 0)


def test_compute_shard_sizes_is_the_backend_split_rule():
    """ferro_backend.partition.split_sizes is the rule's single home; ferro-checkpoint keeps a
    copy (it does not depend on ferro-backend) that must agree with it everywhere."""
    pytest.importorskip("ferro_backend")
    from ferro_backend.partition import split_sizes

    @settings(max_examples=500, deadline=None)
    @given(n=st.integers(0, 100_000), world=st.integers(1, 512))
    def agree(n, world):
        assert compute_shard_sizes(n, world) == split_sizes(n, world)

    agree()
    for n in range(40):
        for world in range(1, 17):
            assert compute_shard_sizes(n, world) == split_sizes(n, world)

"""The files are standard safetensors: ``safetensors.numpy.load_file`` (a test requirement, not a
runtime one) reads every shard and a consolidated file unchanged."""

import numpy as np
import pytest
from _util import save_all, shards_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ferro_checkpoint import consolidate

safetensors_numpy = pytest.importorskip("safetensors.numpy")

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.uint16, np.uint32, np.uint64, np.bool_]


@st.composite
def state_dicts(draw):
    full, dims = {}, {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7))
        full[f"t{i}"] = draw(hnp.arrays(draw(st.sampled_from(DTYPES)), shape))
        dims[f"t{i}"] = draw(st.integers(0, len(shape) - 1))
    return full, dims


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sd=state_dicts(), world=st.integers(1, 4))
def test_every_shard_and_the_consolidated_file_load_with_safetensors(tmp_path_factory, sd, world):
    full, dims = sd
    d = tmp_path_factory.mktemp("ckpt")
    spec = save_all(full, d, world, dims)
    for r in range(world):
        plain = safetensors_numpy.load_file(str(d / f"rank_{r}.safetensors"))
        want = shards_of(full, spec, r)
        assert sorted(plain) == sorted(want)
        for k, v in want.items():
            assert plain[k].dtype == v.dtype and plain[k].shape == v.shape
            assert plain[k].tobytes() == v.tobytes()
    consolidate(d, d / "full.safetensors")
    plain = safetensors_numpy.load_file(str(d / "full.safetensors"))
    for k, v in full.items():
        assert plain[k].dtype == v.dtype and plain[k].tobytes() == v.tobytes()


def test_bf16_shard_loads_with_safetensors(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    full = {"w": (np.arange(12, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16).reshape(4, 3)}
    spec = save_all(full, tmp_path, 2)
    try:
        plain = safetensors_numpy.load_file(str(tmp_path / "rank_1.safetensors"))
    except (TypeError, ValueError, KeyError) as exc:  # older safetensors: no numpy bfloat16
        pytest.skip(f"this safetensors cannot load BF16 into numpy: {exc}")
    want = shards_of(full, spec, 1)["w"]
    assert plain["w"].shape == want.shape and plain["w"].tobytes() == want.tobytes()

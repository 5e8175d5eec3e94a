"""The package itself, without processes: registration, public surface, zero-copy views."""

import re
from pathlib import Path

import ferro_torch
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ferro_torch import _convert
from ferro_torch.errors import FerroTorchError, as_torch_error

SRC = Path(__file__).resolve().parent.parent / "src" / "ferro_torch"


def test_import_registers_the_ferro_backend_for_cpu():
    assert "FERRO" in dist.Backend._plugins
    assert dist.Backend._plugins["FERRO"].extended_api
    assert dist.Backend("ferro") == "ferro"
    assert dist.Backend.default_device_backend_map.get("cpu") == "gloo"  # nothing else changed
    assert dist.Backend.backend_capability["ferro"] == ["cpu"]


def test_public_surface_and_version():
    assert ferro_torch.__version__ == "0.1.0"
    for name in ferro_torch.__all__:
        assert hasattr(ferro_torch, name)
    assert issubclass(FerroTorchError, dist.DistBackendError)
    assert issubclass(FerroTorchError, RuntimeError)


def test_every_module_is_installed_by_meson():
    meson = (SRC / "meson.build").read_text()
    listed = set(re.findall(r"'([^'/]+\.py|py\.typed)'", meson))
    assert {p.name for p in SRC.glob("*.py")} | {"py.typed"} == listed
    # the compiled backend's sources, which are built at first use from the installed copy
    csrc = set(re.findall(r"'csrc/([^']+)'", meson))
    assert {p.name for p in (SRC / "csrc").iterdir() if p.suffix in (".cpp", ".hpp")} == csrc


def test_ferro_errors_become_torch_errors_and_argument_errors_stay():
    from ferro_backend import CollectiveMismatchError, PeerClosedError

    for exc in (PeerClosedError("recv: rank 1 is gone"), CollectiveMismatchError("mismatch")):
        err = as_torch_error(exc, "ferro allreduce")
        assert isinstance(err, FerroTorchError) and err.__cause__ is exc
        assert str(exc) in str(err)
    bad = TypeError("bad dtype")
    assert as_torch_error(bad, "x") is bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.bool, torch.uint8])
def test_tensors_are_seen_as_numpy_views_without_a_copy(dtype):
    t = torch.zeros(6, dtype=dtype)
    a = _convert.as_array(t)
    assert a.shape == (6,) and a.ctypes.data == t.data_ptr()
    a[2] = 1
    assert t[2].item() == 1
    if dtype is torch.bfloat16:
        assert a.dtype == _convert.BFLOAT16


def test_requires_grad_tensors_and_non_contiguous_outputs():
    p = torch.zeros(4, requires_grad=True)
    assert _convert.as_array(p).ctypes.data == p.data_ptr()
    t = torch.zeros(3, 2).t()
    with _convert.writable(t) as a:
        a[...] = np.arange(6)
    assert torch.equal(t, torch.arange(6.).view(2, 3))


def test_span_joins_chunks_of_one_tensor_only():
    whole = torch.arange(12.)
    s = _convert.span(list(whole.chunk(3)))
    assert s is not None and s.data_ptr() == whole.data_ptr() and s.numel() == 12
    assert _convert.span([torch.zeros(4), torch.zeros(4)]) is None
    assert _convert.span(list(whole.chunk(3))[::-1]) is None


def test_cuda_tensors_are_refused_with_a_message():
    with pytest.raises(TypeError, match="torch.Tensor"):
        _convert.check_cpu("allreduce", np.zeros(3))


def test_every_binding_a_record_names_exists():
    """A collective's record (ferro_collective.records) names the torch.distributed call the
    "ferro" backend serves with it; each is torch's."""
    import torch.distributed as dist

    from ferro_collective import records

    named = [c.torch for c in records.ALL if c.torch]
    assert len(named) == 12
    for name in named:
        assert callable(getattr(dist, name)), name

"""The compiled kernel is the one in use, and the package is what was built."""

import importlib.machinery
import os

import ferro_backend
from ferro_backend import _wire


def test_wire_and_reduction_kernels_are_extension_modules():
    from ferro_backend.kernels import _fold

    for kernel in (_wire, _fold):
        assert kernel.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_same_host_kernel_is_compiled_and_in_use_on_linux(monkeypatch):
    import sys

    from ferro_backend import engine
    from ferro_backend.engine import shm
    from ferro_backend.joining import meet
    from ferro_backend.launch import ferrorun

    if sys.platform.startswith("linux"):
        from ferro_backend.engine import _comm, _ring, _segment, _steps, _watch

        assert engine.AVAILABLE
        for kernel in (_segment, _comm, _steps, _ring, _watch):
            assert kernel.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        assert ferrorun._default_transport(1) == "shm"
    # where the kernel does not exist, ShmBackend says so (simulated here) and TCP is the default
    monkeypatch.setattr(shm, "SAME_HOST_ENGINE", False)
    monkeypatch.setattr(meet, "SAME_HOST_ENGINE", False)
    try:
        shm.ShmBackend(0, 1, "127.0.0.1:1")
    except RuntimeError as exc:
        assert "needs Linux" in str(exc) and "TcpBackend" in str(exc)
    else:
        raise AssertionError("ShmBackend did not refuse")
    assert ferrorun._default_transport(1) == "tcp"


def test_package_is_installed_not_the_source_tree():
    assert "site-packages" in ferro_backend.__file__ or "dist-packages" in ferro_backend.__file__


def test_version_comes_from_metadata():
    assert ferro_backend.__version__ == "0.1.0"


def test_public_names_are_importable():
    for name in ferro_backend.__all__:
        assert getattr(ferro_backend, name) is not None, name


def test_only_expected_layers_installed():
    # nox's tests session sets this: the layering is real, upper layers are absent.
    layers = os.environ.get("FERRO_INSTALLED_LAYERS")
    if layers is None:
        return
    import importlib.util

    for name in ("ferro_collective", "ferro_fsdp", "ferro_checkpoint"):
        dist = name.replace("_", "-")
        assert (importlib.util.find_spec(name) is not None) == (dist in layers.split(","))


def test_the_kernels_share_one_compiled_cython_utility_module():
    """Cython's utility code (memoryviews) is built once per distribution and imported by each
    kernel as it loads, not compiled into every kernel."""
    import sys

    import ferro_backend._wire  # noqa: F401

    util = sys.modules["ferro_backend._cyutility"]
    assert util.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))

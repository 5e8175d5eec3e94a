import importlib.machinery
import importlib.util
import os

import ferro_checkpoint
from ferro_checkpoint import _along_dim


def test_kernel_is_an_extension_module():
    assert _along_dim.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_public_names():
    for name in ferro_checkpoint.__all__:
        assert getattr(ferro_checkpoint, name) is not None
    assert ferro_checkpoint.__version__ == "0.1.0"


def test_needs_only_numpy_and_safetensors():
    layers = os.environ.get("FERRO_INSTALLED_LAYERS")
    if layers is not None:  # under nox: installed alone
        assert layers == "ferro-checkpoint"
        assert importlib.util.find_spec("ferro_backend") is None

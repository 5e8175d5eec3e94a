"""The installed package: what was built, its version, its public names and its layers."""

import importlib.machinery
import importlib.util
import os

import ferro_backend
import ferro_fsdp
from ferro_backend import _wire


def test_package_is_installed_not_the_source_tree():
    assert "site-packages" in ferro_fsdp.__file__ or "dist-packages" in ferro_fsdp.__file__


def test_the_flattening_kernel_is_compiled():
    # flatten/unflatten run in ferro-backend's pack/unpack (ferro-fsdp's own kernels, the
    # optimizer step and GELU's erf, are checked in test_optim_step.py and test_transformer.py)
    assert _wire.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    import ferro_fsdp.flat as flat
    assert flat.pack is ferro_backend.pack and flat.unpack is ferro_backend.unpack


def test_version_comes_from_metadata():
    assert ferro_fsdp.__version__ == "0.1.0"


def test_public_names_are_importable():
    for name in ferro_fsdp.__all__:
        assert getattr(ferro_fsdp, name) is not None, name
    for name in ("Parameter", "Module", "ShardingStrategy", "FSDP", "DistributedDataParallel", "DDP"):
        assert name in ferro_fsdp.__all__
    for name in ("Linear", "ReLU", "Sequential", "MSELoss", "CrossEntropyLoss", "Embedding",
                 "LayerNorm", "GELU", "Dropout", "CausalSelfAttention", "TransformerBlock"):
        assert name in ferro_fsdp.nn.__all__ and hasattr(ferro_fsdp.nn, name)
    for name in ("SGD", "Adam", "AdamW"):
        assert hasattr(ferro_fsdp.optim, name)
    assert [m.name for m in ferro_fsdp.ShardingStrategy] == [
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]


def test_only_expected_layers_installed():
    layers = os.environ.get("FERRO_INSTALLED_LAYERS")
    if layers is None:
        return
    assert (importlib.util.find_spec("ferro_checkpoint") is not None) == (
        "ferro-checkpoint" in layers.split(","))
    assert importlib.util.find_spec("ferro_collective") is not None

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import ferro_checkpoint
from ferro_checkpoint import _along_dim, _copy_crc


def test_kernels_are_extension_modules():
    for kernel in (_along_dim, _copy_crc):
        assert kernel.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_public_names():
    for name in ferro_checkpoint.__all__:
        assert getattr(ferro_checkpoint, name) is not None
    assert ferro_checkpoint.__version__ == "0.1.0"


def test_needs_only_numpy():
    """The runtime requirements are numpy alone (the safetensors library is a test extra); under
    nox, where ferro-checkpoint is installed alone, no ferro layer is importable."""
    runtime = [r for r in importlib.metadata.requires("ferro-checkpoint") or []
               if "extra ==" not in r]
    assert [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in runtime] == ["numpy"]
    for extra in ("backend", "collective"):  # `collective`: deprecated alias of `backend`
        reqs = [r for r in importlib.metadata.requires("ferro-checkpoint")
                if re.search(rf"extra == .{extra}.", r)]
        assert [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in reqs] == ["ferro-backend"]
    layers = os.environ.get("FERRO_INSTALLED_LAYERS")
    if layers is not None:  # under nox: installed alone
        assert layers == "ferro-checkpoint"
        assert importlib.util.find_spec("ferro_backend") is None


def test_safetensors_library_is_not_imported(tmp_path):
    """Saving, loading, resharding and consolidating never import the safetensors library."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import ferro_checkpoint as fc

        d = sys.argv[1]
        spec = fc.ShardMetadata(2, {"w": fc.TensorShardSpec((4, 3), 0, (2, 2))})
        for r in range(2):
            fc.save_distributed({"w": np.full((2, 3), r, np.float32)}, d, r, 2, spec)
        fc.load_distributed(d, 0, 2)
        fc.reshard(d, 2, 3, 1)
        fc.consolidate(d, d + "/full.safetensors")
        assert "safetensors" not in sys.modules, "safetensors was imported"
    """)
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)


def test_the_kernels_share_one_compiled_cython_utility_module():
    """Cython's utility code (memoryviews) is built once per distribution and imported by each
    kernel as it loads, not compiled into every kernel."""
    import sys

    import ferro_checkpoint._along_dim
    import ferro_checkpoint._copy_crc  # noqa: F401

    util = sys.modules["ferro_checkpoint._cyutility"]
    assert util.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))

"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print.

The other packages use ``ferro_backend.readme_blocks`` for this; ferro-checkpoint is tested
without ferro-backend installed, so it keeps these few lines of its own.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"  # packages/<dist>/README.md


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def run_block(code: str, tmp_path: Path) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"README block printed nothing:\n{code}"
    return r.stdout


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> list[str]:
    """Every block once (ferro_backend.readme_blocks.run_readme's few lines, kept here)."""
    assert README.is_file(), README
    blocks = python_blocks()
    assert blocks, f"no ```python block in {README}"
    return [run_block(code, tmp_path_factory.mktemp("readme")) for code in blocks]


def test_manager_example_prints_the_kept_steps_and_the_restored_rows(outputs):
    out = outputs[0]
    assert "steps kept [100, 200, 300]" in out, out
    assert "w[:, 0] = [300.0, 300.0, 300.0, 301.0, 301.0, 301.0]" in out, out


def test_identity_example_refuses_the_copied_shard_and_the_corrupt_tensor(outputs):
    assert len(outputs) == 3
    out = outputs[1]
    assert "refused: ShardMismatchError True" in out, out
    assert "corrupt: ChecksumMismatchError True" in out, out
    assert "unverified load: (2, 2)" in out, out


def test_loading_example_maps_checks_lazily_and_loads_into_given_arrays(outputs):
    out = outputs[2]
    assert "mmap: writable False [1.0, 1.0]" in out, out
    assert "lazy: LazyTensors (2, 3)" in out, out
    assert "out: [0.0, 0.0, 1.0, 1.0]" in out, out

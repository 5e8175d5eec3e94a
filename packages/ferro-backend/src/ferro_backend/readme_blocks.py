"""Run a README's ```python blocks as a reader would: each alone, in a fresh interpreter.

Every package's ``tests/test_readme.py`` uses these (ferro-checkpoint keeps a copy of its own:
it is tested without ferro-backend installed).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def python_blocks(readme: Path) -> list[str]:
    """The ```python blocks of ``readme``, in order."""
    return re.findall(r"^```python\n(.*?)^```", Path(readme).read_text(), re.S | re.M)


def run_block(code: str, cwd: Path, timeout: float = 120.0) -> str:
    """Run ``code`` with this interpreter in ``cwd``; its output. AssertionError (with the
    block and its stderr) when it fails or prints nothing."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, cwd=cwd)
    assert r.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"README block printed nothing:\n{code}"
    return r.stdout


def run_readme(readme: Path, cwd: Path, timeout: float = 120.0) -> list[str]:
    """Run every ```python block of ``readme`` once, each alone; their outputs, in order.
    AssertionError when the README is missing, has no block, or a block fails or is silent."""
    readme = Path(readme)
    assert readme.is_file(), f"no README at {readme}"
    blocks = python_blocks(readme)
    assert blocks, f"no ```python block in {readme}"
    return [run_block(code, cwd, timeout) for code in blocks]


__all__ = ["python_blocks", "run_block", "run_readme"]

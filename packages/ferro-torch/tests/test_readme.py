"""The README's code block runs as written under ferrorun and prints what it promises."""

import re
import subprocess
from pathlib import Path

import pytest
from _launch import BIN, _base_env

from ferro_backend.readme_blocks import python_blocks

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.timeout(90)
def test_readme_block_trains_ddp_under_ferrorun(tmp_path):
    (block,) = python_blocks(README)
    script = tmp_path / "ddp.py"
    script.write_text(block)
    r = subprocess.run([str(BIN / "ferrorun"), "--nproc", "2", str(script)], capture_output=True,
                       text=True, timeout=80, env=_base_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = sorted(line for line in r.stdout.splitlines() if "all_reduce" in line)
    assert len(lines) == 2, r.stdout
    for rank, line in enumerate(lines):
        m = re.fullmatch(rf"\[rank {rank}\] rank {rank} of 2: all_reduce 3, loss (\S+) -> (\S+)",
                         line)
        assert m, line
        assert float(m[2]) < float(m[1]) / 100  # it learned

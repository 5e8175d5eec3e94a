"""The repository's structure holds, as ``nox -s lint`` checks it: no import cycle inside a
distribution, no callable handed to compiled code to call back up, no source module over 500
lines, no import up the layers (``tools/check_layers.py --static``), run here too so that the
README's test line guards it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_static_layering_holds():
    script = ROOT / "tools" / "check_layers.py"
    assert script.is_file(), f"no {script}: these tests run from a checkout of the repository"
    r = subprocess.run([sys.executable, str(script), "--static", str(ROOT)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 cycles, 0 up-calls, 0 oversize, 0 upward imports" in r.stdout

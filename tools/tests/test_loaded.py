"""tools/loaded.py: the tests it is given run beside busy loops, which it stops at the end; a
failing run makes its exit code 1 and prints the failure."""

from __future__ import annotations

import os

import loaded
import pytest


def _spinners() -> set[int]:
    """Our children's pids that run loaded's busy loop."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if loaded.SPIN.encode() in f.read():
                        found.add(int(pid))
            except OSError:
                continue
    return found


def test_a_passing_and_a_failing_run_beside_busy_loops(tmp_path, capsys):
    before = _spinners()
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    assert loaded.main(["--loops", "1", "--repeat", "2", str(tmp_path / "test_ok.py")]) == 0
    out = capsys.readouterr().out
    assert "beside 1 busy loops: 1 passed" in out and "2 of 2 runs passed" in out
    assert loaded.main(["--loops", "0", "--repeat", "1", str(tmp_path / "test_bad.py")]) == 1
    out = capsys.readouterr().out
    assert "1 failed" in out and "0 of 1 runs passed" in out and "assert 1 == 2" in out
    assert _spinners() <= before  # (every busy loop stopped)


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        loaded.main(["--loops", "-1"])
    with pytest.raises(SystemExit):
        loaded.main(["--repeat", "0"])


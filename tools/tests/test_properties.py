"""tools/properties.py: each package's hypothesis tests run once per seed; a property that
fails on some draw makes the exit code 1 and prints the failing example."""

from __future__ import annotations

import properties
import pytest

pytest.importorskip("hypothesis")


def _package(folder, body: str):
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "test_prop.py").write_text(
        "from hypothesis import given, strategies as st\n\n"
        "def test_plain():\n    assert True\n\n" + body)
    return folder


def test_a_passing_and_a_failing_property_under_seeds(tmp_path, capsys):
    good = _package(tmp_path / "good", "@given(st.integers(0, 9))\ndef test_ok(x):\n"
                                       "    assert 0 <= x <= 9\n")
    bad = _package(tmp_path / "bad", "@given(st.integers(0, 9))\ndef test_bad(x):\n"
                                     "    assert x < 7\n")
    assert properties.main(["--seeds", "2", "--first", "3", str(good)]) == 0
    out = capsys.readouterr().out
    assert "good seed 3: 1 passed, 1 deselected" in out and "good seed 4:" in out
    assert "2 of 2 runs passed" in out
    assert properties.main(["--seeds", "1", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad seed 1: " in out and "1 failed" in out and "assert 7 < 7" in out  # (shrunk)
    assert "0 of 1 runs passed" in out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        properties.main(["--seeds", "0"])

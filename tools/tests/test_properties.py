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


def test_a_passing_and_a_failing_property_under_seeds(tmp_path, capsys, monkeypatch):
    good = _package(tmp_path / "good", "@given(st.integers(0, 9))\ndef test_ok(x):\n"
                                       "    assert 0 <= x <= 9\n")
    _package(tmp_path / "bad", "@given(st.integers(0, 9))\ndef test_bad(x):\n"
                               "    assert x < 7\n")
    assert properties.main(["--seeds", "2", "--first", "3", str(good)]) == 0
    out = capsys.readouterr().out
    assert "good seed 3: 1 passed, 1 deselected" in out and "good seed 4:" in out
    assert "2 of 2 runs passed" in out
    monkeypatch.chdir(tmp_path)  # a folder named relative to where the sweep starts
    assert properties.main(["--seeds", "1", "bad"]) == 1
    out = capsys.readouterr().out
    assert "bad seed 1: " in out and "1 failed" in out and "assert 7 < 7" in out  # (shrunk)
    assert "0 of 1 runs passed" in out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        properties.main(["--seeds", "0"])


def _drawn(folder, *args) -> str:
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                    str(folder / "tests")], cwd=folder, check=True, capture_output=True)
    return (folder / "drawn.txt").read_text()


def test_the_line_draws_the_same_examples_whatever_the_seed(tmp_path):
    """The test line passes noxfile.HYPOTHESIS; each property package's conftest registers that
    profile. Under it two seeds draw the same examples; without it they differ."""
    import ast
    from pathlib import Path
    root = Path(properties.ROOT)
    nox_tree = ast.parse((root / "noxfile.py").read_text())
    consts = {t.id: ast.literal_eval(node.value) for node in nox_tree.body
              if isinstance(node, ast.Assign) for t in node.targets
              if isinstance(t, ast.Name) and t.id in ("HYPOTHESIS", "PROPERTY_PACKAGES")}
    profile = consts["HYPOTHESIS"]
    holding = sorted(p.parents[1].name for p in root.glob("packages/*/tests/*.py")
                     if "hypothesis" in p.read_text())
    assert sorted(set(holding)) == sorted(consts["PROPERTY_PACKAGES"])  # none drawn at random
    registration = 'settings.register_profile("line", derandomize=True'  # (, deadline=None)
    for name in consts["PROPERTY_PACKAGES"]:
        conftest = root / "packages" / name / "tests" / "conftest.py"
        assert registration in conftest.read_text(), conftest
    # one of them, run: under the profile two seeds draw the same examples, without it not
    folder = _package(tmp_path, "@given(st.lists(st.integers(), min_size=3))\n"
                                "def test_draw(xs):\n"
                                "    with open('drawn.txt', 'a') as f:\n"
                                "        f.write(repr(xs))\n")
    conftest = root / "packages" / "ferro-collective" / "tests" / "conftest.py"
    (folder / "tests" / "conftest.py").write_text(conftest.read_text())
    for args, same in (([profile], True), ([], False)):
        first = _drawn(folder, *args, "--hypothesis-seed=1")
        second = _drawn(folder, *args, "--hypothesis-seed=2")[len(first):]
        (folder / "drawn.txt").unlink()
        assert (first == second) is same, args

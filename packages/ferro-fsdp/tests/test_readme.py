"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print."""

import re
from pathlib import Path

import pytest

from ferro_backend.readme_blocks import python_blocks as _blocks
from ferro_backend.readme_blocks import run_block

README = Path(__file__).resolve().parent.parent / "README.md"  # packages/<dist>/README.md


def python_blocks() -> list[str]:
    return _blocks(README)


def test_readme_has_python_blocks():
    assert README.is_file(), README
    assert python_blocks(), f"no ```python block in {README}"


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs_and_prints(index, tmp_path):
    run_block(python_blocks()[index], tmp_path)


def test_training_example_prints_a_falling_loss_on_every_rank(tmp_path):
    out = run_block(python_blocks()[0], tmp_path)
    pairs = [(float(a), float(b)) for a, b in re.findall(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)]
    assert len(pairs) == 2, out
    assert all(last < 0.5 * first for first, last in pairs), out


def test_state_dict_example_restores_on_another_world_size(tmp_path):
    out = run_block(python_blocks()[1], tmp_path)
    assert "'0.weight': ((32,), 0, (11, 11, 10))" in out and "restored: True" in out, out

"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print."""

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


def test_allreduce_example_prints_the_same_sum_and_max_on_every_rank(tmp_path):
    (code,) = python_blocks()
    lines = run_block(code, tmp_path).splitlines()
    assert lines == [f"rank {r}: sum [10.0, 10.0, 10.0], max [4.0, 4.0, 4.0]" for r in range(4)]

"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print
what they promise (each block runs once per test session)."""

import re
from pathlib import Path

import pytest

from ferro_backend.readme_blocks import run_readme

README = Path(__file__).resolve().parent.parent / "README.md"  # packages/<dist>/README.md


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> list[str]:
    return run_readme(README, tmp_path_factory.mktemp("readme"))


def test_training_example_prints_a_falling_loss_on_every_rank(outputs):
    out = outputs[0]
    pairs = [(float(a), float(b)) for a, b in re.findall(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)]
    assert len(pairs) == 2, out
    assert all(last < 0.5 * first for first, last in pairs), out


def test_state_dict_example_restores_on_another_world_size(outputs):
    out = outputs[1]
    assert "'0.weight': ((32,), 0, (11, 11, 10))" in out and "restored: True" in out, out


def test_transformer_example_trains_one_unit_per_block(outputs):
    out = outputs[2]
    assert out.count("units ['', 'h.0', 'h.1']") == 2, out
    pairs = [(float(a), float(b)) for a, b in re.findall(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)]
    assert len(pairs) == 2, out
    assert all(last < 0.5 * first for first, last in pairs), out

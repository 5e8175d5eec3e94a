"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print
what they promise (each block runs once per test session)."""

from pathlib import Path

import pytest

from ferro_backend.readme_blocks import run_readme

README = Path(__file__).resolve().parent.parent / "README.md"  # packages/<dist>/README.md


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> list[str]:
    return run_readme(README, tmp_path_factory.mktemp("readme"))


def test_allreduce_example_prints_the_same_sum_and_max_on_every_rank(outputs):
    out = outputs[0]
    assert out.splitlines() == [f"rank {r}: sum [10.0, 10.0, 10.0], max [4.0, 4.0, 4.0]"
                                for r in range(4)]


def test_rooted_uneven_and_object_example_prints_what_it_says(outputs):
    assert len(outputs) == 2
    names = "['worker-0', 'worker-1', 'worker-2']"
    assert outputs[1].splitlines() == [
        f"0 [6] [0 1 2] [0, 1] [0, 1, 2] [[], [], []] {names}",
        f"1 None None [2, 3] [0, 1, 2] [[0], [1], [2]] {names}",
        f"2 None None [4, 5] [0, 1, 2] [[0, 0], [1, 1], [2, 2]] {names}",
    ]

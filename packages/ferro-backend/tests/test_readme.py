"""The README's ```python blocks run as written, each alone in a fresh interpreter, and print
what they promise (each block runs once per test session)."""

from pathlib import Path

import pytest

from ferro_backend.readme_blocks import run_readme

README = Path(__file__).resolve().parent.parent / "README.md"  # packages/<dist>/README.md


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> list[str]:
    return run_readme(README, tmp_path_factory.mktemp("readme"))


def test_send_recv_example_prints_what_rank_1_received(outputs):
    (out,) = outputs
    assert "['sent', [0.0, 1.0, 2.0, 3.0]]" in out

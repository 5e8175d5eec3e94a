"""The documentation site builds with warnings as errors (``tests(docs)`` in ``./dev tests``),
so a broken docstring, reference or README include fails CI; and what it computes at build time
is on its pages."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ["ferro_backend", "ferro_collective", "ferro_fsdp", "ferro_checkpoint",
                 "ferro_torch", "ferro_jax"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
           "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr
    return out / "html"


def test_every_public_name_has_a_page(site: Path) -> None:
    from sphinx.ext.autodoc.mock import mock

    missing = []
    with mock(["torch"]):  # as conf.py documents ferro-torch
        for module in DISTRIBUTIONS:
            mod = importlib.import_module(module)
            package_page = (site / "api" / f"{module}.html").read_text()
            for name in mod.__all__:
                if type(getattr(mod, name)).__name__ == "module":
                    continue  # ferro_fsdp.nn and .optim: their names have pages
                # a page of its own, a constant on the package's page, or a re-export of a
                # lower layer's name linked to that layer's page
                home = getattr(getattr(mod, name), "__module__", module).split(".")[0]
                if not ((site / "api" / "generated" / f"{module}.{name}.html").exists()
                        or f'id="{module}.{name}"' in package_page
                        or (site / "api" / "generated" / f"{home}.{name}.html").exists()):
                    missing.append(f"{module}.{name}")
    assert not missing, f"no API page for {missing}"
    assert (site / "api" / "generated" / "ferro_fsdp.nn.Linear.html").exists()


def test_quickstart_ran_on_two_ranks(site: Path) -> None:
    page = (site / "examples.html").read_text()
    assert "ferrorun --nproc 2 examples/quickstart.py" in page
    assert "[rank 0] rank 0 of 2: loss" in page
    assert "[rank 1] rank 1 of 2: loss" in page
    assert "model_vs_measured.png" in page


PNG = b"\x89PNG\r\n\x1a\n"


def test_examples_ran_and_drew_their_figures(site: Path) -> None:
    """The examples page's runs happened at build time (train, resume on another world size,
    the language model, the bus bandwidth sweep) and each figure is a plot of that build."""
    page = (site / "examples.html").read_text()
    assert "resumed from step 140 of {tmp}/ckpt on 2 ranks" in page
    assert "held-out accuracy" in page and "held-out loss" in page
    assert "bus bandwidth, GB/s: 2 ranks" in page
    figures = sorted((site / "_images").glob("examples-*.png"))
    assert [f.name for f in figures] == ["examples-0.png", "examples-1.png", "examples-2.png"]
    for fig in figures:
        data = fig.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, fig
        assert f'src="_images/{fig.name}"' in page


def test_settings_table_is_generated(site: Path) -> None:
    from ferro_backend import settings

    page = (site / "guide" / "tuning.html").read_text()
    names = [line.split("`")[1] for line in settings.markdown_table().splitlines()
             if line.startswith("| `")]
    assert names and all(name in page for name in names), names


def test_the_pages_count_and_list_every_distribution() -> None:
    """index.md said "five distributions" over a table of six; install.md's table left out
    ferro-jax. (Read from the Markdown: no build needed.)"""
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    dists = [d.replace("_", "-") for d in DISTRIBUTIONS]
    index = (DOCS / "index.md").read_text()
    rows = [ln.split("|")[1].strip() for ln in index.splitlines() if ln.startswith("| ferro-")]
    assert rows == dists, rows
    assert f"comes as {words[len(dists)]} distributions" in index
    install = (DOCS / "guide" / "install.md").read_text()
    rows = [ln.split("|")[1].strip() for ln in install.splitlines() if ln.startswith("| ferro-")]
    assert rows == dists, rows

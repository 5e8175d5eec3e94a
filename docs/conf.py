"""Sphinx configuration of ferro's documentation (see docs/README.md).

Built by ``./dev docs`` (``nox -s docs``) into docs/_build/html, and by the docs test in
``./dev tests`` (docs/tests/test_docs.py) with warnings as errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sphinx.ext.autodoc.mock import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import ferro_docs  # noqa: E402 - docs/_ext, just put on the path

#: every distribution whose ``__all__`` the API reference documents
DISTRIBUTIONS = {
    "ferro-backend": "ferro_backend",
    "ferro-collective": "ferro_collective",
    "ferro-fsdp": "ferro_fsdp",
    "ferro-checkpoint": "ferro_checkpoint",
    "ferro-torch": "ferro_torch",
    "ferro-jax": "ferro_jax",
}
#: ferro-torch is documented without torch installed (a 200 MB wheel the docs do not need)
autodoc_mock_imports = ["torch"]

with mock(autodoc_mock_imports):
    ferro_docs.write_api_pages(HERE, DISTRIBUTIONS)

project = "ferro"
author = "the ferro developers"
copyright = "the ferro developers"
from importlib.metadata import version as _version  # noqa: E402

release = _version("ferro-backend")
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
    "ferro_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "README.md", "tests", "requirements.txt"]

# the API reference: one page per public name, numpydoc sections
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_default_options = {"show-inheritance": True}
numpydoc_show_class_members = False  # members are listed by the class's autosummary page
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# numpydoc validation, warnings hence errors: every parameter documented (PR01), no unknown
# one (PR02), a Returns section where the call returns something (RT01), for every public
# name of every package
numpydoc_validation_checks = {"PR01", "PR02", "RT01"}
# ProcessGroupFerro's collectives are torch's ProcessGroup interface (torch calls them with its
# own arguments and option structs, documented by torch): their docstrings say what each does
numpydoc_validation_exclude = {r"^ferro_torch\.ProcessGroupFerro\.\w+$"}

# every public name of every package has a docstring (ferro_docs: checked when the build starts
# and on what autodoc skips), else a warning, hence an error
ferro_docs_packages = list(DISTRIBUTIONS.values())
# gaps only reported (info) until they have docstrings: ferro_apicheck.TODO, empty now
# (docs/tests/test_api_docstrings.py reads it too)
ferro_docs_undocumented_todo = sorted(ferro_docs.ferro_apicheck.TODO)

# a reference in a docstring that leads nowhere is a warning, hence an error: except to what
# this offline build cannot link (the standard library, torch: no intersphinx) and to the
# private classes the public ones inherit from (show-inheritance names them)
nitpicky = True
nitpick_ignore_regex = [
    ("py:class", r"(abc|collections\.abc|enum|concurrent\.futures|torch)\..*"),
    ("py:class", r"ferro_\w+\.(_?\w+\.)+_?[A-Za-z]\w*"),
]

# Markdown pages, and the package READMEs included into them
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "pydata_sphinx_theme"
html_title = f"ferro {release}"
html_theme_options = {
    "navigation_depth": 2,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_static_path: list[str] = []
html_show_sourcelink = False

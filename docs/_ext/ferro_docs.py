"""Sphinx extension for ferro's docs: what the site computes at build time.

- ``ferro-settings-table``: the table of every ``FERRO_*`` variable, from
  ``ferro_backend.settings.markdown_table()`` (never pasted, so it cannot go stale);
- ``ferro-run``: runs a command from the repository root (``ferrorun`` from the Python that
  builds the docs) and shows the command and its output; a failing command fails the build;
  ``{tmp}`` in the command is a scratch directory of the page (the runs of one page share it),
  and ``:figure:`` shows a PNG the command wrote there (a plot made by this build);
- ``write_api_pages``: one API page per distribution listing every name of its ``__all__``, for
  autosummary to document (a name added to ``__all__`` is documented without editing the docs);
- the docstring check: every public name of the packages in ``ferro_docs_packages`` (each
  ``__all__``, the public classes' public members; ``ferro_apicheck`` says exactly what counts)
  has a docstring, else a warning, hence an error in the ``-W`` build. Checked when the build
  starts (every build, whatever the environment cached) and again by an ``autodoc-skip-member``
  hook on what autodoc leaves out for want of a docstring (members of a documented class that
  the ``__all__`` walk does not reach). ``ferro_docs_undocumented_todo`` names packages, or
  single definitions (``module.qualname``), whose gaps are only reported (info), not errors: a
  temporary allowance (``ferro_apicheck.TODO`` by default), to be emptied.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ferro_apicheck
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
#: where the figures the examples draw at build time go (gitignored; Sphinx copies them out)
FIGURES = "_figures"
logger = logging.getLogger(__name__)
#: each page's scratch directory for ``{tmp}`` (removed when the build ends)
_SCRATCH: dict[str, Path] = {}


class SettingsTable(SphinxDirective):
    """The generated settings table, parsed as Markdown (the page must be a MyST page)."""

    def run(self) -> list[nodes.Node]:
        from ferro_backend import settings

        table = settings.markdown_table()
        container = nodes.container(classes=["ferro-settings"])
        self.state.nested_parse(StringList(table.splitlines(), "<ferro settings>"),
                                self.content_offset, container)
        return [container]


class RunCommand(SphinxDirective):
    """``ferro-run`` COMMAND: run it at build time (cwd: the repository root) and show
    ``$ COMMAND`` followed by its combined output. ``{tmp}`` in COMMAND is the page's scratch
    directory. Options: ``timeout`` (seconds, default 120); ``figure`` (a PNG the command
    writes, ``{tmp}`` allowed: shown after the output, a missing or empty file fails the build)
    and ``alt`` (its text)."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {"timeout": float, "figure": str, "alt": str}

    def run(self) -> list[nodes.Node]:
        command = self.arguments[0]
        tmp = _SCRATCH.get(self.env.docname)
        if tmp is None:
            tmp = _SCRATCH[self.env.docname] = Path(tempfile.mkdtemp(prefix="ferro-docs-"))
        argv = [arg.replace("{tmp}", str(tmp)) for arg in shlex.split(command)]
        bindir = Path(sys.executable).parent  # ferrorun of the environment building the docs
        env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
        start = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=self.options.get("timeout", 120.0))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise self.error(f"ferro-run: {command!r} did not run: {exc}") from exc
        if done.returncode != 0:
            raise self.error(f"ferro-run: {command!r} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
        logger.info(f"ferro-run: {command} ({time.monotonic() - start:.1f} s)")
        # rank lines arrive in any order: sort them so the page is the same build after build
        # (stable: one rank's lines keep their order); the scratch path reads as {tmp}
        lines = (done.stdout + done.stderr).replace(str(tmp), "{tmp}").splitlines()
        ranked = sorted((ln for ln in lines if ln.startswith("[rank ")), key=lambda ln: ln[:9])
        other = [ln for ln in lines if not ln.startswith("[rank ")]
        text = "\n".join([f"$ {command}", *ranked, *other])
        result: list[nodes.Node] = [nodes.literal_block(text, text, language="text")]
        if "figure" in self.options:
            result.append(self._figure(self.options["figure"].replace("{tmp}", str(tmp)),
                                       command))
        return result

    def _figure(self, made: str, command: str) -> nodes.Node:
        """The PNG the command wrote, copied under the docs' source (Sphinx copies it out)."""
        path = Path(made) if Path(made).is_absolute() else ROOT / made
        if not path.is_file() or path.stat().st_size == 0:
            raise self.error(f"ferro-run: {command!r} wrote no figure at {made}")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.env.docname).strip("-")
        name = f"{slug}-{self.env.new_serialno('ferro-run-figure')}{path.suffix}"
        target = Path(self.env.srcdir) / FIGURES / name
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, target)
        self.env.note_dependency(str(target))
        return nodes.image(uri=f"/{FIGURES}/{name}", alt=self.options.get("alt", command),
                           classes=["ferro-figure"])


def _remove_scratch(app, exception) -> None:
    for path in _SCRATCH.values():
        shutil.rmtree(path, ignore_errors=True)
    _SCRATCH.clear()


def public_names(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def write_api_pages(srcdir: Path, dists: dict[str, str]) -> None:
    """Write ``api/<import name>.rst`` for each distribution: an autosummary of every name in
    its ``__all__`` (modules in ``__all__``, such as ``ferro_fsdp.nn``, get their own table)."""
    outdir = srcdir / "api"
    outdir.mkdir(exist_ok=True)
    pages: set[str] = set()  # the generated pages these tables ask for
    for dist, module in dists.items():
        mod = importlib.import_module(module)
        names = public_names(module)
        submodules = [n for n in names if _is_module(getattr(mod, n))]
        # a name another distribution documents (its __all__ has it): a link, not a 2nd page
        home = {n: _home(getattr(mod, n), n, module, dists) for n in names}
        constants = [n for n in names if home[n] is None and _is_constant(getattr(mod, n))]
        # a second name of a function of the same __all__ (ferro_collective.all_reduce is
        # allreduce): an entry on this page pointing to the function's own, not a 2nd page
        aliases = {n: _alias_of(mod, n, names) for n in names if home[n] is None}
        aliases = {n: target for n, target in aliases.items() if target}
        plain = [n for n in names if n not in submodules and n not in constants
                 and n not in aliases and home[n] is None]
        title = f"``{module}`` ({dist})"
        lines = [title, "=" * len(title), "", f".. automodule:: {module}", "   :no-members:", "",
                 f".. currentmodule:: {module}", "", ".. autosummary::",
                 "   :toctree: generated", "", *[f"   {n}" for n in plain], ""]
        if constants:
            lines += ["Constants", "---------", ""]
            for n in constants:
                lines += [f".. py:data:: {n}", f"   :value: {getattr(mod, n)!r}", ""]
                lines += [f"   {doc}" for doc in _attr_doc(module, n)] + [""]
        if aliases:
            lines += ["Aliases", "-------", ""]
            for n, target in aliases.items():
                lines += [f".. py:function:: {n}{_plain_signature(getattr(mod, n))}", "",
                          f"   The same function as :func:`{target}` (``{module}.{n} is "
                          f"{module}.{target}``): see there.", ""]
        again = [f":py:obj:`{module}.{n} <{home[n]}.{n}>`" for n in names if home[n]]
        if again:
            lines += ["Also importable from here, and documented with their own layer: "
                      + ", ".join(again) + ".", ""]
        for sub in submodules:
            full = f"{module}.{sub}"
            head = f"``{full}``"
            lines += [head, "-" * len(head), "", f".. automodule:: {full}", "   :no-members:",
                      "", f".. currentmodule:: {full}", "", ".. autosummary::",
                      "   :toctree: generated", "",
                      *[f"   {n}" for n in public_names(full)], ""]
        pages.update(f"{module}.{n}" for n in plain)
        pages.update(f"{module}.{sub}.{n}" for sub in submodules
                     for n in public_names(f"{module}.{sub}"))
        text = "\n".join(lines)
        page = outdir / f"{module}.rst"
        if not page.exists() or page.read_text() != text:  # unchanged: no rebuild
            page.write_text(text)
    # a page autosummary generated for a name that left an __all__ (or became an alias) would
    # still be built, and warn: remove it (the directory is generated, gitignored)
    for stale in (outdir / "generated").glob("ferro_*.rst"):
        if stale.stem not in pages:
            stale.unlink()


def _home(obj: object, name: str, module: str, dists: dict[str, str]) -> str | None:
    """The other distribution's package that documents ``obj`` (``name`` in its ``__all__``)."""
    owner = getattr(obj, "__module__", None) or ""
    root = owner.split(".")[0]
    if root == module or root not in dists.values():
        return None
    return root if name in public_names(root) else None


def _alias_of(mod: object, name: str, names: list[str]) -> str | None:
    """The other name of ``names`` under which ``mod`` holds the same function, when ``name``
    is not the function's own (``__name__``)."""
    obj = getattr(mod, name)
    own = getattr(obj, "__name__", name)
    if not callable(obj) or isinstance(obj, type) or own == name or own not in names:
        return None
    return own if getattr(mod, own) is obj else None


def _plain_signature(obj: object) -> str:
    """``obj``'s signature without annotations, enum defaults written ``Enum.MEMBER``."""
    import enum

    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        default = p.default
        if isinstance(default, enum.Enum):
            default = _Raw(f"{type(default).__name__}.{default.name}")
        params.append(p.replace(annotation=p.empty, default=default))
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


class _Raw(str):
    def __repr__(self) -> str:
        return str(self)


def _is_constant(obj: object) -> bool:
    return isinstance(obj, (int, float, str, bytes, tuple, frozenset)) and not callable(obj)


def _attr_doc(module: str, name: str) -> list[str]:
    """The ``#:`` comment (or docstring after it) of the assignment of ``name`` in one of the
    package's modules, empty when there is none."""
    from sphinx.pycode import ModuleAnalyzer, PycodeError

    for modname in sorted(m for m in list(sys.modules) if m == module
                          or m.startswith(module + ".")):
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        if ("", name) in docs:
            return [line for line in docs[("", name)] if line.strip()]
    return []


def _is_module(obj: object) -> bool:
    return type(obj).__name__ == "module"


#: ``module.qualname`` of every undocumented definition reported in this build (reported once)
_REPORTED: set[str] = set()


def _report(app, defined: str, what: str) -> None:
    todo = {defined.split(".")[0], defined} & set(app.config.ferro_docs_undocumented_todo)
    log = logger.info if todo else logger.warning
    prefix = "TODO (ferro_docs_undocumented_todo) " if todo else ""
    log(f"{prefix}undocumented public {what}: add a docstring (numpydoc)",
        type="ferro", subtype="undocumented")


def check_docstrings(app) -> None:
    """``builder-inited``: a warning for every public name of ``ferro_docs_packages`` that has
    no docstring (see ``ferro_apicheck``)."""
    for package in app.config.ferro_docs_packages:
        for gap in ferro_apicheck.undocumented(package):
            if gap.defined not in _REPORTED:
                _REPORTED.add(gap.defined)
                _report(app, gap.defined, str(gap))


def _skip_member(app, what, name, obj, skip, options):
    """``autodoc-skip-member``: autodoc leaves out a public member without a docstring (no
    ``:undoc-members:``); when that member is ferro's own, report it. Never changes what is
    skipped (returns None)."""
    if not skip or what != "class" or name.startswith("_"):
        return None
    func = ferro_apicheck._function(obj)
    if func is None or not ferro_apicheck._is_ferro(func):
        return None
    if ferro_apicheck._has_doc(func) or inspect.getdoc(func):
        return None  # skipped for another reason (an excluded base's member)
    defined = f"{func.__module__}.{getattr(func, '__qualname__', name)}"
    if defined not in _REPORTED:
        _REPORTED.add(defined)
        file, line = ferro_apicheck._where(func)
        _report(app, defined, f"{defined} ({file}:{line})")
    return None


def setup(app):
    app.add_directive("ferro-settings-table", SettingsTable)
    app.add_directive("ferro-run", RunCommand)
    app.connect("build-finished", _remove_scratch)
    app.add_config_value("ferro_docs_packages", [], "env")
    app.add_config_value("ferro_docs_undocumented_todo", sorted(ferro_apicheck.TODO), "env")
    app.connect("builder-inited", check_docstrings)
    app.connect("autodoc-skip-member", _skip_member)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

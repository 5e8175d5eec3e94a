"""The compiled backend (C++, built against the installed torch at first use) and the choice
between it and the Python backend: used wherever it builds (no silent fallback), one warning
line naming why where it cannot, FERRO_TORCH_BACKEND forcing either."""

import os
import shutil
import stat

import pytest
from _launch import env_vars, processes
from ferro_torch import _compiled
from torch.utils import cpp_extension

from ferro_backend.testing import free_port

TOOLCHAIN = (shutil.which(os.environ.get("CXX", "c++")) is not None
             and cpp_extension.is_ninja_available())


def _kind_run(extra: dict, n: int = 2) -> dict[int, dict]:
    port = free_port()
    run = processes("kind", n, lambda r: env_vars(r, n, port, FERRO_TOKEN="k1nd", **extra),
                    timeout=90)
    assert run.returncodes == [0] * n, run.output[-4000:]
    return run.by_rank()


@pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler or ninja here: nothing can build")
def test_the_compiled_backend_is_in_use_where_it_builds(compiled_backend):
    # the test session built it (conftest), and a job on one host runs on it: no fallback
    assert compiled_backend is not None, _compiled._failure
    assert _compiled.extension_name() in compiled_backend.__name__
    for r in _kind_run({}).values():
        assert (r["kind"], r["sub_kind"], r["warnings"]) == ("compiled", "compiled", []), r
        assert r["value"] == [6.0] * 3


@pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler or ninja here: nothing can build")
def test_asynchronous_calls_on_the_worker_thread_keep_the_issue_order(compiled_backend):
    port = free_port()
    run = processes("background", 2, lambda r: env_vars(r, 2, port, FERRO_TOKEN="bg",
                                                         FERRO_BACKGROUND="on",
                                                         FERRO_SHM_REPROBE="0.2"), timeout=90)
    assert run.returncodes == [0, 0], run.output[-4000:]
    for r in run.results:
        assert (r["kind"], r["inline_async"]) == ("compiled", False), r
    # the engine probed the link again, every rank alike, between the compiled backend's calls
    (first, last), (first1, last1) = (r["probes"] for r in run.results)
    assert (first, last) == (first1, last1) and last >= first + 3, run.results


def test_python_is_forced_by_the_setting_without_a_build_or_a_word():
    for r in _kind_run({_compiled.BACKEND.name: "python", "CXX": "/nonexistent/c++"}).values():
        assert (r["kind"], r["sub_kind"], r["warnings"]) == ("python", "python", []), r
        assert r["value"] == [6.0] * 3


def test_without_a_compiler_the_python_backend_runs_with_one_warning_line():
    for r in _kind_run({"CXX": "/nonexistent/c++"}).values():
        assert (r["kind"], r["sub_kind"]) == ("python", "python"), r
        assert r["value"] == [6.0] * 3
        (line,) = r["warnings"]  # one, for the world and its subgroup together
        assert "\n" not in line and line.startswith("ferro-torch: using the Python backend: "), line
        assert "no C++ compiler ('/nonexistent/c++'" in line, line


def test_a_failing_build_falls_back_with_the_compilers_error(tmp_path):
    cxx = tmp_path / "broken-c++"
    real = shutil.which("c++") or "c++"  # (torch asks the compiler its version first)
    cxx.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exec {real} \"$@\"\n"
                   "echo 'broken-c++: error: this compiler is out of order' >&2\nexit 1\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    extra = {"CXX": str(cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    for r in _kind_run(extra).values():
        assert r["kind"] == "python", r
        (line,) = r["warnings"]
        assert "\n" not in line and "failed" in line and "out of order" in line, line
    (record,) = (tmp_path / "cache").glob("*.failed")
    # the next job does not build again: the compiler is not asked (it would say so)
    cxx.write_text("#!/bin/sh\necho asked >> " + str(tmp_path / "asked") + "\nexit 1\n")
    for r in _kind_run(extra).values():
        (line,) = r["warnings"]
        assert "out of order" in line and "an earlier build; delete" in line, line
    assert not (tmp_path / "asked").exists()
    # FERRO_TORCH_BACKEND=compiled builds again (and says what the compiler said now)
    for r in _kind_run({**extra, _compiled.BACKEND.name: "compiled"}).values():
        assert "FERRO_TORCH_BACKEND=compiled" in r["error"] and "earlier" not in r["error"], r
    assert (tmp_path / "asked").exists() and record.exists()


def test_compiled_is_forced_by_the_setting_and_raises_where_it_cannot_build():
    extra = {_compiled.BACKEND.name: "compiled", "CXX": "/nonexistent/c++"}
    for r in _kind_run(extra).values():
        assert "FERRO_TORCH_BACKEND=compiled" in r["error"], r
        assert "no C++ compiler" in r["error"], r


def test_a_bad_setting_names_the_variable():
    from ferro_backend import SettingError

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_compiled.BACKEND.name, "fast")
        with pytest.raises(SettingError, match="FERRO_TORCH_BACKEND 'fast' is invalid"):
            _compiled.choice()


def test_the_cache_name_changes_with_the_sources(monkeypatch, tmp_path):
    name = _compiled.extension_name()
    assert name.startswith("ferro_torch_c10d_t") and "_door1_" in name
    src = tmp_path / "csrc"
    shutil.copytree(_compiled.CSRC, src)
    monkeypatch.setattr(_compiled, "CSRC", src)
    assert _compiled.extension_name() == name
    (src / "work.cpp").write_text((src / "work.cpp").read_text() + "\n// changed\n")
    assert _compiled.extension_name() != name  # a stale cache is never loaded


@pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler or ninja here: nothing can build")
def test_ranks_on_different_backends_are_an_error_naming_them(compiled_backend):
    # the two kinds carry messages on different rings: a job that mixes them must not start
    port = free_port()
    run = processes("kind", 2, lambda r: env_vars(
        r, 2, port, FERRO_TOKEN="m1x", **({_compiled.BACKEND.name: "python"} if r == 0 else {})),
        timeout=90)
    assert run.returncodes == [0, 0], run.output[-4000:]
    for r in run.by_rank().values():
        assert "the ranks of a group run different backends" in r["error"], r
        assert "compiled: ranks [1]; python: ranks [0]" in r["error"], r


def test_a_torch_older_than_the_oldest_supported_is_not_built_against(monkeypatch):
    # torch 2.8's c10d Backend lacks getBackendOptions/setTimeout (2.7 the options' asyncOp):
    # the build is not attempted, and the reason names both versions
    monkeypatch.setattr(_compiled.torch, "__version__", "2.8.0+cpu")
    with pytest.raises(_compiled.BuildError, match=r"torch 2\.8\.0\+cpu is older than 2\.9"):
        _compiled._preflight()


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(
        tmp_path, monkeypatch):
    """torch's build lock is a file; a build killed while holding it left it for ever (every
    later process waited in torch's loop until its test or job timed out)."""
    import os
    import threading
    import time

    from ferro_torch import _compiled

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _compiled._build_dir("x") / "lock"
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - _compiled.STALE_LOCK_S - 5,) * 2)
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        _compiled._wait_for_build_lock("x")
    assert not lock.exists()
    lock.write_bytes(b"")  # a build going on: waited for until it ends
    threading.Timer(0.5, lock.unlink).start()
    t0 = time.monotonic()
    _compiled._wait_for_build_lock("x")
    assert 0.4 < time.monotonic() - t0 < 5


def test_installs_in_other_places_build_apart(monkeypatch, tmp_path):
    """The build's commands name the headers' directory, so two installs sharing one cache
    entry rebuilt it for each other: the name now tells them apart."""
    import shutil

    from ferro_torch import _compiled

    import ferro_backend

    here = _compiled.extension_name()
    copy = tmp_path / "include"
    shutil.copytree(ferro_backend.get_include(), copy)
    monkeypatch.setattr(ferro_backend, "get_include", lambda: str(copy))
    assert _compiled.extension_name() != here


def test_the_translation_unit_includes_every_part_once_in_order():
    """The build compiles ferro_c10d.cpp alone: a part it left out would be missing from the
    module (its symbols unresolved at load), one included twice would not compile."""
    import re

    unit = (_compiled.CSRC / _compiled.UNIT).read_text()
    assert tuple(re.findall(r'^#include "(\w+\.cpp)"$', unit, re.M)) == _compiled.SOURCES
    assert sorted(p.name for p in _compiled.CSRC.glob("*.cpp")) == sorted(
        (*_compiled.SOURCES, _compiled.UNIT))

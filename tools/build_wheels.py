"""Build several distributions' wheels at once: one ``pip wheel`` process per distribution.

A build spends much of its time in one compiler or one Cython process at a time, so the four
compiled distributions built side by side take about half as long as one after the other on a
2-core machine. Used by ``noxfile._wheel``; prints a failed build's whole output and exits 1.

``--jobs N`` builds at most N at once, in the order given (the first ones are ready first);
``--ready-dir DIR`` writes ``DIR/<project directory name>`` (``ok`` or ``failed``) as each
build ends, so whoever needs only some wheels (a test session under ``./dev tests``) starts as
soon as those are built.

    python tools/build_wheels.py [--jobs N] [--ready-dir DIR] OUTDIR PROJECT_DIR [...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def mark(ready: Path | None, project: Path, verdict: str) -> None:
    """Write ``ready/<project name>`` whole (a reader never sees an empty marker)."""
    if ready is None:
        return
    partial = ready / f".{project.name}.partial"
    partial.write_text(verdict)
    partial.replace(ready / project.name)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=0, help="builds at once (0: all)")
    ap.add_argument("--ready-dir", type=Path, default=None)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("projects", type=Path, nargs="+")
    args = ap.parse_args(argv)
    out, todo = args.outdir, list(args.projects)
    out.mkdir(parents=True, exist_ok=True)
    if args.ready_dir is not None:
        args.ready_dir.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs if args.jobs > 0 else len(todo)
    start = time.monotonic()
    running: list = []
    failed = 0
    while todo or running:
        while todo and len(running) < jobs:
            project = todo.pop(0)
            log = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps",
                                     "--no-build-isolation", "--quiet", "-w", str(out),
                                     str(project)], stdout=log, stderr=subprocess.STDOUT)
            running.append((project, proc, log))
        time.sleep(0.2)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            project, proc, log = item
            log.seek(0)
            if proc.returncode != 0:
                failed += 1
                print(f"build_wheels: {project.name} failed (exit {proc.returncode}):\n"
                      f"{log.read()}", file=sys.stderr)
            log.close()
            mark(args.ready_dir, project, "ok" if proc.returncode == 0 else "failed")
            print(f"build_wheels: {project.name} {'built' if proc.returncode == 0 else 'FAILED'}"
                  f" at {time.monotonic() - start:.0f} s", flush=True)
    total = len(args.projects)
    print(f"build_wheels: {total - failed} of {total} wheels in "
          f"{time.monotonic() - start:.0f} s into {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

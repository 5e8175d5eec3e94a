"""Build several distributions' wheels at once: one ``pip wheel`` process per distribution.

A build spends much of its time in one compiler or one Cython process at a time, so the four
compiled distributions built side by side take about half as long as one after the other on a
2-core machine. Used by ``noxfile._wheel``; prints a failed build's whole output and exits 1.

    python tools/build_wheels.py OUTDIR PROJECT_DIR [PROJECT_DIR ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, projects = Path(argv[0]), [Path(p) for p in argv[1:]]
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    running = []
    for project in projects:
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps",
                                 "--no-build-isolation", "--quiet", "-w", str(out),
                                 str(project)], stdout=log, stderr=subprocess.STDOUT)
        running.append((project, proc, log))
    failed = 0
    for project, proc, log in running:
        rc = proc.wait()
        log.seek(0)
        if rc != 0:
            failed += 1
            print(f"build_wheels: {project.name} failed (exit {rc}):\n{log.read()}",
                  file=sys.stderr)
        log.close()
    print(f"build_wheels: {len(projects) - failed} of {len(projects)} wheels in "
          f"{time.monotonic() - start:.0f} s into {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

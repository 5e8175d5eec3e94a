"""Run a script (argv[1], its arguments after it) with ``compressed.MAX_PIECES`` from MAXP
(default 4) and ``compressed.PIECE_BYTES`` from PIECEB (default 1 MiB)."""

import os
import runpy
import sys

import ferro_collective.compressed as c

c.MAX_PIECES = int(os.environ.get("MAXP", "4"))
c.PIECE_BYTES = int(os.environ.get("PIECEB", str(1 << 20)))
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")

"""`python run.py KIND MODE ITERS SIZES`: `calls.bench` on 2 processes over TCP (127.0.0.1),
printed as one JSON line, each cell the slower rank's. KIND: symmetric, metadata, rooted,
broadcast; MODE: pair, off or big; SIZES: bytes, comma-separated."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import calls

from ferro_backend.testing import run_processes

if __name__ == "__main__":
    kind, mode, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sizes = [int(x) for x in sys.argv[4].split(",")]
    res = run_processes(calls.bench, 2, kind, mode, iters, sizes, timeout=1800)
    print(json.dumps({"kind": kind, "mode": mode,
                      **{k: max(r[k] for r in res) for k in res[0]}}), flush=True)

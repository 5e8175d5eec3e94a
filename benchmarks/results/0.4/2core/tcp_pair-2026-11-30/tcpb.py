import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tcpfns

from ferro_backend.testing import run_processes

if __name__ == "__main__":
    sizes = [int(x) for x in sys.argv[3].split(",")]
    res = run_processes(tcpfns.bench, 2, sizes, int(sys.argv[2]), sys.argv[1], timeout=900)
    worst = {k: max(r[k] for r in res) for k in res[0]}
    print(json.dumps({"tag": sys.argv[1], **worst}), flush=True)

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bcfns

from ferro_backend.testing import run_processes

if __name__ == "__main__":
    res = run_processes(bcfns.bench, 2, int(sys.argv[2]), sys.argv[1], timeout=900)
    print(json.dumps({"tag": sys.argv[1], **{k: max(r[k] for r in res) for k in res[0]}}), flush=True)

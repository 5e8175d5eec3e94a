"""`python proto_gathered.py`: a prototype, outside the package, of a small allreduce of 4 ranks
gathered in the header exchange's rounds (each rank's data with its header, Bruck's rounds over
`send`/`irecv`, folded in rank order; no disagreement handling), against today's allreduce on
the same TCP job (its header exchange, then recursive doubling). us a call, the slower rank's."""

import json
import time

import numpy as np

from ferro_backend.testing import run_processes


def fn(b, nbytes, iters):
    import ferro_collective as fc
    from ferro_collective.header import HEADER_SIZE, encode
    from ferro_collective.ops import ReduceOp, fold

    n, me = b.world_size, b.rank
    x = np.ones(nbytes // 4, np.float32)
    header = encode("allreduce", x.dtype, x.shape, ReduceOp.SUM, seq=0)
    unit = nbytes + HEADER_SIZE
    known = np.empty(n * unit, np.uint8)
    incoming = np.empty(n * unit, np.uint8)
    tags = [1 << 20]

    def proto():
        tag = tags[0]
        tags[0] += 1
        known[:nbytes] = x.view(np.uint8)
        known[nbytes:unit] = np.frombuffer(header, np.uint8)
        count, d = 1, 1
        while count < n:
            take = min(d, n - count)
            req = b.irecv(incoming[:take * unit], (me + d) % n, tag=tag)
            b.send(known[:take * unit], (me - d) % n, tag=tag)
            req.wait(10)
            known[count * unit:(count + take) * unit] = incoming[:take * unit]
            count += take
            d *= 2
        rows = [((r - me) % n) * unit for r in range(n)]
        out = np.empty_like(x)
        fold(out, [known[i:i + nbytes].view(np.float32) for i in rows], ReduceOp.SUM)
        return out

    res = {}
    for name, f in (("current", lambda: fc.allreduce(x, b)), ("gathered", proto)):
        for _ in range(50):
            f()
        ts = []
        for _ in range(5):
            fc.barrier(b)
            t = time.perf_counter()
            for _ in range(iters):
                f()
            ts.append((time.perf_counter() - t) / iters * 1e6)
        res[name] = round(sorted(ts)[2], 1)
    assert float(proto()[0]) == n
    return res


if __name__ == "__main__":
    for nb in (4096, 65536):
        r = run_processes(fn, 4, nb, 200, timeout=600)
        print(nb, json.dumps({k: max(x[k] for x in r) for k in r[0]}), flush=True)

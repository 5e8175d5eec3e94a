import time

import numpy as np

import ferro_collective as fc


def bench(backend, iters, mode):
    if mode == "off":
        from ferro_collective import metadata_step as ms
        from ferro_collective.p2p import bruck_all_gather, header_exchange
        def _two(self, ctx):
            header_exchange(ctx, self.encoded())
            return bruck_all_gather(ctx, self._block(), ctx.next_tag(), "meta")
        ms.MetaPlan._two = _two
    out = {}
    for name in ("all_to_all_single", "all_gather_v", "all_gather_object"):
        for nb in (4096, 65536):
            x = np.ones(nb // 4, np.float32)
            f = {"all_to_all_single": lambda x=x: fc.all_to_all_single(x, backend),
                 "all_gather_v": lambda x=x: fc.all_gather_v(x, backend),
                 "all_gather_object": lambda nb=nb: fc.all_gather_object({"a": nb}, backend)}[name]
            for _ in range(50):
                f()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(iters):
                    f()
                ts.append((time.perf_counter() - t) / iters * 1e6)
            out[f"{name} {nb}"] = round(sorted(ts)[2], 1)
    return out

"""`python pool_micro.py`: two arrays of each size taken, every page touched, given back:
fresh from numpy against through a scratch pool that keeps every size (us a pair)."""
import timeit

import numpy as np

from ferro_collective.scratch import ScratchPool

pool = ScratchPool(1 << 30, smallest=0)
for nb in (4096, 16384, 65536, 131072, 262144, 1 << 20):
    N = 20000 if nb <= 262144 else 2000

    def fresh(nb=nb):
        a = np.empty(nb, np.uint8)
        a[::4096] = 1
        b = np.empty(nb, np.uint8)
        b[::4096] = 1

    def pooled(nb=nb):
        a = pool.take(nb, np.uint8)
        a[::4096] = 1
        b = pool.take(nb, np.uint8)
        b[::4096] = 1
        pool.give(a, b)

    print(nb, "fresh %.2f us" % (timeit.timeit(fresh, number=N) / N * 1e6),
          "pooled %.2f us" % (timeit.timeit(pooled, number=N) / N * 1e6), flush=True)

"""On PYTHONPATH (as sitecustomize.py) with POOL_ALL=1: the scratch pool keeps every size."""
import os

if os.environ.get("POOL_ALL"):
    import ferro_collective.scratch as _s
    _s.POOL._smallest = 0

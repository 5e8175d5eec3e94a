import os

if os.environ.get("PAIR_OFF"):
    import ferro_collective.pair as _p
    _p.FUSE_MAX = _p.BROADCAST_FUSE_MAX = -1

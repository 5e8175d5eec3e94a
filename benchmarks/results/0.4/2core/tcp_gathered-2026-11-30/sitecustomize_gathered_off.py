"""On PYTHONPATH (copied as sitecustomize.py) with GATHERED_OFF=1: calls of three ranks or more
exchange their header first (the code before :mod:`ferro_collective.gathered` carried small
calls' data and the metadata rounds)."""
import os

if os.environ.get("GATHERED_OFF"):
    import numpy as _np

    import ferro_collective.gathered as _g
    import ferro_collective.metadata_step as _m
    from ferro_collective.p2p import bruck_all_gather as _bruck
    from ferro_collective.p2p import header_exchange as _hx

    _g.GATHER_MAX = 0

    class _HeaderFirst:
        """The metadata round as before: the header exchange, then Bruck's all-gather."""

        @staticmethod
        def exchange(ctx, header, block):
            _hx(ctx, header)
            blocks = _bruck(ctx, block.tobytes(), ctx.next_tag(), "the collective's metadata")
            return None, [_np.frombuffer(b, _np.uint8) for b in blocks]

    _m.gathered = _HeaderFirst

"""On PYTHONPATH with GATHERED_OFF=1: calls of three ranks or more exchange their header first
(the code before :mod:`ferro_collective.gathered` carried small calls' data)."""
import os

if os.environ.get("GATHERED_OFF"):
    import ferro_collective.gathered as _g
    _g.GATHER_MAX = 0

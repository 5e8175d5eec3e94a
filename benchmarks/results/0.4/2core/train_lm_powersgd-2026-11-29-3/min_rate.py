"""Run a script (argv[1], its arguments after it) with PowerSGDState's min_compression_rate
from MINRATE (torch's default 2 when unset)."""

import os
import runpy
import sys

from ferro_fsdp import comm_hooks

Base = comm_hooks.PowerSGDState


class MinRate(Base):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("min_compression_rate", float(os.environ.get("MINRATE", "2")))
        super().__init__(*args, **kwargs)


comm_hooks.PowerSGDState = MinRate
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")

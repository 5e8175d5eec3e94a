"""FSDP on the timeline: while a rank traces (ferro_backend.trace), each unit's gather and
reduce-scatter is a span named after the unit, above the collectives it waits for."""

import json

import numpy as np
import pytest
from _helpers import make_data, make_mlp, make_opt, run, train_steps

from ferro_backend import trace
from ferro_fsdp import FSDP, nn

pytestmark = pytest.mark.timeout(120)


def test_fsdp_units_gathers_and_reductions_are_spans(tmp_path):
    path = tmp_path / "t.json"
    x, y = make_data()

    def body(b):
        f = FSDP(make_mlp(), b, wrap=nn.Linear)
        opt = make_opt("sgd", f.parameters())
        if b.rank == 0:
            with trace(path, backend=b):
                train_steps(f, opt, nn.CrossEntropyLoss(), x, y, 2)
        else:
            train_steps(f, opt, nn.CrossEntropyLoss(), x, y, 2)
        return list(f.units)

    units = run(body, 2)[0]
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    gathers = [e for e in events if e["name"] == "fsdp.gather"]
    reductions = [e for e in events if e["name"] == "fsdp.reduce_scatter"]
    named = {u or "<root>" for u in units}
    assert gathers and {e["args"]["unit"] for e in gathers} <= named
    assert reductions and {e["args"]["unit"] for e in reductions} <= named
    assert all(e["cat"] == "fsdp" and e["args"]["numel"] > 0 for e in gathers + reductions)
    assert any(e["name"] == "all_gather" and e["cat"] == "collective.async" for e in events)
    assert np.isfinite([e["dur"] for e in events]).all()

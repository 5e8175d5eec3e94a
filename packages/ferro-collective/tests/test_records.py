"""The collectives' records (:mod:`ferro_collective.records`): one per collective, each declared
in its own module, read by the dispatcher; every public call goes through its record."""

import inspect

import numpy as np
import pytest

import ferro_collective as fc
from ferro_collective import _onecall, executors, header, records
from ferro_collective.plan import Collective


def test_every_record_is_declared_once_in_its_own_module():
    names = [c.name for c in records.ALL]
    assert len(set(names)) == len(names)
    for c in records.ALL:
        assert isinstance(c, Collective)
        module = inspect.getmodule(c.prepare)
        assert getattr(module, c.name.upper()) is c, c.name  # beside its prepare
        assert records.BY_NAME[c.name] is c
        assert getattr(fc, c.name), c.name  # its public call


def test_header_codes_are_distinct_and_stable():
    codes = [header.collective_code(c.name) for c in records.ALL]
    assert len(set(codes)) == len(codes)
    assert codes == list(range(1, len(codes) + 1))  # the engine's door knows the first seven
    assert 128 <= header.collective_code("a collective added later") < 256


def test_algorithms_and_one_call_paths():
    assert records.ALL_ALGORITHMS == {c.name: c.algorithms for c in records.ALL if c.algorithms}
    for c in records.ALL:
        assert not c.algorithms or c.algorithms[0] == "auto"
    one_call = {c.name: c.kind for c in records.ALL if c.kind is not None}
    assert one_call == {"allreduce": _onecall.ALLREDUCE, "broadcast": _onecall.BROADCAST,
                        "all_gather": _onecall.ALL_GATHER, "barrier": _onecall.BARRIER,
                        "reduce_scatter": _onecall.REDUCE_SCATTER, "gather": _onecall.GATHER,
                        "scatter": _onecall.SCATTER,
                        "all_to_all_single": _onecall.ALL_TO_ALL_SINGLE,
                        "all_to_all": _onecall.ALL_TO_ALL,
                        "all_gather_v": _onecall.ALL_GATHER_V,
                        "broadcast_object": _onecall.BROADCAST_OBJECT,
                        "all_gather_object": _onecall.ALL_GATHER_OBJECT}


@pytest.mark.parametrize("name", ["reduce_scatter", "allreduce"])
def test_stages_find_other_collectives_by_record(name):
    """A hierarchical stage names another collective (allreduce's node stage is a
    reduce_scatter) and the dispatcher prepares it from that collective's record."""
    assert executors.execute.prepare(name, np.ones(4), fc_group_of_one(), fc.ReduceOp.SUM,
                                    5.0, None, None).name == name


def fc_group_of_one():
    from ferro_backend import SimulatedBackend

    return SimulatedBackend.create_group(1)[0]

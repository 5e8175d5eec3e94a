"""The compiled one-call path of scatter, all_to_all_single, all_to_all, all_gather_v and the
object collectives (``_metacall.Twin``, ``_exchange_twin``, ``_objects_twin``): the general
path's protocol in C, so that each rank may take either path and the ranks still meet."""

import os
from unittest import mock

import pytest
import twin_fns

from ferro_backend.testing import run_processes


def test_the_twin_is_an_extension_module_the_one_call_paths_use():
    from ferro_collective import _exchange_twin, _metacall, _objects_twin, _onecall
    from ferro_collective.api import SCATTER
    from ferro_collective.api_uneven import (
        ALL_GATHER_OBJECT,
        ALL_GATHER_V,
        ALL_TO_ALL,
        ALL_TO_ALL_SINGLE,
        BROADCAST_OBJECT,
    )

    for module in (_metacall, _exchange_twin, _objects_twin):
        assert module.__file__.endswith((".so", ".pyd")), module.__file__
    assert (SCATTER.kind, ALL_TO_ALL_SINGLE.kind, ALL_TO_ALL.kind, ALL_GATHER_V.kind,
            BROADCAST_OBJECT.kind, ALL_GATHER_OBJECT.kind) == (
        _onecall.SCATTER, _onecall.ALL_TO_ALL_SINGLE, _onecall.ALL_TO_ALL, _onecall.ALL_GATHER_V,
        _onecall.BROADCAST_OBJECT, _onecall.ALL_GATHER_OBJECT)


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 2)])
def test_every_mix_of_twin_and_general_path_gives_numpys_bits(world, seed):
    res = run_processes(twin_fns.twin_meets_general, world, seed, 8, transport="shm",
                        timeout=240)
    assert res == [[]] * world


def test_the_twin_in_small_slots_reads_what_does_not_fit_from_the_peers():
    with mock.patch.dict(os.environ, {"FERRO_SHM_SLOT_BYTES": "4096"}):
        res = run_processes(twin_fns.twin_meets_general, 3, 3, 4, transport="shm",
                            timeout=240)
    assert res == [[]] * 3


def test_wrong_calls_raise_the_general_paths_errors_whichever_ranks_take_the_twin():
    want = run_processes(twin_fns.twin_errors, 3, [], transport="shm", timeout=120)
    for r, errors in enumerate(want):  # what the general path says
        assert len(errors) == 10 and all("not usable" not in e for e in errors), errors
        assert "SizeMismatchError: scatter: dim 0 of root 0's shape (7,)" in errors[0]
        assert "0-d" in errors[1]
        assert ("ValueError: scatter: the root (rank 2) must pass an array" if r == 2 else
                "CollectiveMismatchError: scatter (seq") in errors[2]
        assert ("out is int64[3]" if r == 1 else "no error") in errors[3]
        assert "rank 0 sends 2 rows to rank 1, whose recv_splits[0] is 1" in errors[4]
        assert "passed recv_splits=None (equal splits)" in errors[5]
        assert ("add up to 9" if r == 1 else "rank 1 refused the call") in errors[6]
        assert ("out is float64[5]" if r == 0 else "no error") in errors[7]
        for at, bad, why in ((8, 1, "got 2 tensors, expected world_size 3"),
                             (9, 2, "tensors[1] is float32[2]")):
            assert why in errors[at] and (r == bad or f"rank {bad} refused the call" in errors[at]
                                          or f"ranks [{bad}] passed invalid" in errors[at]), errors[at]
    for twin_ranks in ([0], [1, 2], [0, 1, 2]):
        got = run_processes(twin_fns.twin_errors, 3, twin_ranks, transport="shm", timeout=120)
        assert got == want, twin_ranks


@pytest.mark.parametrize("world,slot,cma", [(2, None, "auto"), (3, "4096", "auto"),
                                            (2, "4096", "never")])
def test_objects_meet_whichever_path_each_rank_takes(world, slot, cma):
    """With cross-memory reads off, the twin takes no call and pickles beyond the slot go over
    messages after the metadata step."""
    env = {"FERRO_SHM_SLOT_BYTES": slot} if slot else {}
    with mock.patch.dict(os.environ, {**env, "FERRO_SHM_CMA": cma}):
        res = run_processes(twin_fns.twin_objects, world, cma != "never", transport="shm",
                            timeout=240)
    assert res == [[]] * world


def test_unpicklable_objects_raise_the_general_paths_errors_whichever_ranks_take_the_twin():
    want = run_processes(twin_fns.twin_object_errors, 3, [], transport="shm", timeout=120)
    for r, errors in enumerate(want):  # what the general path says
        assert len(errors) == 4 and all("not usable" not in e for e in errors), errors
        assert errors[0].startswith("broadcast_object: the root's object cannot be pickled: "
                                    "TypeError: broadcast_object: ")
        assert ("root 2 cannot pickle Unpicklable" if r != 2 else
                "cannot pickle Unpicklable object: RuntimeError: no pickling here") in errors[0]
        assert errors[1].endswith("returned 5")
        assert ("ranks [1] cannot pickle their objects: rank 1 cannot pickle Unpicklable"
                if r != 1 else "all_gather_object: cannot pickle Unpicklable") in errors[2]
        assert ("ranks [0, 2] cannot pickle" if r == 1 else "all_gather_object: cannot pickle "
                "Unpicklable object") in errors[3]
    for twin_ranks in ([0], [1, 2], [0, 1, 2]):
        got = run_processes(twin_fns.twin_object_errors, 3, twin_ranks, transport="shm",
                            timeout=120)
        assert got == want, twin_ranks

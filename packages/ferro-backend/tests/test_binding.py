"""FERRO_SHM_BIND: a same-host engine's ranks on cores of their own (engine/binding.py), chosen
per mode, given back when the backend closes."""

import os
from unittest import mock

import pytest

from ferro_backend import settings
from ferro_backend.engine import AVAILABLE as SAME_HOST_ENGINE
from ferro_backend.engine import binding
from ferro_backend.testing import run_processes

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not SAME_HOST_ENGINE, reason="the engine needs Linux")]
CORES = binding.usable_cores()


def test_the_modes_decide_from_the_usable_cores():
    n = len(CORES)
    if n == 0:
        pytest.skip("this platform does not tell the usable cores")
    before = frozenset(os.sched_getaffinity(0))
    try:
        with settings.override(SHM_BIND="off"):
            assert binding.bind(0, 1) is None
        with settings.override(SHM_BIND="auto"):
            if n > 1:
                assert binding.bind(0, n + 1) is None  # more ranks, not a multiple of the cores
                assert binding.bind(0, n - 1) is None  # a core to spare: auto leaves it
            for rank in (2 * n - 1, n, 1):  # a whole multiple: k ranks to each core, in turn
                assert binding.bind(rank, 2 * n) == before
                assert os.sched_getaffinity(0) == {CORES[rank % n]}
                binding.unbind(before)
        with settings.override(SHM_BIND="cores"):
            assert binding.bind(n, n) is None  # no such rank
            assert binding.bind(0, 1) == before
            assert os.sched_getaffinity(0) == {CORES[0]}
    finally:
        binding.unbind(before)
    assert frozenset(os.sched_getaffinity(0)) == before


def test_ranks_of_other_nodes_on_this_host_stop_every_binding_and_make_waits_yield():
    # emulated nodes (FERRO_HOST_RANKS, which ferrorun --emulate-nodes sets) share this host's
    # cores: each node's engine would bind its ranks to the same cores, and spin on cores the
    # other nodes' ranks need
    from ferro_backend.engine.segment import oversubscribed

    n = max(1, len(CORES))
    many = max(4 * n, (os.cpu_count() or 1) + 1)  # more ranks than this host has cores
    before = frozenset(os.sched_getaffinity(0))
    assert binding.host_ranks(n) == n and not oversubscribed(n)
    with settings.override(HOST_RANKS=many):
        assert binding.host_ranks(n) == many and binding.host_ranks(2 * many) == 2 * many
        assert oversubscribed(n) and oversubscribed(1)
        for mode in ("auto", "cores"):
            with settings.override(SHM_BIND=mode):
                assert binding.bind(0, n) is None
    with settings.override(HOST_RANKS=n, SHM_BIND="cores"):  # this node's ranks alone
        try:
            assert binding.bind(0, n) in (None, before)  # bound where the platform lets it
        finally:
            binding.unbind(before)
    assert frozenset(os.sched_getaffinity(0)) == before
    with mock.patch.dict(os.environ, {"FERRO_HOST_RANKS": "0"}), \
            pytest.raises(Exception, match="FERRO_HOST_RANKS"):
        settings.HOST_RANKS.get()


def test_a_bad_mode_names_the_variable():
    with mock.patch.dict(os.environ, {"FERRO_SHM_BIND": "sometimes"}), \
            pytest.raises(Exception, match="FERRO_SHM_BIND"):
        settings.SHM_BIND.get()


def _cores_while_open(backend) -> list:
    """This rank's cores with its engine open (main thread), and after it closed."""
    import numpy as np

    from ferro_backend.engine import binding as b

    backend.barrier(timeout=30)
    inside = sorted(os.sched_getaffinity(0))
    told = backend.engine.bound_cores()  # what a client giving its own threads the cores reads
    assert told is None if os.environ["FERRO_SHM_BIND"] == "off" else sorted(told) == inside
    import threading
    elsewhere = []
    t = threading.Thread(target=lambda: elsewhere.append(backend.engine.bound_cores()))
    t.start()
    t.join(30)
    assert elsewhere == [None]  # another thread was not the one bound
    backend.send(np.zeros(1), 1 - backend.rank)
    backend.recv(np.zeros(1), 1 - backend.rank, timeout=30)
    backend.close()
    return [inside, sorted(os.sched_getaffinity(0)), b.usable_cores()]


@pytest.mark.skipif(len(CORES) < 2, reason="binding two ranks needs two usable cores")
@pytest.mark.parametrize("mode", ["cores", "off"])
def test_each_rank_runs_on_a_core_of_its_own_until_it_closes(mode):
    with mock.patch.dict(os.environ, {"FERRO_SHM_BIND": mode}):
        got = run_processes(_cores_while_open, 2, transport="shm")
    for rank, (inside, after, usable) in enumerate(got):
        assert after == CORES and usable == CORES  # given back
        assert inside == ([CORES[rank]] if mode == "cores" else CORES)


def _cores_of_a_rank(backend) -> list:
    """This rank's cores with its engine open, and after it closed."""
    backend.barrier(timeout=30)
    inside = sorted(os.sched_getaffinity(0))
    backend.barrier(timeout=30)
    backend.close()
    return [inside, sorted(os.sched_getaffinity(0))]


@pytest.mark.skipif(len(CORES) != 2, reason="4 ranks as a whole multiple of 2 usable cores")
def test_twice_as_many_ranks_as_cores_are_bound_two_to_a_core_until_they_close():
    with mock.patch.dict(os.environ, {"FERRO_SHM_BIND": "auto"}):
        got = run_processes(_cores_of_a_rank, 4, transport="shm")
    for rank, (inside, after) in enumerate(got):
        assert inside == [CORES[rank % 2]] and after == CORES, (rank, inside, after)

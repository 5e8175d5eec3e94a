"""What a misuse gets, alike on every transport (found by a bug hunt against the API): buffers
of Python objects and of datetimes refused on both sides (an object array's pointers crashed
the receiving process), zero-size buffers of two dims taken, a closed subgroup view refusing
every call, a closed backend's abort publishing nothing, an isend's wait validating its
timeout, numpy integers named as such, and ferrorun's and init_from_env's numbers checked
before any rank starts. (A nested subgroup's receives naming the sender's local rank: in
test_sub.py's nested-subgroup test.)"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ferro_backend import (
    InvalidRankError,
    LauncherError,
    PeerClosedError,
    SimulatedBackend,
    SubBackend,
    init_from_env,
)
from ferro_backend.testing import run_processes, run_ranks

FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]


def _unbufferable(b):
    """Each rank sends the other an object array, then a non-contiguous array: a typed error on
    both sides, nothing queued, and the next message is the next one. (A datetime64 array was
    the second one, refused by every transport alike; it now moves as its bytes:
    test_buffer_dtypes.py.)"""
    other = 1 - b.rank
    said = []
    for bad in (np.array([object(), "x"], dtype=object), np.zeros((3, 4))[:, ::2]):
        for call in (lambda bad=bad: b.send(bad, other, tag=1),
                     lambda bad=bad: b.recv(np.zeros((3, 4), bad.dtype)[:, ::2] if not
                                            bad.dtype.hasobject else np.empty_like(bad),
                                            other, tag=1, timeout=5)):
            try:
                call()
                said.append("no error")
            except (TypeError, ValueError) as exc:
                said.append(type(exc).__name__)
    b.send(np.zeros((0, 3)), other, tag=3)  # (zero-size of two dims: no byte cast of a 0)
    b.recv(np.empty((4, 0)), other, tag=3, timeout=10)
    got = np.zeros(2)
    b.send(np.full(2, b.rank + 1.0), other, tag=2)
    b.recv(got, other, tag=2, timeout=10)
    return said, got.tolist()


@pytest.mark.parametrize("transport", ["threads", "tcp", "shm"])
def test_buffers_no_transport_can_carry_are_refused_on_both_sides(transport):
    res = (run_ranks(_unbufferable, 2, timeout=30) if transport == "threads" else
           run_processes(_unbufferable, 2, transport=transport, timeout=60))
    for me, (said, got) in enumerate(res):
        assert said == ["TypeError", "TypeError", "ValueError", "ValueError"], (transport, said)
        assert got == [2.0 - me] * 2


def test_a_closed_subgroup_view_refuses_every_call_and_its_parent_goes_on():
    def fn(b):
        sub = SubBackend(b, [0, 1])
        sub.close()
        out = []
        for call in (lambda: sub.send(b"x", 1 - sub.rank), lambda: sub.recv(bytearray(1), 0),
                     lambda: sub.irecv_any(bytearray(1)), sub.barrier,
                     lambda: sub.abort("after close")):
            try:
                call()
                out.append("returned")
            except PeerClosedError as exc:
                out.append("closed" if "subgroup backend is closed" in str(exc) else str(exc))
        b.barrier(timeout=10)  # the parent is open, and no abort was published
        return out

    assert run_ranks(fn, 2, timeout=30) == [["closed"] * 4 + ["returned"]] * 2


def test_a_closed_backend_aborts_nothing():
    def fn(b):
        if b.rank == 1:
            b.close()
            b.abort("after close")  # (publishes nothing: the others go on)
            return None
        if b.rank == 0:
            b.send(b"x", 2)
            return None
        got = bytearray(1)
        b.recv(got, 0, timeout=10)
        return bytes(got)

    assert run_ranks(fn, 3, timeout=30)[2] == b"x"


def test_an_isends_wait_validates_its_timeout_and_numpy_ranks_are_named():
    (b, c) = SimulatedBackend.create_group(2)
    req = b.isend(b"x", 1)
    for bad in (math.nan, -1.0, "1"):
        with pytest.raises(ValueError, match="timeout"):
            req.wait(bad)
    req.wait(1.0)
    with pytest.raises(InvalidRankError, match=r"dst np.int64\(1\) is numpy.int64, not an int"):
        b.send(b"x", np.int64(1))
    with pytest.raises(ValueError, match=r"numpy.int64, not an int"):
        b.send(b"x", 1, tag=np.int64(3))
    assert SubBackend(b, [np.int64(0), 1]).members == (0, 1)
    with pytest.raises(InvalidRankError, match="member True is not an int"):
        SubBackend(b, [0, True])


def test_numbers_out_of_range_stop_before_any_rank_starts(tmp_path, monkeypatch):
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    for args, said in ((["--master-port", "99999"], "is not a port (0-65535)"),
                       (["--timeout", "nan"], "'nan' is not a number of seconds > 0"),
                       (["--timeout", "0"], "'0' is not a number of seconds > 0"),
                       (["--grace", "inf"], "'inf' is not a finite number of seconds"),
                       (["--settle", "-1"], "'-1' is not >= 0.0"),
                       (["--max-restarts", "-1"], "'-1' is not >= 0")):
        r = subprocess.run([*FERRORUN, "--nproc", "2", *args, str(script)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and said in r.stderr and "ran" not in r.stdout, (args, r)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "99999"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LauncherError, match=r"MASTER_PORT='99999' is not a port \(0-65535\)"):
        init_from_env(timeout=3.0)
    assert os.environ["MASTER_PORT"] == "99999"

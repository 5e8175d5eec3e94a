"""The TCP mesh with connections made on first use (connect="lazy", FERRO_TCP_CONNECT): the
backend contract, crossing connections, only the pairs used, aborts reaching unconnected ranks,
a dead rank named, and init_from_env under ferrorun."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend import (
    PeerAbortedError,
    PeerClosedError,
    TcpBackend,
)
from ferro_backend import settings as ferro_settings
from ferro_backend.mesh.tcp import LAZY_ABOVE
from ferro_backend.testing import check_backend, free_port

pytestmark = pytest.mark.timeout(120)


def group(n: int, connect: str = "lazy", timeout: float = 20) -> list[TcpBackend]:
    addr = f"127.0.0.1:{free_port()}"
    out: list = [None] * n
    errors: list = []

    def build(r):
        try:
            out[r] = TcpBackend(r, n, addr, timeout=timeout, connect=connect)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(b is not None for b in out), errors
    return out


def run_all(fn, backends, timeout=60):
    """``fn(b)`` on every rank at once (threads); the results by rank, errors re-raised."""
    results: list = [None] * len(backends)
    errors: list = []

    def body(b):
        try:
            results[b.rank] = fn(b)
        except BaseException as exc:
            errors.append((b.rank, exc))

    threads = [threading.Thread(target=body, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0][1]
    return results


def close_all(backends):
    """Close every rank at once (as a job's ranks do: each waits briefly for the others'
    goodbyes)."""
    threads = [threading.Thread(target=b.close) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_lazy_passes_the_conformance_kit():
    check_backend(lambda n: group(n), world_sizes=(3,))  # its 2-rank promises run in it too


def test_auto_is_lazy_beyond_the_threshold_only():
    assert ferro_settings.TCP_CONNECT.get({}) == "auto"
    small = group(3, connect="auto")
    try:
        assert not any(b.lazy for b in small) and all(b.connections == 2 for b in small)
    finally:
        close_all(small)
    assert LAZY_ABOVE >= 8
    with pytest.raises(ferro_settings.SettingError, match="FERRO_TCP_CONNECT"):
        TcpBackend(0, 2, "127.0.0.1:1", connect="sometimes")


def test_only_the_pairs_used_are_connected():
    n = 6
    bs = group(n)
    try:
        assert all(b.lazy and b.connections == 0 for b in bs)  # rank 0 included

        def ring(b):
            x = np.full(1000, b.rank, np.int64)
            got = np.empty_like(x)
            req = b.irecv(got, (b.rank - 1) % n, tag=3)
            b.send(x, (b.rank + 1) % n, tag=3)
            req.wait(20)
            return int(got[0]), b.connections

        res = run_all(ring, bs)
        assert [r[0] for r in res] == [(r - 1) % n for r in range(n)]
        assert [r[1] for r in res] == [2] * n  # left and right neighbours, nobody else
    finally:
        close_all(bs)


@settings(max_examples=4, deadline=None)
@given(st.integers(3, 6), st.integers(1, 4), st.randoms(use_true_random=False))
def test_crossing_connections_keep_order_per_pair_and_tag(n, per_pair, rnd):
    """Every rank sends to every other at once, in a random order (connections cross all the
    time); each pair's messages arrive in order, per tag."""
    bs = group(n)
    try:
        def body(b):
            peers = [p for p in range(b.rank + 1, b.rank + n)]
            order = [(p % n, k) for p in peers for k in range(per_pair)]
            rnd.shuffle(order)
            seen = {}
            for p, _ in order:  # sends in random order; per pair, k counts up
                k = seen.get(p, 0)
                seen[p] = k + 1
                b.send(np.array([b.rank, k], np.int64), p, tag=k % 2)
            got = {}
            for p in range(n):
                if p == b.rank:
                    continue
                for k in range(per_pair):
                    buf = np.empty(2, np.int64)
                    b.recv(buf, p, tag=k % 2, timeout=20)
                    got.setdefault(p, []).append(buf.tolist())
            return got

        for r, got in enumerate(run_all(body, bs)):
            for p, msgs in got.items():
                assert msgs == [[p, k] for k in range(per_pair)], (r, p, msgs)
            assert bs[r].connections == n - 1
    finally:
        close_all(bs)


def test_abort_reaches_a_rank_never_talked_to():
    bs = group(4)
    try:
        # ranks 2 and 3 talk; rank 0 never talked to anyone; then rank 0 aborts
        done = threading.Event()

        def waiter():
            try:
                bs[2].recv(np.empty(1), 3, tag=9, timeout=20)
            except PeerAbortedError as exc:
                done.err = exc
            done.set()

        t = threading.Thread(target=waiter)
        t.start()
        bs[3].send(np.ones(1), 1, tag=1)  # 3 connects to 1 only
        bs[0].abort("disk full on rank 0")
        assert done.wait(15), "the abort did not reach rank 2"
        t.join(5)
        assert "disk full on rank 0" in str(done.err)
    finally:
        close_all(bs)


def test_an_abort_is_named_to_a_rank_whose_first_connection_it_refused(monkeypatch):
    """Rank 1's first receive from rank 0 connects while rank 0 aborts (rank 0 greets it only
    after its abort closed its connector): rank 0's abort came in on the connection rank 0 made
    to reach rank 1, so the receive raises PeerAbortedError naming the reason, not the
    RendezvousError 'rank 0 has closed its backend' of the refused handshake."""
    from ferro_backend.mesh import lazy

    greet = lazy.Connector._greet
    held = threading.Event()

    def slow_greet(self, sock, addr):
        if self.rank == 0:
            held.set()
            time.sleep(1.0)  # rank 0 aborts meanwhile
        greet(self, sock, addr)

    monkeypatch.setattr(lazy.Connector, "_greet", slow_greet)
    bs = group(2)
    try:
        got: list = []

        def receive():
            try:
                bs[1].recv(np.empty(1), 0, tag=5, timeout=20)
            except BaseException as exc:
                got.append(exc)

        t = threading.Thread(target=receive)
        t.start()
        assert held.wait(10), "rank 1 never connected to rank 0"
        bs[0].abort("conformance abort")
        t.join(30)
        assert not t.is_alive()
        assert len(got) == 1 and isinstance(got[0], PeerAbortedError), got
        assert "conformance abort" in str(got[0])
    finally:
        close_all(bs)


def test_a_closed_rank_is_named_on_first_use():
    bs = group(3)
    try:
        bs[2].close()
        with pytest.raises(PeerClosedError, match="rank 0 -> 2") as info:
            bs[0].send(np.ones(4), 2)
        assert info.value.peer == 2
        with pytest.raises(PeerClosedError):
            bs[0].recv(np.empty(4), 2, timeout=5)
        bs[0].send(np.ones(4), 1)  # the others go on
        got = np.empty(4)
        bs[1].recv(got, 0, timeout=10)
        assert (got == 1).all()
    finally:
        close_all(bs)


JOB = """
    import json, threading
    import numpy as np
    import ferro_backend as fb
    b = fb.init_from_env()
    n = b.world_size
    x = np.full(1 << 14, float(b.rank))
    got = np.empty_like(x)
    req = b.irecv(got, (b.rank - 1) % n, tag=1)
    b.send(x, (b.rank + 1) % n, tag=1)
    req.wait(30)
    ok = bool((got == (b.rank - 1) % n).all())
    b.barrier()
    print("rank", json.dumps([b.rank, ok, b.lazy, b.connections, threading.active_count()]),
          flush=True)
    b.close()
"""


def _lazy_job(tmp_path, n: int, transport: str) -> list:
    """JOB on ``n`` ranks under ferrorun with FERRO_TCP_CONNECT=lazy: each rank's row."""
    import json

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = dict(os.environ, FERRO_TCP_CONNECT="lazy")
    r = subprocess.run([sys.executable, "-m", "ferro_backend.launch", "--nproc", str(n),
                        "--transport", transport, "--timeout", "60", str(script)],
                       capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = sorted(json.loads(line.split("rank ", 2)[2]) for line in r.stdout.splitlines()
                  if "] rank [" in line)
    assert [row[0] for row in rows] == list(range(n)), rows
    return rows


def test_init_from_env_under_ferrorun_lazy(tmp_path):
    n = 6
    rows = _lazy_job(tmp_path, n, "tcp")
    assert all(row[1] and row[2] for row in rows), rows
    # only the peers the algorithms used, far fewer than the full mesh's n - 1 each
    assert sum(row[3] for row in rows) < n * (n - 1), rows
    assert max(row[4] for row in rows) <= 3 + n, rows


def test_the_engine_setup_opens_no_pair_beyond_rank_0_and_the_barriers(tmp_path):
    """A same-host job on the lazy mesh: the engine's set-up goes through rank 0 (a star), so
    rank r > 0 holds rank 0's connection and its barrier partners', not n - 1."""
    n = 16
    rows = _lazy_job(tmp_path, n, "shm")
    assert all(row[1] for row in rows), rows
    # rank 0 + the dissemination barrier's 2 log2(n) partners at most (the ring of the job
    # travels the engine's rings, not sockets)
    assert max(row[3] for row in rows[1:]) <= 1 + 2 * (n - 1).bit_length(), rows

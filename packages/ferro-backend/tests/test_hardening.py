"""A live TCP job under attack from 127.0.0.1 during its rendezvous.

While rank 0 listens on the master port and rank 1 on its own port, strangers open connections
that say nothing (held open), send random bytes, send the protocol magic with absurd fields,
replay a handshake recorded with the real token, and open 100 connections at once. The job must
still form, exchange correct data within its deadline, and no rank may grow by more than 50 MiB.
"""

import os
import socket
import struct
import threading
import time

import pytest

from ferro_backend.mesh import handshake
from ferro_backend.testing import Job

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-token"

BODY = """
import resource
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("UP", flush=True)
b = TcpBackend.from_env(timeout=40)
n = b.world_size
ok = True
for i in range(20):
    x = np.full(50_000, b.rank * 1000 + i, dtype=np.int64)
    out = np.empty_like(x)
    req = b.irecv(out, (b.rank - 1) % n, tag=i)
    b.send(x, (b.rank + 1) % n, tag=i)
    req.wait(20)
    ok &= bool((out == ((b.rank - 1) % n) * 1000 + i).all())
b.barrier()
result = [ok, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024]
b.close()
"""


def _attack(port: int, stop: threading.Event, held: list) -> None:
    def connect():
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.settimeout(2)
        return s

    for _ in range(100):  # 100 at once, held open saying nothing
        try:
            held.append(connect())
        except OSError:
            pass
    junk = [os.urandom(4096),
            handshake.MAGIC + struct.pack("<H", 999) + b"\0" * 32,       # another version
            handshake.MAGIC + struct.pack("<H", 1) + b"\xff" * 32 + b"\xff" * 10_000]
    # a replayed handshake: a client's hello and proof recorded against another server nonce
    nonce_c, old_nonce_s = os.urandom(32), os.urandom(32)
    replay = (struct.pack("<6sH32s", handshake.MAGIC, handshake.PROTOCOL_VERSION, nonce_c)
              + handshake._mac(TOKEN.encode(), b"client", old_nonce_s, nonce_c))
    while not stop.is_set():
        for payload in [*junk, replay]:
            try:
                with connect() as s:
                    s.sendall(payload)
                    s.recv(256)
            except OSError:
                pass
        time.sleep(0.02)


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (from its socket inodes and /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].split(":")[1], 16))
    return ports


def test_rendezvous_survives_strangers_and_the_job_is_correct():
    stop = threading.Event()
    held: list = []
    attackers = []

    def attack(port: int) -> None:
        t = threading.Thread(target=_attack, args=(port, stop, held), daemon=True)
        t.start()
        attackers.append(t)

    with Job(BODY, 3, connect=False, token=TOKEN, ranks=[0]) as job:
        job.wait_for_line(0, "UP")
        time.sleep(0.3)  # rank 0 is listening on the master port now
        attack(job.port)
        time.sleep(1.0)  # the 100 idle connections and a few rounds of junk are in
        job.start(1)  # rank 1 joins rank 0, then listens for rank 2: attack its port too
        job.wait_for_line(1, "UP")
        end = time.monotonic() + 20
        ports: set[int] = set()
        while not ports and time.monotonic() < end:
            time.sleep(0.05)
            ports = _listening_ports(job.procs[1].pid)
        assert ports, "rank 1 never listened"
        for port in ports:
            attack(port)
        time.sleep(1.0)
        job.start(2)
        try:
            results = job.finish(60)
        finally:
            stop.set()
            for t in attackers:
                t.join(10)
            for s in held:
                s.close()
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        ok, grown_mib = r.result
        assert ok is True
        print(f"rank {r.rank}: RSS grew by {grown_mib:.1f} MiB under attack")
        assert grown_mib < 50, f"rank {r.rank} grew by {grown_mib:.1f} MiB"

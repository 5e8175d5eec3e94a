"""Found by a bug hunt against API.md: a closed or aborted backend of one rank raises
PeerClosedError for a barrier (it has no round that would notice) and for a message to or from
itself (closed wins over the bad peer), on every transport and on a subgroup view; a token that
is neither str nor bytes is refused when the backend is made (a handshake thread died on it, and
both ranks waited out the whole connect timeout); ``ferro_backend.testing`` is reachable as an
attribute after ``import ferro_backend`` alone, and that import does not load it."""

import subprocess
import sys
import time

import pytest

from ferro_backend import (
    InvalidRankError,
    PeerAbortedError,
    PeerClosedError,
    ShmBackend,
    SimulatedBackend,
    SubBackend,
    TcpBackend,
)
from ferro_backend.elastic import ElasticJob
from ferro_backend.testing import free_port


def _one_rank(kind):
    if kind == "sim":
        return SimulatedBackend.create_group(1)[0]
    if kind == "sub":
        return SubBackend(SimulatedBackend.create_group(1)[0], [0])
    cls = TcpBackend if kind == "tcp" else ShmBackend
    return cls(0, 1, f"127.0.0.1:{free_port()}", timeout=10.0)


@pytest.mark.parametrize("end", ["close", "abort"])
@pytest.mark.parametrize("kind", ["sim", "tcp", "shm", "sub"])
def test_a_closed_one_rank_backend_refuses_barrier_and_messages_to_itself(kind, end):
    b = _one_rank(kind)
    b.barrier(timeout=5.0)  # (open: no round, returns)
    with pytest.raises(InvalidRankError):  # (open: its own rank is no peer)
        b.send(b"x", 0)
    if end == "close":
        b.close()
    else:
        b.abort("test")
    calls = {"barrier": lambda: b.barrier(timeout=5.0), "send": lambda: b.send(b"x", 0),
             "isend": lambda: b.isend(b"x", 0), "irecv": lambda: b.irecv(bytearray(1), 0),
             "recv": lambda: b.recv(bytearray(1), 0, timeout=5.0)}
    for name, call in calls.items():
        with pytest.raises(PeerClosedError) as info:
            call()
        assert not isinstance(info.value, InvalidRankError), (kind, end, name)
        if end == "abort" and kind != "sub":
            assert isinstance(info.value, PeerAbortedError), (kind, name, info.value)
    try:
        b.close()
    finally:
        if kind == "sub":
            b.parent.close()


@pytest.mark.parametrize("cls", [TcpBackend, ShmBackend])
@pytest.mark.parametrize("token", [5, 1.5, ["secret"]])
def test_a_token_neither_str_nor_bytes_is_refused_at_once(cls, token):
    start = time.monotonic()
    with pytest.raises(TypeError, match=rf"{cls.__name__}: token must be a str or bytes .*, "
                                        rf"got {type(token).__name__}"):
        cls(0, 2, f"127.0.0.1:{free_port()}", timeout=5.0, token=token)
    # (not after the 5 s connect timeout: 4 leaves room for a loaded host's stalls)
    assert time.monotonic() - start < 4.0


def test_str_and_bytes_tokens_are_taken_and_elastic_needs_a_str():
    for token in ("secret", b"secret", bytearray(b"secret")):
        TcpBackend(0, 1, "127.0.0.1:1", token=token).close()
    with pytest.raises(TypeError, match="ElasticJob: token must be a str, got int"):
        ElasticJob(f"127.0.0.1:{free_port()}", 5)


def test_testing_is_an_attribute_after_import_and_loaded_only_when_asked():
    code = ("import sys, ferro_backend\n"
            "assert 'ferro_backend.testing' not in sys.modules\n"
            "kit = ferro_backend.testing.check_backend\n"
            "import ferro_backend.testing as t\n"
            "assert t.check_backend is kit and ferro_backend.__version__\n"
            "try:\n"
            "    ferro_backend.no_such_name\n"
            "except AttributeError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert "has no attribute 'no_such_name'" in r.stdout

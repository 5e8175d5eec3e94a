"""ElasticJob.pending() sees a coordinator line already read along with an earlier one."""

import socket

from ferro_backend.elastic import ElasticJob


def _job_with(buffered: bytes):
    """An ElasticJob past its generation's start: ``buffered`` already read, nothing more
    on the socket."""
    ours, theirs = socket.socketpair()
    job = ElasticJob.__new__(ElasticJob)
    job._sock, job._buf, job._pending = ours, buffered, False
    job.member_id = 0
    return job, ours, theirs


def test_pending_line_read_with_the_generation_is_seen_at_once():
    # the coordinator's 'pending' came in the same recv as the 'generation' line: it sits in
    # the buffer and no byte more arrives on the socket
    job, ours, theirs = _job_with(b'{"op":"pending"}\n')
    try:
        assert job.pending() is True
        assert job._buf == b""
    finally:
        ours.close()
        theirs.close()


def test_partial_line_in_the_buffer_waits_for_the_rest():
    job, ours, theirs = _job_with(b'{"op":"pen')
    try:
        assert job.pending() is False
        theirs.sendall(b'ding"}\n')
        for _ in range(100):  # (the bytes are local: they come at once)
            if job.pending():
                break
        assert job.pending() is True
    finally:
        ours.close()
        theirs.close()

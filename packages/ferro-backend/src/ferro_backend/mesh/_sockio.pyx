# cython: language_level=3
"""The TCP mesh's per-message system calls, without the GIL and without Python around them.

A frame is ``(kind u8, 7 pad bytes, tag u64, length u64)``, little-endian (``framing.FRAME``),
then ``length`` payload bytes. The receive loop's general path reads a frame in Python steps
(a header read, a claim in the mailbox, a payload read, a completion): here 20 us from a
readable socket to the receive's return for a 16-byte message, 12-13 us with these calls,
which serve the common case of a thread that waits for one peer's next message, and of a
small send:

- :func:`peek_frame`: wait for a whole header on one socket (left in it: peeked) or for another
  descriptor (the receive loop's epoll: any other link, a wake-up) to become readable;
- :func:`take_frame`: consume the peeked header and what the socket holds of the payload into
  the receive's buffer in one ``recvmsg``, then the rest as it arrives while nothing else
  needs the loop;
- :func:`send_frame`: header and payload in one ``sendmsg``, without waiting.

Whatever they leave (a foreign frame, a partial header, a payload still on its way, an end of
file) stays in the socket or is handed to the loop's general path by the caller, so nothing is
lost or read twice. Linux only, as the receive loop (epoll) is (there EWOULDBLOCK is EAGAIN).
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint64_t
from libc.string cimport memset

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    enum:
        POLLIN

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        iovec* msg_iov
        size_t msg_iovlen
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t recvmsg(int fd, msghdr* msg, int flags)
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    enum:
        MSG_DONTWAIT
        MSG_PEEK
        MSG_NOSIGNAL

#: bytes of a frame header
HEADER_BYTES = 24
cdef enum:
    _PEEKED = 0
    _OTHER = 1
    _TIMEOUT = 2
    _UNSURE = 3

#: :func:`peek_frame`'s answers
PEEKED, OTHER, TIMEOUT, UNSURE = _PEEKED, _OTHER, _TIMEOUT, _UNSURE


cdef inline void _frame_msg(msghdr* msg, iovec* iov, unsigned char* head, void* data,
                            size_t n) noexcept nogil:
    """``msg``: the 24-byte ``head``, then ``n`` bytes at ``data`` (none when n is 0)."""
    memset(msg, 0, sizeof(msghdr))
    iov[0].iov_base = head
    iov[0].iov_len = 24
    iov[1].iov_base = data
    iov[1].iov_len = n
    msg.msg_iov = iov
    msg.msg_iovlen = 2 if n else 1


cdef inline int _wait_readable(pollfd* fds, int fd, int other, int ms) noexcept nogil:
    """poll ``fd`` and, if >= 0, ``other`` for input up to ``ms`` milliseconds (poll's answer;
    ``fds[0].revents`` and ``fds[1].revents`` say which)."""
    fds[0].fd = fd
    fds[0].events = POLLIN
    fds[0].revents = 0
    fds[1].fd = other
    fds[1].events = POLLIN
    fds[1].revents = 0
    return poll(fds, 2 if other >= 0 else 1, ms)


cdef inline int _millis(double seconds) noexcept nogil:
    if seconds <= 0:
        return 0
    if seconds >= 86400.0:
        return 86400000
    return <int>(seconds * 1000.0 + 0.999)


def peek_frame(int fd, int other, unsigned char[::1] header not None, double timeout) -> int:
    """Wait up to ``timeout`` seconds until ``fd`` holds a whole frame header, copied into
    ``header`` (24 bytes) and left in the socket (PEEKED), or ``other`` (>= 0) is readable
    (OTHER), or the time is up (TIMEOUT). UNSURE: ``fd`` is readable but holds a partial
    header, its end or an error, or a signal interrupted the wait: the general path looks."""
    cdef pollfd fds[2]
    cdef int ms = _millis(timeout)
    cdef int r
    cdef int answer = _OTHER
    cdef ssize_t n
    if header.shape[0] < 24:
        raise ValueError(f"peek_frame: header buffer of {header.shape[0]} bytes, expected 24")
    with nogil:
        r = _wait_readable(fds, fd, other, ms)
        if r == 0:
            answer = _TIMEOUT
        elif r < 0:
            answer = _UNSURE
        elif fds[0].revents:
            n = recv(fd, &header[0], 24, MSG_PEEK | MSG_DONTWAIT)
            if n == 24:
                answer = _PEEKED
            elif not (n < 0 and errno == EAGAIN and fds[1].revents):
                answer = _UNSURE
    return answer


def take_frame(int fd, int other, unsigned char[::1] out not None, double timeout) -> int:
    """Consume the header :func:`peek_frame` saw and, in the same call, what ``fd`` holds of
    the payload, into ``out`` (its length: the frame's); then wait for the rest on ``fd`` for
    up to ``timeout`` seconds while ``other`` (>= 0: the loop's epoll) stays quiet, so a frame
    that arrives in pieces is still read here, and another link that needs the loop is not
    kept waiting. Returns the payload bytes read (``len(out)``: the frame is done; fewer: the
    rest is still on its way, another link needs the loop, or the connection ended or failed,
    which the next read of the general path finds); -1 if the header was not there whole (a
    second reader: a bug)."""
    cdef unsigned char head[24]
    cdef iovec iov[2]
    cdef msghdr msg
    cdef pollfd fds[2]
    cdef int ms = _millis(timeout)
    cdef Py_ssize_t want = out.shape[0], got = 0
    cdef ssize_t k
    _frame_msg(&msg, iov, head, <void*>&out[0] if want else NULL, <size_t>want)
    with nogil:
        k = recvmsg(fd, &msg, MSG_DONTWAIT)
        while k < 0 and errno == EINTR:
            k = recvmsg(fd, &msg, MSG_DONTWAIT)
        if k < 24:
            got = -1
        else:
            got = k - 24
        while got >= 0 and got < want:
            k = recv(fd, &out[got], <size_t>(want - got), MSG_DONTWAIT)
            if k > 0:
                got += k
                continue
            if k == 0 or errno != EAGAIN:
                if k < 0 and errno == EINTR:
                    continue
                break  # its end or an error: the general path's next read finds it
            if ms <= 0 or _wait_readable(fds, fd, other, ms) <= 0 or not fds[0].revents:
                break  # the time is up, or only another descriptor is readable
    return got


def send_frame(int fd, int kind, uint64_t tag, const unsigned char[::1] payload not None) -> int:
    """Send a frame's header and ``payload`` in one ``sendmsg`` without waiting. Returns the
    bytes sent (header included; 0 when the socket is full), or ``-errno`` on an error."""
    cdef unsigned char head[24]
    cdef iovec iov[2]
    cdef msghdr msg
    cdef uint64_t length = <uint64_t>payload.shape[0]
    cdef ssize_t n
    cdef int i
    memset(head, 0, 24)
    head[0] = <unsigned char>kind
    for i in range(8):
        head[8 + i] = <unsigned char>((tag >> (8 * i)) & 0xFF)
        head[16 + i] = <unsigned char>((length >> (8 * i)) & 0xFF)
    _frame_msg(&msg, iov, head, <void*>&payload[0] if length else NULL, <size_t>length)
    with nogil:
        while True:
            n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
            if n >= 0:
                break
            if errno == EINTR:
                continue
            n = 0 if errno == EAGAIN else -errno
            break
    return n

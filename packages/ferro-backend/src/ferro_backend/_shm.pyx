# cython: language_level=3
"""Single-copy reads from and writes to another process's memory (Linux cross-memory attach).

``cma_read`` copies a peer's buffer straight into ours with one kernel copy
(``process_vm_readv``), the GIL released; this is how Open MPI and MPICH move large messages
between processes of one host. ``cma_write`` is the other direction (``process_vm_writev``):
a broadcast's root pushes part of its buffer into a reader's while that reader pulls the rest.
Validation lives in ``shm.py`` and ferro-collective's engine.
"""

from libc.errno cimport errno


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec* local_iov, unsigned long liovcnt,
                             const iovec* remote_iov, unsigned long riovcnt,
                             unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec* local_iov, unsigned long liovcnt,
                              const iovec* remote_iov, unsigned long riovcnt,
                              unsigned long flags)

cdef extern from *:
    """
    #include <limits.h>
    #include <stdint.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <linux/futex.h>
    static inline void ferro_wake_all(uint32_t* word) {
        syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    """
    void ferro_wake_all(unsigned int* word) noexcept nogil


cdef extern from "<sys/prctl.h>" nogil:
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4,
              unsigned long arg5)
    int PR_SET_PTRACER


cdef Py_ssize_t _move(int pid, size_t remote, unsigned char* local, Py_ssize_t n, bint write,
                      int* err) noexcept nogil:
    """Read (or write) ``n`` bytes; returns the count moved (short only on error, ``err``
    set)."""
    cdef iovec liov, riov
    cdef Py_ssize_t done = 0
    cdef ssize_t got
    while done < n:
        liov.iov_base = local + done
        liov.iov_len = n - done
        riov.iov_base = <void*>(remote + done)
        riov.iov_len = n - done
        if write:
            got = process_vm_writev(pid, &liov, 1, &riov, 1, 0)
        else:
            got = process_vm_readv(pid, &liov, 1, &riov, 1, 0)
        if got <= 0:
            err[0] = errno if got < 0 else 5  # EIO on a zero-length read
            return done
        done += got
    return done


def cma_read(int pid, size_t remote_addr, unsigned char[::1] out):
    """Copy ``len(out)`` bytes at ``remote_addr`` in process ``pid`` into ``out``.

    Raises OSError (EPERM where the kernel forbids it, ESRCH if the process is gone, EFAULT
    for a bad address).
    """
    cdef Py_ssize_t n = out.shape[0], got
    cdef int err = 0
    if n == 0:
        return
    with nogil:
        got = _move(pid, remote_addr, &out[0], n, False, &err)
    if got != n:
        import os
        raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)} after "
                           f"{got} of {n} bytes")


def cma_write(int pid, size_t remote_addr, const unsigned char[::1] data):
    """Copy ``data`` to ``remote_addr`` in process ``pid`` (errors as :func:`cma_read`)."""
    cdef Py_ssize_t n = data.shape[0], got
    cdef int err = 0
    if n == 0:
        return
    with nogil:
        got = _move(pid, remote_addr, <unsigned char*>&data[0], n, True, &err)
    if got != n:
        import os
        raise OSError(err, f"process_vm_writev to pid {pid}: {os.strerror(err)} after "
                           f"{got} of {n} bytes")


def allow_peers_to_read() -> bool:
    """Let sibling processes read this one's memory where Yama restricts it to ancestors."""
    cdef int rc
    with nogil:
        rc = prctl(PR_SET_PTRACER, <unsigned long>0xFFFFFFFFFFFFFFFF, 0, 0, 0)
    return rc == 0


def futex_wake(size_t address):
    """Wake every thread (of any process) sleeping in a futex wait on the 32-bit word at
    ``address`` (a word of a shared mapping; the caller owns the mapping)."""
    with nogil:
        ferro_wake_all(<unsigned int*>address)

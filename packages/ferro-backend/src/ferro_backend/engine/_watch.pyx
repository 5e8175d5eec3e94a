# cython: language_level=3
"""The backstop of a rank's incoming rings (``_ring.pyx``), asleep on the rank's doorbell.

A producer about to sleep (its ring is full, or it waits for a descriptor to be read) rings
its consumer's doorbell first. :meth:`Watch.wait_stale` sleeps on that doorbell without the GIL
and, once rung, returns the rings whose oldest entry nobody consumed for a whole period: the
rank's watch thread then moves those entries into its mailbox, so a receive that is not posted
yet never stalls a sender. Entries a receiver is about to take stay where they are (no extra
copy), and an idle rank's watch costs nothing.
"""

include "_engine.pxi"


cdef class Watch:
    """Rank ``me``'s incoming rings from ``peers`` in the mapped ``segment`` (its bytes: holding
    them keeps the mapping alive); ``stop_word`` is a numpy u32 array whose first word
    :meth:`wake` sets."""

    cdef ferro_ring_ctrl** rings
    cdef uint32_t* seen
    cdef int count
    cdef uint32_t* bell
    cdef uint32_t rung
    cdef uint32_t* stop
    cdef object _keep

    def __init__(self, unsigned char[::1] segment, int nranks, size_t slot_bytes,
                 size_t ring_bytes, int me, list peers, object stop_word):
        import numpy as np

        cdef ferro_layout L
        cdef Py_ssize_t i, n = len(peers)
        cdef unsigned char* base = &segment[0]
        ferro_layout_init(&L, nranks, slot_bytes, ring_bytes)
        if <size_t>segment.shape[0] < L.size:
            raise ValueError(f"Watch: {segment.shape[0]} bytes, the layout needs {L.size}")
        self._keep = (np.zeros(max(1, n), dtype=np.uint64), np.zeros(max(1, n), np.uint32),
                      stop_word, segment)
        self.rings = <ferro_ring_ctrl**><size_t>self._keep[0].ctypes.data
        self.seen = <uint32_t*><size_t>self._keep[1].ctypes.data
        self.count = n
        for i in range(n):
            if not 0 <= peers[i] < nranks or peers[i] == me:
                raise ValueError(f"Watch: {peers[i]} is not a peer of rank {me} of {nranks}")
            self.rings[i] = ferro_ring_of(base, &L, peers[i], me)
        self.bell = &ferro_ctrl_of(base, &L, me).bell
        self.rung = ferro_load(self.bell)
        self.stop = <uint32_t*><size_t>stop_word.ctypes.data

    def wait_stale(self, double period):
        """Wait for the doorbell, then for a ``period``; returns the indexes (into ``peers``)
        of the rings whose oldest entry sat there all that period, or None once :meth:`wake`
        was called."""
        cdef int i
        cdef bint found = False
        cdef uint32_t t
        with nogil:
            while not found and ferro_load(self.stop) == 0:
                if ferro_load(self.bell) == self.rung:
                    ferro_futex_wait(self.bell, self.rung, FERRO_SLICE)
                    continue
                self.rung = ferro_load(self.bell)
                for i in range(self.count):
                    t = ferro_load(&self.rings[i].tail)
                    self.seen[i] = t if t != ferro_load(&self.rings[i].head) else t ^ 1u
                ferro_futex_wait(self.stop, 0, period)
                for i in range(self.count):
                    t = ferro_load(&self.rings[i].tail)
                    if t == self.seen[i] and t != ferro_load(&self.rings[i].head):
                        found = True
        if not found:
            return None
        return [i for i in range(self.count) if ferro_load(&self.rings[i].tail) == self.seen[i]]

    def wake(self):
        """Stop: set the stop word and wake the watcher."""
        ferro_store(self.stop, 1)
        ferro_futex_wake(self.stop)
        ferro_futex_wake(self.bell)

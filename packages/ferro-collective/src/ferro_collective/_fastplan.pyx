# cython: language_level=3
"""The one-call plans the compiled dispatcher (:mod:`._fastcall`) runs: one per call signature,
made by the collectives' modules (the makers registered with ``_fastcall.register``); and the
sequence counter it advances in C."""

from libc.stdint cimport uint64_t


cdef class FastPlan:
    """One signature's one-call plan: the header (sequence number 0) and its hash, the
    result's shape, and what the step does (a fold: dtype code, kernel op, MEAN divisor, the
    byte offset and item count of this rank's part; a copy: the root (-1: all_gather), whether
    one step carries it, else the Python ``staged(group, call, header, x, out, root)``)."""

    def __init__(self, str name, bytes header, tuple shape, uint64_t hash):
        if len(shape) > MAX_DIMS or len(header) > 128:
            raise ValueError(f"FastPlan: a {len(shape)}-d result (at most {MAX_DIMS}) or a "
                             f"{len(header)}-byte header (at most 128)")
        self.name, self.header, self.shape, self.hash = name, header, shape, hash
        self.hptr, self.hlen = header, len(header)
        self.out_ndim = len(shape)
        for i, d in enumerate(shape):
            self.out_dims[i] = d
        self.taken, self.root = True, -1

    @staticmethod
    def fold(str name, bytes header, tuple shape, uint64_t hash, int code, int kernel,
             double div, size_t offset, Py_ssize_t count):
        """A reduction: ``out`` = the fold of ``count`` items at ``offset`` of every slot."""
        p = FastPlan(name, header, shape, hash)
        p.code, p.kernel, p.div, p.offset, p.count = code, kernel, div, offset, count
        return p

    @staticmethod
    def copy(str name, bytes header, tuple shape, uint64_t hash, int root, bint one_step,
             staged):
        """A broadcast (``root`` >= 0) or all_gather (-1), in one step or ``staged``."""
        p = FastPlan(name, header, shape, hash)
        p.root, p.one_step, p.staged = root, one_step, staged
        return p


cdef class SeqCounter:
    """A backend's collective sequence numbers: ``counter()`` is the next (atomic under the
    GIL); the compiled paths take theirs without a call."""

    def __call__(self):
        self.value += 1
        return self.value - 1

# cython: language_level=3
"""The plans the compiled one-call paths (:mod:`._onecall`) run: one per call signature;
and the sequence counter of a backend without an engine (an engine's tickets are its door's)."""


cdef class DoorPlan:
    """One signature's one-call plan: the engine door's call of it (``call``, a
    ``ferro_backend.engine._calls.Call``: the collective, its dtype, op or root, the shape its
    header names), the input's and the result's shapes; ``taken`` False for a signature the
    door cannot run (the general path then checks the call)."""

    def __init__(self, str name, tuple shape, tuple out_shape, object call):
        if len(shape) > MAX_DIMS or len(out_shape) > MAX_DIMS:
            raise ValueError(f"DoorPlan: a {max(len(shape), len(out_shape))}-d input or result "
                             f"(at most {MAX_DIMS})")
        self.name, self.shape, self.call = name, shape, call
        self.out_ndim = len(out_shape)
        for i, d in enumerate(out_shape):
            self.out_dims[i] = d
        self.taken = True

    @staticmethod
    def not_taken():
        """The plan of a signature no one-call path runs."""
        p = DoorPlan("", (), (), None)
        p.taken = False
        return p

    @property
    def out_shape(self) -> tuple:
        return tuple(self.out_dims[i] for i in range(self.out_ndim))


cdef class SeqCounter:
    """A backend's collective sequence numbers: ``counter()`` is the next (atomic under the
    GIL)."""

    def __call__(self):
        self.value += 1
        return self.value - 1

    def catch_up(self, seq, count):
        """Number ``seq``'s call took ``count`` fewer numbers than a peer's (after a mismatch):
        skip the next ``count``, unless a call took one after it (False then)."""
        if self.value != seq + 1:
            return False
        self.value += count
        return True

"""PowerSGD (Vogels et al., 2019) as a DDP communication hook, as torch implements it
(``ferro_fsdp.comm_hooks.powerSGD_hook`` with a ``PowerSGDState``).

Each gradient matrix M (n x m, a parameter of 2 or more dims reshaped) becomes P = M Q (n x r)
and Q = M^T P (m x r), two allreduces of (n + m) r values instead of n m; P is orthogonalized
between them; the bucket's error (what the approximation left out) is added to the next step's
gradients (error feedback); Q starts from the last step's (warm start). Vectors, and matrices
that rank ``r`` would not shrink by ``min_compression_rate``, are averaged exactly. Before
``start_powerSGD_iter`` steps every bucket is averaged exactly. The state (step count, errors,
the Ps and Qs) is saved with :meth:`PowerSGDState.state_dict` and restored with
:meth:`PowerSGDState.load_state_dict`: a resumed run continues exactly. The hook computes between
its two allreduces, so it runs in the training thread.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ferro_backend import Backend
from ferro_collective import ReduceOp, Work, allreduce

from .background import finished, mean_in_place

if TYPE_CHECKING:
    from .comm_hooks import GradBucket



class PowerSGDState:
    """The state of :func:`powerSGD_hook` (torch's ``PowerSGDState``, its defaults).

    Parameters
    ----------
    backend : ferro_backend.Backend
        The backend to reduce over.
    matrix_approximation_rank : int, default 1
        The rank ``r`` of the approximation.
    start_powerSGD_iter : int, default 1000
        Steps averaged exactly before compression starts (its first steps are the noisiest).
    min_compression_rate : float, default 2
        A matrix is compressed only when ``n m / ((n + m) r)`` exceeds this (as torch's hook:
        at exactly the rate it is averaged exactly).
    use_error_feedback : bool, default True
        Add what the approximation left out to the next step's gradients.
    warm_start : bool, default True
        Start each step's Q from the last step's (else a fresh random Q every step).
    orthogonalization_epsilon : float, default 0
        Added to each column's norm when P is orthogonalized (0: none; a column of zeros then
        stays zeros).
    random_seed : int, default 0
        The seed of the Qs (the same on every rank).

    Raises
    ------
    ValueError
        A rank below 1, a negative start, a compression rate below 1.
    """

    def __init__(self, backend: Backend, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0) -> None:
        if int(matrix_approximation_rank) < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank "
                             f"{matrix_approximation_rank}, expected >= 1")
        if int(start_powerSGD_iter) < 0:
            raise ValueError(f"PowerSGDState: start_powerSGD_iter {start_powerSGD_iter}, "
                             "expected >= 0")
        if not min_compression_rate >= 1:
            raise ValueError(f"PowerSGDState: min_compression_rate {min_compression_rate}, "
                             "expected >= 1")
        self.backend = backend
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        #: steps done (counted at each step's last bucket)
        self.iter = 0
        #: bucket index -> its error (this rank's), as the bucket's flat buffer
        self.error_dict: dict[int, np.ndarray] = {}
        #: bucket index -> the Qs of its compressed matrices, one flat array (warm start)
        self.q_memory_dict: dict[int, np.ndarray] = {}

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a step at its last bucket.

        Parameters
        ----------
        bucket : GradBucket
        """
        if bucket.is_last():
            self.iter += 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly: the step count, the settings, each
        bucket's error and Qs (copies).

        Returns
        -------
        dict
            Numbers and numpy arrays (``error/<bucket>``, ``q/<bucket>``): what a checkpoint
            holds.
        """
        out: dict[str, Any] = {"iter": self.iter, "rank": self.matrix_approximation_rank,
                               "random_seed": self.random_seed}
        out.update({f"error/{k}": v.copy() for k, v in self.error_dict.items()})
        out.update({f"q/{k}": v.copy() for k, v in self.q_memory_dict.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result. Errors (Qs) are not kept where this state
        does not use them (``use_error_feedback=False``, ``warm_start=False``).

        Parameters
        ----------
        state : dict

        Raises
        ------
        ValueError
            It was saved with another approximation rank or seed.
        """
        for key, mine in self._settings():
            if int(state[key]) != mine:
                raise ValueError(f"PowerSGDState.load_state_dict: saved with {key} "
                                 f"{int(state[key])}, this state has {mine}")
        self.iter = int(state["iter"])
        self._restore({int(k.split("/", 1)[1]): np.array(v) for k, v in state.items()
                       if k.startswith("error/")},
                      {int(k.split("/", 1)[1]): np.array(v) for k, v in state.items()
                       if k.startswith("q/")})

    def _settings(self) -> tuple[tuple[str, int], ...]:
        """What a saved state must have been saved with to be this one's (its Qs' shapes and
        values follow from them)."""
        return (("rank", self.matrix_approximation_rank), ("random_seed", self.random_seed))

    def _restore(self, errors: dict[int, np.ndarray], qs: dict[int, np.ndarray]) -> None:
        """Take restored errors and Qs, but not those this state's hook never uses nor
        updates (``use_error_feedback=False``'s errors, ``warm_start=False``'s Qs): kept, every
        later save would carry them unchanged, and a resume of such a one with them on would
        add an error (or start from a Q) many steps old."""
        self.error_dict = errors if self.use_error_feedback else {}
        self.q_memory_dict = qs if self.warm_start else {}

    def sharded_state_dict(self, prefix: str = "powersgd.") -> tuple[dict[str, np.ndarray],
                                                                    dict[str, tuple]]:
        """:meth:`state_dict` as a checkpoint's sharded tensors, in the form of
        ``DDP.sharded_state_dict()`` (merge the two before saving): each array
        of this rank is row ``rank`` of a tensor of ``world_size`` rows, sharded along dim 0
        one row a rank, so every rank saves its own error feedback (it differs by rank).

        Parameters
        ----------
        prefix : str, default "powersgd."
            The tensors' names start with it: ``<prefix>iter``, ``<prefix>rank`` and
            ``<prefix>random_seed`` (what :meth:`load_sharded_state_dict` checks, as
            :meth:`load_state_dict` does), ``<prefix>error.<bucket>``, ``<prefix>q.<bucket>``.

        Returns
        -------
        (dict, dict)
            This rank's rows (arrays of shape ``(1, ...)``) and each tensor's
            ``(shape, dim, shard_sizes)``.
        """
        n = self.backend.world_size
        rows = {f"{prefix}iter": np.array([[self.iter]], np.int64)}
        rows.update({f"{prefix}{key}": np.array([[value]], np.int64)
                     for key, value in self._settings()})
        rows.update({f"{prefix}error.{k}": v.reshape(1, -1).copy()
                     for k, v in self.error_dict.items()})
        rows.update({f"{prefix}q.{k}": v.reshape(1, -1).copy()
                     for k, v in self.q_memory_dict.items()})
        return rows, {k: ((n, *v.shape[1:]), 0, [1] * n) for k, v in rows.items()}

    def load_sharded_state_dict(self, tensors: dict[str, np.ndarray],
                                prefix: str = "powersgd.") -> bool:
        """Continue from :meth:`sharded_state_dict`'s tensors as a checkpoint restored them,
        taking (popping) the ones named with ``prefix`` out of ``tensors``. Restored on the
        world size that saved them, each rank gets its own error feedback and Qs back: the run
        continues exactly. On another world size a rank's row is not its own (the error
        feedback is per rank): the step count is kept, errors and Qs start afresh. Errors
        (Qs) are not kept where this state does not use them (``use_error_feedback=False``,
        ``warm_start=False``). Every rank calls it (it agrees with the others over the
        backend: one small allreduce).

        Parameters
        ----------
        tensors : dict of str to numpy.ndarray
            A restored checkpoint's tensors (the others are left in it).
        prefix : str, default "powersgd."

        Returns
        -------
        bool
            True: restored whole; False: on another world size (errors and Qs dropped).

        Raises
        ------
        KeyError
            ``tensors`` has no ``<prefix>iter`` (the checkpoint holds no PowerSGD state).
        ValueError
            It was saved with another approximation rank or seed (on every rank, before
            anything is taken; a checkpoint that does not hold them, written before they were
            saved, is not checked).
        """
        if f"{prefix}iter" not in tensors:
            raise KeyError(f"PowerSGDState.load_sharded_state_dict: no {prefix}iter in the "
                           "checkpoint's tensors (it holds no PowerSGD state)")
        mine = {k[len(prefix):]: np.asarray(v) for k, v in tensors.items()
                if k.startswith(prefix)}
        steps = mine.pop("iter").reshape(-1)
        settings = self._settings()
        # each setting's saved value (the same in every row; -1: this rank restored no row of
        # it, or the checkpoint has none)
        saved = [int(mine.pop(key).reshape(-1).max(initial=-1)) if key in mine else -1
                 for key, _ in settings]
        own = steps.size == 1 and all(v.shape[0] == 1 for v in mine.values())
        # one decision on every rank (a rank whose rows are not its own makes it for all), one
        # step count (a rank of a new world may have restored no row of it), one check
        lost, step, *saved = allreduce(
            np.array([0 if own else 1, steps.max() if steps.size else -1, *saved], np.int64),
            self.backend, ReduceOp.MAX).tolist()
        for (key, value), was in zip(settings, saved):
            if was >= 0 and was != value:
                raise ValueError(f"PowerSGDState.load_sharded_state_dict: saved with {key} "
                                 f"{was}, this state has {value}")
        for k in [k for k in tensors if k.startswith(prefix)]:
            del tensors[k]
        self.iter = int(step)
        if lost:
            self.error_dict, self.q_memory_dict = {}, {}
            return False
        self._restore({int(k.split(".", 1)[1]): np.array(v[0]) for k, v in mine.items()
                       if k.startswith("error.")},
                      {int(k.split(".", 1)[1]): np.array(v[0]) for k, v in mine.items()
                       if k.startswith("q.")})
        return True


def _orthogonalize(p: np.ndarray, eps: float) -> None:
    """Gram-Schmidt on the columns of ``p`` (n x r), in place. The norms and projections of a
    float16 ``p`` are summed in float32 (a column's squared norm past 65504 read inf in float16,
    and the column, then the bucket's approximated gradients, came out zero); float32 and
    float64 keep their own dtype, and their bits."""
    wide = np.promote_types(p.dtype, np.float32)

    def widened(a: np.ndarray) -> np.ndarray:
        return a if a.dtype == wide else a.astype(wide)

    for i in range(p.shape[1]):
        col = p[:, i]
        c = widened(col)
        norm = np.sqrt(c @ c)
        col /= norm + eps if eps else (norm or 1.0)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= np.outer(col, widened(col) @ widened(rest)).astype(p.dtype, copy=False)


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Work:
    """The bucket's mean, its matrices approximated at rank ``r`` (module docstring).

    Parameters
    ----------
    state : PowerSGDState
    bucket : GradBucket

    Returns
    -------
    ferro_collective.Work
        Its result is the bucket itself, the approximate mean written into it (done when
        returned once compressing; before ``start_powerSGD_iter``, the exact mean, started as
        :func:`~ferro_fsdp.comm_hooks.allreduce_hook` starts it).
    """
    backend, flat = state.backend, bucket.buffer()
    n = backend.world_size
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)  # exact: the mean in place, as DDP's own allreduce
        return mean_in_place(bucket.background(), flat, backend)
    key, r = bucket.index(), state.matrix_approximation_rank
    if state.use_error_feedback:
        error = state.error_dict.get(key)
        if error is not None and error.shape != flat.shape:
            # (restored from a run whose buckets were cut otherwise: not this bucket's)
            warnings.warn(f"powerSGD_hook: the error feedback of bucket {key} has "
                          f"{error.size} values, the bucket {flat.size} (restored from a run "
                          "with another bucket plan?): it starts afresh", RuntimeWarning,
                          stacklevel=2)
            error = None
        if error is None:
            error = state.error_dict[key] = np.zeros_like(flat)
        flat += error
        local = flat.copy()
    grads = bucket.gradients()
    mats, rest = [], []
    for g in grads:
        rows = g.shape[0] if g.ndim >= 2 else 0
        cols = g.size // rows if rows else 0
        rate = rows * cols / ((rows + cols) * r) if rows else 0
        (mats if g.ndim >= 2 and rate > state.min_compression_rate else rest).append(g)
    if rest:  # exactly: one mean allreduce of them all
        joined = np.concatenate([g.reshape(-1) for g in rest])
        allreduce(joined, backend, ReduceOp.MEAN, out=joined)
        offset = 0
        for g in rest:
            g.reshape(-1)[...] = joined[offset:offset + g.size]
            offset += g.size
    if mats:
        ms = [g.reshape(g.shape[0], -1) for g in mats]
        q_all = state.q_memory_dict.get(key) if state.warm_start else None
        if q_all is None or q_all.size != sum(m.shape[1] * r for m in ms):
            # a fresh Q, the same on every rank, orthogonalized (as torch: a warm Q is not)
            rng = np.random.default_rng((state.random_seed, key, 0 if state.warm_start
                                         else state.iter))
            q_all = rng.standard_normal(sum(m.shape[1] * r for m in ms)).astype(flat.dtype)
            for q in _split(q_all, [(m.shape[1], r) for m in ms]):
                _orthogonalize(q, state.orthogonalization_epsilon)
        qs = _split(q_all, [(m.shape[1], r) for m in ms])
        p_all = np.concatenate([(m @ q).reshape(-1) for m, q in zip(ms, qs)])
        allreduce(p_all, backend, ReduceOp.SUM, out=p_all)
        ps = _split(p_all, [(m.shape[0], r) for m in ms])
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        q_all = np.concatenate([(m.T @ p).reshape(-1) for m, p in zip(ms, ps)])
        allreduce(q_all, backend, ReduceOp.SUM, out=q_all)
        qs = _split(q_all, [(m.shape[1], r) for m in ms])
        for m, p, q in zip(ms, ps, qs):
            np.matmul(p, q.T / flat.dtype.type(n), out=m)
        if state.warm_start:
            state.q_memory_dict[key] = q_all.copy()
    if state.use_error_feedback:
        np.subtract(local, flat, out=state.error_dict[key])
    state.maybe_increase_iter(bucket)
    return finished(flat, "powerSGD")


def _split(flat: np.ndarray, shapes: list[tuple[int, int]]) -> list[np.ndarray]:
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset:offset + rows * cols].reshape(rows, cols))
        offset += rows * cols
    return out


__all__ = ["PowerSGDState", "powerSGD_hook"]

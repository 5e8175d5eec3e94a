"""Asynchronous saves: copy the state on the caller's thread, write it in the background."""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .collective_save import next_save, numbered, refuse_in_background
from .errors import AsyncCheckpointError, DistCheckpointError, InvalidArgumentError
from .layout import recover
from .metadata import ShardMetadata, check_rank_world
from .save import committed_generation, encode_extra, save_distributed

#: saves still running: (future, directory, seconds the exit waits for it; None: no limit)
_RUNNING: set[tuple[concurrent.futures.Future, Path, float | None]] = set()
_RUNNING_LOCK = threading.Lock()


def _finish_at_exit() -> None:
    """At interpreter exit, let the saves still running finish: a save without a backend
    writes its own files and cannot hang (it ends); a collective one waits for its peers, for at
    most its backend's timeout. One that does not end is named on stderr (it is not
    committed: the previous checkpoint stays), never dropped without a word."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for future, directory, limit in running:
        concurrent.futures.wait([future], limit)
        if not future.done():
            sys.stderr.write(f"ferro-checkpoint: the save to {directory} was still running at "
                             f"exit after {limit:g} s more; it is not committed\n")


atexit.register(_finish_at_exit)


def _run_in_background(fn: Callable[[], str], name: str, directory: Path = Path("."),
                       limit: float | None = None) -> concurrent.futures.Future:
    """Run ``fn`` on a new daemon thread; its result or exception lands in the returned future.

    Not a ThreadPoolExecutor: its workers are joined at interpreter exit with no limit, so a
    collective save waiting on a dead peer would block exit for ever; a daemon thread is waited
    for by :func:`_finish_at_exit` for at most ``limit`` seconds (None: until it ends).
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    entry = (future, Path(directory), limit)
    with _RUNNING_LOCK:
        _RUNNING.add(entry)
    future.add_done_callback(lambda _f: _discard(entry))

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _committed_generation(directory: Path) -> int:
    """N of the checkpoint ``g<N>`` committed in ``directory`` (0: none, or another id), once a
    save committed before a crash is finished."""
    if directory.is_dir():
        try:
            recover(directory)
        except (OSError, DistCheckpointError):
            pass  # (the first save reports what is wrong with the directory)
    return committed_generation(directory)


def _discard(entry) -> None:
    with _RUNNING_LOCK:
        _RUNNING.discard(entry)


class CheckpointFuture:
    """The pending result of :meth:`AsyncCheckpointer.save_async` (a ``concurrent.futures``
    future underneath, whose result is the checkpoint id).

    Made by :class:`AsyncCheckpointer` and :class:`CheckpointManager`, not by users.

    Parameters
    ----------
    directory : pathlib.Path
        The checkpoint directory being saved (named by errors).
    future : concurrent.futures.Future
        The background save; its result is the checkpoint id.
    """

    def __init__(self, directory: Path, future: concurrent.futures.Future) -> None:
        self.directory = directory
        self._future = future
        #: whether wait() raised the save's failure (a manager's next save does not raise it again)
        self._failure_reported = False

    @property
    def checkpoint_id(self) -> str | None:
        """The saved checkpoint's id once the save succeeded, else None."""
        f = self._future
        return f.result() if f.done() and f.exception() is None else None

    def is_done(self) -> bool:
        """True once the background write finished, successfully or not.

        Returns
        -------
        bool
            Whether the save finished (never blocks).
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's save is done: committed with a backend (a collective save);
        without one, its shard is written, and the save is committed once every rank's is (the
        last rank's save commits it). Idempotent; raises AsyncCheckpointError (the
        cause chained) every time if the save failed.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; None (the default) waits as long as the save takes.

        Raises
        ------
        AsyncCheckpointError
            The save failed (its error is the ``__cause__``), or is not done after ``timeout``.
        """
        concurrent.futures.wait([self._future], timeout)
        if not self._future.done():
            raise AsyncCheckpointError(f"save to {self.directory} not done after {timeout}s")
        error = self._future.exception()
        if error is not None:
            self._failure_reported = True
            raise AsyncCheckpointError(f"asynchronous save to {self.directory} failed: "
                                       f"{type(error).__name__}: {error}") from error


class _RankSaves:
    """What :class:`AsyncCheckpointer` and :class:`~ferro_checkpoint.CheckpointManager` share:
    one rank of a world saving (collectively with ``backend``, else alone), and the future of
    its last background save."""

    def __init__(self, op: str, rank: int, world_size: int, backend) -> None:
        rank, world_size = check_rank_world(op, rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._pending: CheckpointFuture | None = None

    def _save_in_background(self, directory: Path, save: Callable[[], str],
                            thread_name: str) -> CheckpointFuture:
        """Run ``save`` (which must only read copies made now) on a background thread; its
        future becomes the pending one."""
        limit = None if self.backend is None else float(self.backend.timeout)
        self._pending = CheckpointFuture(directory, _run_in_background(save, thread_name,
                                                                       directory, limit))
        return self._pending


class AsyncCheckpointer(_RankSaves):
    """Saves a rank's shards in a background thread.

    ``save_async`` copies the state dict on the calling thread (so training may modify its
    tensors at once) and returns a :class:`CheckpointFuture`; a second ``save_async`` while one
    is in flight raises :class:`AsyncCheckpointError`. With ``backend=`` the save is collective
    (see :func:`save_distributed`); its messages travel on a private subgroup, so they never mix
    with the training's collectives running meanwhile.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory every save writes (see :func:`save_distributed`).
    rank, world_size : int
        This rank and the number of ranks saving.
    shard_spec : ShardMetadata
        The default shard spec of the saves; ``shard_spec.num_ranks`` must be ``world_size``.
    backend : ferro_backend.Backend, optional
        Makes every save collective (default: None, each rank saves alone).

    Raises
    ------
    InvalidArgumentError
        A bad ``rank`` or ``world_size``, or a ``shard_spec`` of another world size.

    Examples
    --------
    >>> state = {"w": np.zeros(4, np.float32)}
    >>> saver = AsyncCheckpointer("ckpt", 0, 1, flat_shard_metadata(state, 1))
    >>> future = saver.save_async(state, extra={"step": 1})
    >>> state["w"] += 1  # training goes on: the save wrote a copy
    >>> future.wait()  # committed, or AsyncCheckpointError
    """

    def __init__(self, directory, rank: int, world_size: int, shard_spec: ShardMetadata, *,
                 backend=None) -> None:
        super().__init__("AsyncCheckpointer", rank, world_size, backend)
        if shard_spec.num_ranks != world_size:
            raise InvalidArgumentError(f"AsyncCheckpointer: shard_spec.num_ranks "
                                       f"{shard_spec.num_ranks} != world_size {world_size}")
        self.directory = Path(directory)
        self.shard_spec = shard_spec
        # without a backend, saves without an id are numbered by this checkpointer: g<N+1>,
        # g<N+2>... after the generation N committed when it was built (every rank builds its
        # checkpointer before its first save), not by each save's reading of metadata.json: a
        # rank whose previous save was not committed yet (a peer still writing it) read the
        # same N, reused the id, and its new shard was committed with the peer's old one
        self._generation = None if backend is not None else _committed_generation(
            self.directory)

    @property
    def dir(self) -> Path:
        """The checkpoint directory (``directory``)."""
        return self.directory

    @property
    def in_flight(self) -> CheckpointFuture | None:
        """The future of the last save, or None."""
        return self._pending

    def wait(self) -> None:
        """Wait for the last save (if any); raises AsyncCheckpointError if it failed.

        Raises
        ------
        AsyncCheckpointError
            The last save failed (its error is the ``__cause__``).
        """
        if self._pending is not None:
            self._pending.wait()

    def save_async(self, state_dict: Mapping[str, np.ndarray], *,
                   shard_spec: ShardMetadata | None = None,
                   checkpoint_id: str | None = None,
                   extra: Mapping | None = None) -> CheckpointFuture:
        """Copy ``state_dict`` (and serialize ``extra``) now, save it in the background.

        Parameters
        ----------
        state_dict : mapping of str to numpy.ndarray
            This rank's tensors, as for :func:`save_distributed`; copied before this returns.
        shard_spec : ShardMetadata, optional
            This save's shard spec (default: the checkpointer's).
        checkpoint_id : str, optional
            As for :func:`save_distributed` (default: None).
        extra : mapping, optional
            A JSON-serializable dict saved with this rank's shard (default: None).

        Returns
        -------
        CheckpointFuture
            The save's future: ``wait()`` returns once it is committed (with a backend;
            without one, once this rank's shard is written: see :meth:`CheckpointFuture.wait`).

        Raises
        ------
        AsyncCheckpointError
            The previous save is still in flight.
        InvalidArgumentError
            ``extra`` is not a JSON-serializable dict.
        """
        # numbered now, in the program's order (the same on every rank), not when a background
        # thread starts it (two checkpointers' saves in flight at once keep their tags apart),
        # and before anything this rank may refuse (the ranks' later saves keep matching)
        number = None if self.backend is None else next_save(self.backend)
        try:
            if self._pending is not None and not self._pending.is_done():
                raise AsyncCheckpointError(f"a save to {self.directory} is still in flight; "
                                           "wait() for it before starting another")
            staged = {k: np.array(v, copy=True) for k, v in state_dict.items()}
            extra = json.loads(encode_extra(extra, "save_async") or "null")  # a snapshot, now
        except Exception as exc:
            if number is not None:  # its peers hear of it at once (collective_save.py)
                refuse_in_background(self.backend, number, exc)
            raise
        spec = shard_spec or self.shard_spec
        if checkpoint_id is None and self._generation is not None:
            self._generation += 1
            checkpoint_id = f"g{self._generation}"

        def save() -> str:
            with numbered(number):
                return save_distributed(staged, self.directory, self.rank, self.world_size,
                                        spec, backend=self.backend,
                                        checkpoint_id=checkpoint_id, extra=extra)

        return self._save_in_background(self.directory, save, f"ferro-checkpoint-{self.rank}")

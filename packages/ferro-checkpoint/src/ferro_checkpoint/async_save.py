"""Asynchronous saves: copy the state on the caller's thread, write it in the background."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from . import _along_dim  # noqa: F401 - compiled kernels load with the package
from .errors import AsyncCheckpointError, InvalidArgumentError
from .metadata import ShardMetadata
from .save import check_rank_world, save_distributed


class CheckpointFuture:
    """The pending result of :meth:`AsyncCheckpointer.save_async`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.checkpoint_id: str | None = None

    def is_done(self) -> bool:
        """True once the background write finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed. Idempotent; raises AsyncCheckpointError (the
        cause chained) every time if the save failed."""
        if not self._done.wait(timeout):
            raise AsyncCheckpointError(f"save to {self.directory} not done after {timeout}s")
        if self._error is not None:
            raise AsyncCheckpointError(f"asynchronous save to {self.directory} failed: "
                                       f"{type(self._error).__name__}: {self._error}") \
                from self._error


class AsyncCheckpointer:
    """Saves a rank's shards in a background thread.

    ``save_async`` copies the state dict on the calling thread (so training may modify its
    tensors at once) and returns a :class:`CheckpointFuture`; a second ``save_async`` while one
    is in flight raises :class:`AsyncCheckpointError`. With ``backend=`` the save is collective
    (see :func:`save_distributed`); its messages travel on a private subgroup, so they never mix
    with the training's collectives running meanwhile.
    """

    def __init__(self, directory, rank: int, world_size: int, shard_spec: ShardMetadata, *,
                 backend=None) -> None:
        check_rank_world("AsyncCheckpointer", rank, world_size)
        if shard_spec.num_ranks != world_size:
            raise InvalidArgumentError(f"AsyncCheckpointer: shard_spec.num_ranks "
                                       f"{shard_spec.num_ranks} != world_size {world_size}")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.shard_spec = shard_spec
        self.backend = backend
        self._current: CheckpointFuture | None = None

    @property
    def dir(self) -> Path:
        return self.directory

    @property
    def in_flight(self) -> CheckpointFuture | None:
        """The future of the last save, or None."""
        return self._current

    def wait(self) -> None:
        """Wait for the last save (if any); raises AsyncCheckpointError if it failed."""
        if self._current is not None:
            self._current.wait()

    def save_async(self, state_dict: Mapping[str, np.ndarray], *,
                   shard_spec: ShardMetadata | None = None,
                   checkpoint_id: str | None = None) -> CheckpointFuture:
        if self._current is not None and not self._current.is_done():
            raise AsyncCheckpointError(f"a save to {self.directory} is still in flight; wait() "
                                       "for it before starting another")
        staged = {k: np.array(v, copy=True) for k, v in state_dict.items()}
        spec = shard_spec or self.shard_spec
        future = CheckpointFuture(self.directory)

        def run() -> None:
            try:
                future.checkpoint_id = save_distributed(
                    staged, self.directory, self.rank, self.world_size, spec,
                    backend=self.backend, checkpoint_id=checkpoint_id)
            except BaseException as exc:
                future._error = exc
            finally:
                future._done.set()

        self._current = future
        threading.Thread(target=run, name=f"ferro-checkpoint-{self.rank}", daemon=True).start()
        return future

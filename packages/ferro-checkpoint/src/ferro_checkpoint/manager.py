"""``CheckpointManager``: numbered training steps under one root, each a normal checkpoint.

Files of a root ``R``:

- ``R/step_<n>/``: step ``n``'s checkpoint directory, written by :func:`save_distributed`
  (``layout.py`` lists its files). The step is **committed** exactly when that checkpoint is:
  once ``layout.recover`` has run, when ``step_<n>/metadata.json`` exists. Only committed steps
  are listed by ``steps()`` / ``latest_step()`` and restored.
- ``R/.deleting.step_<n>.<hex>/``: a step being deleted. A step is first renamed out of the
  way (atomic), then removed, so nobody ever sees a half-deleted step; leftovers of a crash
  during a deletion are removed by rank 0's next save. A ``step_<n>`` that is a symbolic link
  to a folder elsewhere (a step put on another disk) is deleted as its link, the checkpoint's
  files in the folder it points to, and that folder once empty; other files there stay.

``extra`` (JSON: RNG state, data position...) is stored in each rank's shard header (key
``ferro.extra``), so the existing protocol commits it with the shard: it is durable before the
commit record, and a step whose extra is missing or partial cannot be committed. Each rank
stores its own ``extra``; ``restore`` returns the one the same rank saved, or rank 0's when the
world size changed (per-rank state cannot be mapped onto another world).

Checkpoint ids: with a backend, a random id per save (collective save). Without one, every
rank's process saves step ``n`` under the id ``step<n>``, so the last rank to write commits.
Either way each shard also carries its own random shard id, recorded in ``metadata.json``, so a
``step<n>`` shard of another run or another root is refused on restore (``save.py``).

Deletion rule (only **rank 0** deletes; the other ranks never delete a directory):

1. after each of its saves, rank 0 lists the committed steps; it deletes committed steps older
   than the newest ``keep_last``, and uncommitted step directories numbered below the newest
   committed step. Both are safe while other ranks keep saving: a step is committed only once
   every rank wrote its shard of it, and every rank saves its steps in increasing order and
   one at a time (a save first waits for the previous asynchronous one), so no rank still
   writes a committed step or one below it. Uncommitted steps above the newest committed one
   may be in progress on another rank and are left alone.
2. Without a backend rank 0's own save may not be the one that commits its step (a later rank
   does), so pruning can lag one save behind: up to ``keep_last + 1`` committed steps exist
   until rank 0's next save. With a backend the save is collective and done on every rank when
   it returns, so rank 0 prunes right after the commit.
3. A new manager finishes every step committed before a crash (``layout.recover``), then
   removes its own rank's temp shards left in any step directory by a crash (files named with
   its rank only, saved by a job of its world size: a manager of another world, one built to
   restore while the job saves, leaves them), so a re-save of a crashed step without a
   backend cannot commit a stale shard of that rank. Construct the managers of all ranks
   before any of them saves (without a backend; with one the id is random and this does not
   matter).
4. With ``world_size == 1`` a save into an uncommitted ``step_<n>/`` first deletes it.

Steps are meant to increase: a save of a step below the newest committed one that would be
lost is refused (InvalidArgumentError: ``keep_last`` committed steps are newer, so rule 1 would
delete it at once; or, without a backend on several ranks, rank 0's pruning would delete its
directory under the other ranks' saves); re-saving a committed step replaces
it atomically (the usual protocol), and steps newer than it stay listed.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .async_save import CheckpointFuture, _RankSaves
from .collective_save import next_save, numbered, refuse_in_background
from .errors import CheckpointIOError, DistCheckpointError, InvalidArgumentError, MissingStepError
from .layout import METADATA, fsync_dir, is_checkpoint_file, recover, remove_stale_tmp_shards
from .load import load_distributed, open_checkpoint
from .metadata import ShardMetadata
from .read_options import ReadOptions
from .safetensors_io import SafetensorsFile
from .save import _checked_arrays, encode_extra, save_distributed

_STEP_RE = re.compile(r"step_(0|[1-9][0-9]*)")
_TOMBSTONE = ".deleting."


def _check_step(op: str, step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InvalidArgumentError(f"{op}: step {step!r} must be an int >= 0")
    return int(step)


def _delete_tombstone(tombstone: Path) -> None:
    """Delete a step renamed out of the way. A step that is a symbolic link (its files on
    another disk) loses its checkpoint's files (``layout.is_checkpoint_file``), then the
    folder the link points to if that leaves it empty, then the link: nothing else outside
    ``root`` is deleted (``shutil.rmtree`` refuses links: the data stayed, and the link for
    ever)."""
    if not tombstone.is_symlink():
        shutil.rmtree(tombstone, ignore_errors=True)
        return
    target = tombstone.resolve()
    try:
        for p in target.iterdir():
            if is_checkpoint_file(p.name) and not p.is_dir():
                p.unlink(missing_ok=True)
        target.rmdir()
    except OSError:
        pass  # (gone already, or it holds other files: they stay)
    try:
        tombstone.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CheckpointIOError(f"deleting the link {tombstone} (to {target}): {exc}") from exc


class CheckpointManager(_RankSaves):
    """Saves numbered steps under ``root`` (``root/step_<n>/``), keeps the newest ``keep_last``
    committed ones, and restores the newest (or a given) step on any world size.

    One manager per rank; see the module docstring for the files, how ``extra`` is committed
    with the step, and which rank deletes what. ``backend`` (a ferro_backend.Backend) makes
    every save collective. Blocking waits (for a previous asynchronous save) are bounded by
    ``wait_timeout_s`` (an attribute, in seconds).

    Parameters
    ----------
    root : str or os.PathLike
        The directory of the steps (created if needed).
    rank, world_size : int
        This rank and the number of ranks.
    keep_last : int, optional
        How many committed steps rank 0 keeps, >= 1 (default: 3).
    backend : ferro_backend.Backend, optional
        Makes every save collective; its rank and world size must be the manager's.

    Raises
    ------
    InvalidArgumentError
        A bad ``rank``, ``world_size`` or ``keep_last``, or a backend of another rank or world.
    CheckpointIOError
        ``root`` cannot be created or listed.

    Examples
    --------
    >>> state = {"w": np.zeros(4, np.float32)}
    >>> manager = CheckpointManager("run", rank=0, world_size=1, keep_last=2)
    >>> manager.save(100, state, flat_shard_metadata(state, 1), extra={"lr": 0.1}).wait()
    >>> tensors, extra = manager.restore()  # step 100: ({"w": ...}, {"lr": 0.1})
    """

    wait_timeout_s: float = 3600.0

    def __init__(self, root, rank: int, world_size: int, *, keep_last: int = 3,
                 backend=None) -> None:
        super().__init__("CheckpointManager", rank, world_size, backend)
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidArgumentError(f"CheckpointManager: keep_last {keep_last!r} must be an "
                                       "int >= 1")
        if backend is not None and (getattr(backend, "rank", rank) != rank or
                                    getattr(backend, "world_size", world_size) != world_size):
            raise InvalidArgumentError(
                f"CheckpointManager: backend is rank {backend.rank} of {backend.world_size}, "
                f"the manager rank {rank} of {world_size}")
        self.root = Path(root)
        self.keep_last = keep_last
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for d in self._step_dirs().values():  # rule 3: this rank's crash leftovers
                recover(d)  # first finish a save committed before the crash: it needs them
                remove_stale_tmp_shards(d, rank, "", self._same_world)
        except FileNotFoundError:
            pass  # a step directory deleted meanwhile by rank 0
        except OSError as exc:
            raise CheckpointIOError(f"CheckpointManager: cannot use {self.root}: {exc}") from exc

    def _same_world(self, tmp_shard: Path) -> bool:
        """Whether a temp shard of this rank was saved by a job of this manager's world size
        (or cannot be read: a crash's): only those are this job's leftovers. A manager of
        another world (one rank restoring while a job of two saves) must leave it alone."""
        try:
            saved = SafetensorsFile(tmp_shard).metadata.get("ferro.world_size")
        except (OSError, DistCheckpointError, ValueError):
            return True
        return saved is None or saved == str(self.world_size)

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.root)!r}, rank={self.rank}, "
                f"world_size={self.world_size}, keep_last={self.keep_last})")

    # -- listing ---------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        """``root/step_<step>``, committed or not.

        Parameters
        ----------
        step : int
            A step number, >= 0.

        Returns
        -------
        pathlib.Path
            The step's checkpoint directory (InvalidArgumentError for a bad ``step``).
        """
        return self.root / f"step_{_check_step('step_dir', step)}"

    def _step_dirs(self) -> dict[int, Path]:
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointIOError(f"listing {self.root}: {exc}") from exc
        return {int(m.group(1)): p for p in entries
                if (m := _STEP_RE.fullmatch(p.name)) and p.is_dir()}

    @staticmethod
    def _committed(directory: Path) -> bool:
        try:
            recover(directory)  # finishes a save that crashed after its commit point
            return (directory / METADATA).is_file()
        except FileNotFoundError:
            return False  # deleted meanwhile
        except NotADirectoryError as exc:  # a file where a step's folder belongs
            raise CheckpointIOError(f"{directory} is a file, not a checkpoint's folder: "
                                    f"{exc}") from exc

    def steps(self) -> list[int]:
        """The committed steps, ascending.

        Returns
        -------
        list of int
            The committed steps (finishing saves committed before a crash first).
        """
        return sorted(s for s, d in self._step_dirs().items() if self._committed(d))

    def latest_step(self) -> int | None:
        """The newest committed step, or None.

        Returns
        -------
        int or None
            The last of :meth:`steps`, None if there is none.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------------------

    def _wait_pending(self) -> None:
        """Wait for the previous asynchronous save; its failure is raised here, once, unless
        its future's ``wait()`` raised it already (the caller saw it: this save goes on)."""
        fut = self._pending
        if fut is None:
            return
        if fut.is_done() and fut._failure_reported:
            self._pending = None
            return
        try:
            fut.wait(self.wait_timeout_s)
        finally:
            if fut.is_done():
                self._pending = None

    def save(self, step: int, state_dict: Mapping[str, np.ndarray], shard_spec: ShardMetadata,
             *, extra: dict | None = None, blocking: bool = True) -> CheckpointFuture:
        """Save this rank's shard of ``step`` into ``root/step_<step>/`` with ``extra``.

        Waits first for the previous asynchronous save of this manager, raising
        AsyncCheckpointError if it failed, unless its future's
        :meth:`~ferro_checkpoint.CheckpointFuture.wait` raised that failure already (reported
        once: this save then goes on). A failure never observed is raised here, and this save
        is not made. ``blocking=False`` copies the tensors and ``extra``
        now and writes in the background; the returned future's ``wait(timeout)`` reports
        the result. Afterwards rank 0 prunes (module docstring).

        Parameters
        ----------
        step : int
            The step number, >= 0.
        state_dict : mapping of str to numpy.ndarray
            This rank's tensors, as for :func:`save_distributed`.
        shard_spec : ShardMetadata
            How every tensor is sharded; ``shard_spec.num_ranks`` must be ``world_size``.
        extra : dict, optional
            JSON-serializable state (RNG, data position...) committed with the step.
        blocking : bool, optional
            False saves in the background (default: True, saved when this returns).

        Returns
        -------
        CheckpointFuture
            The save's future (already done when ``blocking``).

        Raises
        ------
        InvalidArgumentError
            A bad step, spec or extra.
        TensorError, CheckpointIOError
            As :func:`save_distributed`.
        AsyncCheckpointError
            The previous asynchronous save failed, and its future's ``wait()`` did not raise it.
        """
        # numbered first, in the program's order: a save this rank refuses below counts too,
        # so the ranks' later saves keep matching numbers (their messages' tags)
        number = None if self.backend is None else next_save(self.backend)
        try:
            step, arrays, extra_snapshot = self._checked(step, state_dict, shard_spec, extra)
        except Exception as exc:
            if number is not None:  # its peers hear of it at once (collective_save.py)
                refuse_in_background(self.backend, number, exc)
            raise
        directory = self.step_dir(step)
        ckpt_id = None if self.backend is not None else f"step{step}"
        if not blocking:
            staged = {k: np.array(v, copy=True) for k, v in arrays.items()}

            def run() -> str:
                return self._save_and_prune(staged, shard_spec, directory, ckpt_id,
                                            extra_snapshot, number)

            return self._save_in_background(directory, run,
                                            f"ferro-checkpoint-step{step}-{self.rank}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self._save_and_prune(arrays, shard_spec, directory, ckpt_id,
                                             extra_snapshot, number))
        return CheckpointFuture(directory, done)

    def _checked(self, step, state_dict, shard_spec: ShardMetadata, extra
                 ) -> tuple[int, dict[str, np.ndarray], str | None]:
        """:meth:`save`'s checks, and its wait for the previous save: the step, the arrays and
        ``extra`` as JSON."""
        step = _check_step("CheckpointManager.save", step)
        if shard_spec.num_ranks != self.world_size:
            raise InvalidArgumentError(f"CheckpointManager.save: shard_spec.num_ranks "
                                       f"{shard_spec.num_ranks} != world_size {self.world_size}")
        arrays = _checked_arrays(state_dict, self.rank, shard_spec)
        extra_snapshot = encode_extra(extra, "CheckpointManager.save")
        self._wait_pending()
        newer = [s for s in self.steps() if s > step]
        if len(newer) >= self.keep_last or (newer and self.backend is None
                                            and self.world_size > 1):
            # rule 1 would delete it at once, or (without a backend, several ranks) rank 0
            # would delete its directory, below the newest committed step, under the others
            why = (f"keep_last={self.keep_last} keeps newer steps only" if
                   len(newer) >= self.keep_last else "without a backend rank 0's pruning "
                   "deletes an uncommitted step below the newest while the others write it")
            raise InvalidArgumentError(
                f"CheckpointManager.save: step {step} is below the newest committed step "
                f"{newer[-1]} under {self.root}, and would be lost ({why}); to go back to "
                f"step {step}, delete the step_<n> directories above it first")
        return step, arrays, extra_snapshot

    def _save_and_prune(self, arrays, shard_spec, directory: Path, ckpt_id: str | None,
                        extra_json: str | None, number: int | None) -> str:
        if self.world_size == 1 and directory.exists() and not self._committed(directory):
            self._remove(directory)  # rule 4: a crashed save's leftovers, no other writer
        extra = None if extra_json is None else json.loads(extra_json)
        with numbered(number):
            saved = save_distributed(arrays, directory, self.rank, self.world_size, shard_spec,
                                     backend=self.backend, checkpoint_id=ckpt_id, extra=extra)
        if self.rank == 0:
            self._prune()
        return saved

    def _remove(self, directory: Path) -> None:
        """Rename ``directory`` out of the way (atomic), then delete it."""
        tombstone = self.root / f"{_TOMBSTONE}{directory.name}.{uuid.uuid4().hex}"
        try:
            os.rename(directory, tombstone)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CheckpointIOError(f"deleting {directory}: {exc}") from exc
        fsync_dir(self.root)
        _delete_tombstone(tombstone)

    def _prune(self) -> None:
        """Rank 0 only: the deletion rule of the module docstring."""
        for p in self.root.iterdir():
            if p.name.startswith(_TOMBSTONE) and (p.is_symlink() or p.is_dir()):
                _delete_tombstone(p)
        dirs = self._step_dirs()
        committed = sorted(s for s, d in dirs.items() if self._committed(d))
        if not committed:
            return
        for s, d in dirs.items():
            if s < committed[-1] and s not in committed:
                self._remove(d)
        for s in committed[:-self.keep_last]:
            self._remove(dirs[s])

    # -- restoring -------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, verify: bool | str | None = None,
                mmap: bool = False, out: Mapping[str, np.ndarray] | None = None,
                threads: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """This rank's tensors of ``step`` (the newest committed one if None), resharded when
        the world size changed, and its ``extra`` (``{}`` if none was saved).

        Waits for this manager's pending asynchronous save first.

        Parameters
        ----------
        step : int, optional
            The step to restore (default: None, the newest committed one).
        verify, mmap, out, threads
            As :func:`load_distributed`: checksums of every byte read (default; False skips
            them, ``"lazy"`` with ``mmap`` checks each tensor on first lookup), zero-copy
            read-only arrays backed by the files, arrays to load into, kernel threads.

        Returns
        -------
        tensors : dict of str to numpy.ndarray
            This rank's shard of every tensor (a read-only mapping with ``verify="lazy"``).
        extra : dict
            The ``extra`` saved with the step (``{}`` if none).

        Raises
        ------
        MissingStepError
            The step is not committed, or no step is.
        InvalidArgumentError, AsyncCheckpointError
            A bad ``step`` or keyword; the pending asynchronous save failed (and its future's
            ``wait()`` did not raise it).
        ShardMismatchError, ChecksumMismatchError, MetadataError, SerializationError
            And the other errors of :func:`load_distributed`.
        """
        ReadOptions.of("CheckpointManager.restore", verify, mmap, out, threads)
        self._wait_pending()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise MissingStepError(f"no committed step in {self.root}")
        else:
            step = _check_step("CheckpointManager.restore", step)
        directory = self.step_dir(step)
        if not directory.is_dir() or not self._committed(directory):
            raise MissingStepError(f"step {step} is not a committed step in {self.root} "
                                   f"(committed: {self.steps()})")
        ckpt = open_checkpoint(directory)
        tensors = load_distributed(directory, self.rank, self.world_size, checkpoint=ckpt,
                                   verify=verify, mmap=mmap, out=out, threads=threads)
        source = self.rank if ckpt.num_ranks == self.world_size else 0
        return tensors, ckpt.extra(source) or {}

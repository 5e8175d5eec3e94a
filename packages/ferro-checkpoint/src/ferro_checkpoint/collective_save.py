"""The messages of a collective save (``save_distributed(..., backend=)``).

Each save is numbered (:func:`next_save`, in the program's order, the same on every rank) and
its three messages travel on that number's tags over one private subgroup of all ranks per
backend (:func:`checkpoint_group`):

1. rank 0 draws a random id and sends it to every rank (:func:`agree_on_id`);
2. every rank sends rank 0 its status: its shard written, or its refusal (a shard of the wrong
   shape or dtype, a bad ``extra``, a write that failed), with the error's class and message;
3. rank 0 commits if every rank wrote its shard, and sends every rank its verdict
   (:func:`commit_for_all`): the commit's error, or the first refusing rank's.

A rank that refuses its save still takes part in steps 1 and 2, so every rank raises at once
(the refusing rank its own error, the others one of the same class naming that rank and its
error), no message of the save is left unread, and the next save works.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator

from . import errors
from .errors import DistCheckpointError

_TAGS = (1 << 30) + 7  # user-range tags (on a private subgroup): three a save, by its number
_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> saves begun
_SAVES_BY_ID: dict[int, int] = {}
_VERDICT_BYTES = 1024  # a status's or verdict's size: a flag byte, the error's class and message
_WRITTEN, _REFUSED = 1, 2
_GROUP_ATTR = "_ferro_checkpoint_group"
_GROUPS_BY_ID: dict[int, object] = {}  # (backends that take no attribute)
_GROUPS_LOCK = threading.Lock()


def next_save(backend) -> int:
    """The number of this collective save on ``backend`` (every rank begins its saves in one
    order): its messages' tags, so that one save's messages never meet another's (a failed
    save's unread id, or two checkpointers' saves in flight at once)."""
    try:
        k = _SAVES.get(backend, 0)
        _SAVES[backend] = k + 1
    except TypeError:  # a backend that takes no weak reference (an outside transport's)
        k = _SAVES_BY_ID.get(id(backend), 0)
        _SAVES_BY_ID[id(backend)] = k + 1
    return k


#: the number a checkpointer or manager took for the save its thread runs (:func:`numbered`)
_NUMBER: contextvars.ContextVar[int | None] = contextvars.ContextVar("ferro_checkpoint_save",
                                                                      default=None)


@contextlib.contextmanager
def numbered(number: int | None) -> Iterator[None]:
    """Within the block, a collective ``save_distributed`` takes ``number`` (taken by
    :func:`next_save` in the program's order when the save was asked for, not when a
    background thread runs it) instead of the next one."""
    token = _NUMBER.set(number)
    try:
        yield
    finally:
        _NUMBER.reset(token)


def save_number(backend) -> int:
    """The number of the save this thread begins on ``backend``: its caller's (:func:`numbered`)
    or the next one."""
    number = _NUMBER.get()
    return next_save(backend) if number is None else number


def _tag(save: int, what: int) -> int:
    """The tag of a save's id (0), its ranks' statuses (1) and rank 0's verdict (2)."""
    return _TAGS + 3 * (save % (1 << 20)) + what


def checkpoint_group(backend):
    """The private subgroup of all ranks the saves' messages travel on: one per backend, made
    at its first save (a SubBackend registers a callback with its root transport that nothing
    removes, so one made per save grew the transport's list with every save). It is kept on the
    backend itself (a reference cycle the garbage collector frees with it), or, for a backend
    that takes no attribute, by its id."""
    from ferro_backend import SubBackend

    with _GROUPS_LOCK:
        group = getattr(backend, _GROUP_ATTR, None) or _GROUPS_BY_ID.get(id(backend))
        if group is None or group.parent is not backend:
            group = SubBackend(backend, range(backend.world_size), name="ferro-checkpoint")
            try:
                setattr(backend, _GROUP_ATTR, group)
            except (AttributeError, TypeError):
                _GROUPS_BY_ID[id(backend)] = group
        group.timeout = backend.timeout  # (one set on the backend since applies too)
        return group


def agree_on_id(group, save: int) -> str:
    """Rank 0 draws a random id and sends it to every rank."""
    buf = bytearray(32)
    if group.rank == 0:
        buf[:] = uuid.uuid4().hex.encode()
        for r in range(1, group.world_size):
            group.send(buf, r, tag=_tag(save, 0))
    else:
        group.recv(buf, 0, tag=_tag(save, 0))
    return buf.decode()


def _said(flag: int, kind: str, message: str) -> bytearray:
    out = bytearray(_VERDICT_BYTES)
    said = f"{kind}:{message}".encode(errors="replace")[:_VERDICT_BYTES - 1]
    out[:len(said) + 1] = bytes([flag]) + said
    return out


def _kind(exc: BaseException) -> tuple[str, str]:
    """The ferro-checkpoint class an error travels as, and its message."""
    if isinstance(exc, DistCheckpointError) and getattr(errors, type(exc).__name__, None) \
            is type(exc):
        return type(exc).__name__, str(exc)
    return DistCheckpointError.__name__, f"{type(exc).__name__}: {exc}"


def _heard(buf: bytearray) -> tuple[str, str]:
    kind, _, message = bytes(buf[1:]).rstrip(b"\x00").decode(errors="replace").partition(":")
    return kind, message


def _error(kind: str, message: str) -> DistCheckpointError:
    cls = getattr(errors, kind, DistCheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, DistCheckpointError)):
        cls = DistCheckpointError
    return cls(message)


def commit_for_all(group, commit: Callable[[], None], save: int,
                   failure: Exception | None = None) -> None:
    """Every rank tells rank 0 of ``group`` that its shard is written, or that it refused its
    save (``failure``); rank 0 calls ``commit`` when every rank wrote its shard, and sends every
    rank its verdict (the save's barrier, on the save's own tags): a refusal, or a commit refused
    or failed, raises on every rank at once, not on one rank while the others wait for a
    deadline. A rank raises its own ``failure``; the others an error of its class naming it."""
    verdict = bytearray(_VERDICT_BYTES)
    if group.rank != 0:
        status = (_said(_REFUSED, *_kind(failure)) if failure is not None
                  else bytearray([_WRITTEN]) + bytearray(_VERDICT_BYTES - 1))
        group.send(status, 0, tag=_tag(save, 1))
        group.recv(verdict, 0, tag=_tag(save, 2))
        if failure is not None:
            raise failure
        if verdict[0]:
            kind, message = _heard(verdict)
            raise _error(kind, message)
        return
    refused = []
    for r in range(1, group.world_size):
        status = bytearray(_VERDICT_BYTES)
        group.recv(status, r, tag=_tag(save, 1))
        if status[0] == _REFUSED:
            refused.append((r, *_heard(status)))
    error = None
    if failure is not None:
        kind, message = _kind(failure)
        verdict = _said(1, kind, f"rank 0 refused its save: {message}; nothing is committed "
                                 "(rank 0's verdict)")
    elif refused:
        r, kind, message = refused[0]
        also = f" (ranks {[x[0] for x in refused[1:]]} refused it too)" if refused[1:] else ""
        error = _error(kind, f"rank {r} refused its save: {message}{also}; nothing is "
                             "committed")
        verdict = _said(1, kind, f"{error} (rank 0's verdict)")
    else:
        try:
            commit()
        except Exception as exc:  # (every rank must hear of it, whatever it is)
            failure = exc
            kind, message = _kind(exc)
            verdict = _said(1, kind, f"{message} (rank 0's commit)")
    for r in range(1, group.world_size):
        group.send(verdict, r, tag=_tag(save, 2))
    if failure is not None:
        raise failure
    if error is not None:
        raise error


def refuse_in_background(backend, save: int, failure: Exception) -> None:
    """Take part in collective save number ``save``, refused on this rank before it began (a
    checkpointer's or manager's check on the caller's thread), on a daemon thread: its peers
    hear of ``failure`` at once (not at their deadline), while the caller raises it now."""
    def run() -> None:
        try:
            group = checkpoint_group(backend)
            agree_on_id(group, save)
            commit_for_all(group, lambda: None, save, failure)
        except BaseException:  # (the caller raised the failure; a peer gone is its own error)
            pass

    threading.Thread(target=run, name=f"ferro-checkpoint-refusal-{save}", daemon=True).start()

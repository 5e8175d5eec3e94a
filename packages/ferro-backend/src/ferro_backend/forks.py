"""Backends in a forked child: closed there, for the child only.

A child made by ``os.fork()`` inherits the parent's backends (their sockets, the engine's
shared memory, the order of calls) but none of the threads that serve them. Used there, a
backend would write into the parent's connections and take the parent's turns, breaking the
parent's job. So, right after a fork, every live backend's state in the child is marked
(``os.register_at_fork``): its mailbox reads as closed, with
:class:`~ferro_backend.errors.ForkedBackendError` (naming both processes) as the error every
operation raises; the engine's communicator is closed in the child only (nothing written to
the shared segment, nobody woken). ``close()`` in the child then drops the child's copies and
tells no peer. The hot paths pay nothing: they already check the closed flag.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .errors import ForkedBackendError

#: every tracked object -> (the process that made it, how to mark it in a forked child)
_live: weakref.WeakKeyDictionary[Any, tuple[int, Callable[[Any, int, int], None]]] = \
    weakref.WeakKeyDictionary()


def forked_error(op: str, made_pid: int, pid: int, rank: int | None = None) -> ForkedBackendError:
    """The error an ``op`` on a backend made in process ``made_pid`` raises in its fork ``pid``.

    Parameters
    ----------
    op : str
        The operation, for the message (e.g. ``"send"``).
    made_pid, pid : int
        The process that made the backend, and the forked one that used it.
    rank : int, optional
        The backend's rank.

    Returns
    -------
    ForkedBackendError
        The error (not raised here).
    """
    who = "" if rank is None else f" (rank {rank})"
    return ForkedBackendError(
        f"{op}: this backend{who} was made in process {made_pid}; process {pid} is a fork of "
        f"it: make a backend in the child (the parent's job goes on; close() here drops this "
        f"process's copies only)", made_pid=made_pid, pid=pid, rank=rank)


def track(obj: Any, mark: Callable[[Any, int, int], None]) -> None:
    """Call ``mark(obj, made_pid, pid)`` in every forked child while ``obj`` lives.

    Parameters
    ----------
    obj : object
        What to mark (weakly referenced).
    mark : callable
        Called in the child, right after the fork, with the process that made ``obj`` and the
        child's pid (one thread runs: it must not wait on a lock the parent's threads held).
    """
    _live[obj] = (os.getpid(), mark)


def mark_mailbox(box: Any, made_pid: int, pid: int) -> None:
    """A forked child's copy of a :class:`~ferro_backend.mailbox.Mailbox`: closed, with the fork
    as its error; its condition made anew (a thread of the parent may have held it).

    Parameters
    ----------
    box : Mailbox
        The child's copy.
    made_pid, pid : int
        The process that made it, and the child.
    """
    box.cond = threading.Condition(threading.Lock())
    box.forked = (made_pid, pid)
    box.closed = True


def _after_fork_in_child() -> None:
    pid = os.getpid()
    for obj, (made, mark) in list(_live.items()):
        try:
            mark(obj, made, pid)
        except Exception:  # (one object that cannot be marked must not stop the others)
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["forked_error", "mark_mailbox", "track"]

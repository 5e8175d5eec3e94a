"""Subgroups: a ``Backend`` view of some ranks of a parent backend.

Local rank ``i`` is the ``i``-th smallest member (or the ``i``-th member given, with
``ordered=True``). Every message of a subgroup travels on the root transport with the subgroup's
id in the upper 32 bits of the tag, so it can never be taken for a message of the parent or of
another subgroup between the same pair of ranks. The id is a hash of the members' global ranks
(in local-rank order), the optional ``name``, for a subgroup of a subgroup the parent's id, and
how many subgroups of the same members and name this rank made of the same parent before it:
the same on every member, as every member makes its subgroups in the same order.
"""

from __future__ import annotations

import numbers
import re
import threading
import weakref
import zlib
from collections.abc import Iterable
from typing import Any

from .base import GROUP_TAG_SHIFT, Backend, FixedRanks, Request
from .checks import check_rank, check_tag
from .errors import InvalidRankError, InvalidWorldSizeError, PeerClosedError

#: per parent backend: how many subgroups of each (global members, name) this rank made of it
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: the same, for a parent that takes no weak reference (by its id)
_MADE_BY_ID: dict[int, dict[tuple, int]] = {}
_MADE_LOCK = threading.Lock()


def _ordinal(parent: Backend, key: tuple) -> int:
    """How many subgroups of ``key`` (global members, name) this rank made of ``parent``
    before now, counting this one."""
    with _MADE_LOCK:
        try:
            made = _MADE.setdefault(parent, {})
        except TypeError:  # no weak reference, or unhashable: by its id
            made = _MADE_BY_ID.setdefault(id(parent), {})
        k = made.get(key, 0)
        made[key] = k + 1
        return k


class SubBackend(FixedRanks, Backend):
    """A subgroup of ``parent``'s ranks; ``parent`` may itself be a :class:`SubBackend`.

    Every member constructs it with the same ``members`` and ``name``; a non-member cannot
    (InvalidRankError; it counts for nothing below).

    **Every member makes its subgroups of a parent in the same order** (torch's rule for
    ``new_group``). Each construction is a new group, apart from every other: a second
    ``SubBackend(parent, members)`` of the same members and name is a second group, whose
    messages and calls never pair with the first's (its id counts how many subgroups of the
    same members and name this rank made of ``parent`` before it), and one made after a
    subgroup was aborted (:meth:`abort_group`, a collective's timeout) is a fresh group that
    works. A member that makes a subgroup its peers do not make (or makes one twice where
    they make it once) is out of step with them for every later subgroup of the same members
    and name: their calls on it wait for their deadline. Share one view rather than making
    another (a view may be used by any code of its rank).

    Parameters
    ----------
    parent : Backend
        The backend whose ranks the subgroup takes (it keeps owning the transport).
    members : iterable of int
        The parent ranks of the subgroup (duplicates ignored); local rank ``i`` is the
        ``i``-th smallest. Must include ``parent.rank``.
    name : str, default ""
        Tells apart subgroups of the same members (it enters the subgroup's tag id, as does the
        parent's id when ``parent`` is a subgroup: subgroups of differently named parents never
        share tags). Subgroups of different names are counted apart: code that makes its own
        groups under a name of its own keeps its count whatever other groups of the same
        members are made.
    ordered : bool, default False
        Keep ``members`` in the order given (duplicates after the first ignored): local rank
        ``i`` is the ``i``-th member listed, not the ``i``-th smallest. Every member must list
        them in the same order.

    Raises
    ------
    InvalidWorldSizeError
        ``members`` is empty.
    InvalidRankError
        A member out of the parent's range, or this rank is not a member.

    Examples
    --------
    >>> evens = SubBackend(backend, range(0, backend.world_size, 2))  # on the even ranks
    >>> evens.barrier()
    """

    def __init__(self, parent: Backend, members: Iterable[int], *, name: str = "",
                 ordered: bool = False) -> None:
        members = list(members)
        if not members:
            raise InvalidWorldSizeError("SubBackend: members is empty, expected at least one rank")
        pw = parent.world_size
        for m in members:
            if isinstance(m, bool) or not isinstance(m, numbers.Integral):
                raise InvalidRankError(f"SubBackend: member {m!r} is not an int")
            if not 0 <= m < pw:
                raise InvalidRankError(
                    f"SubBackend: member {m!r} is out of range for the parent's world_size {pw}"
                )
        # (numpy integers taken)
        self._members = (tuple(dict.fromkeys(int(m) for m in members)) if ordered
                         else tuple(sorted({int(m) for m in members})))
        self._closed = False
        self._world = len(self._members)
        self._parent = parent
        try:
            self._rank = self._members.index(parent.rank)
        except ValueError:
            raise InvalidRankError(
                f"SubBackend: parent rank {parent.rank} is not among the members {self._members}"
            ) from None
        # Route straight to the root transport with global ranks.
        if isinstance(parent, SubBackend):
            self._root = parent._root
            self._global = tuple(parent._global[m] for m in self._members)
        else:
            self._root = parent
            self._global = self._members
        # a subgroup of a subgroup folds in its parent's id: the same members under differently
        # named parents (or directly under the root) must not share a tag space
        # and how many of the same members and name this rank made of this parent before
        # (every member makes them in the same order): two views are two groups
        k = _ordinal(parent, (self._global, name))
        key = (self._global, name) if parent is self._root else \
            (self._global, name, parent._group_id)
        key = repr(key + (k,) if k else key).encode()
        self._group_id = (zlib.crc32(key) & 0x7FFFFFFF) | 0x80000000
        self._tag_base = self._group_id << GROUP_TAG_SHIFT
        self.timeout = parent.timeout
        #: a member gave up on this subgroup (:meth:`abort_group`): later calls raise its error
        self._given_up = False
        watch = getattr(self._root, "on_subgroup_abort", None)
        if watch is not None:
            mine = weakref.ref(self)

            def given_up() -> None:
                view = mine()
                if view is not None:
                    view._on_given_up()

            watch(self._group_id, given_up)

    # -- the subgroup's identity ------------------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        """The parent ranks of this subgroup, ascending (as given with ``ordered=True``); the
        index is the local rank."""
        return self._members

    @property
    def parent(self) -> Backend:
        """The backend this subgroup was made from (itself possibly a subgroup); its ranks are
        the ones :attr:`members` lists.
        """
        return self._parent

    @property
    def group_id(self) -> int:
        """The subgroup's 32-bit tag prefix, the same on every member: derived from the members'
        global ranks, the ``name``, (for a subgroup of a subgroup) the parent's id and how many
        subgroups of the same members and name this rank made of the parent before this one,
        it keeps this subgroup's messages apart from the parent's and from other subgroups'.
        """
        return self._group_id

    @property
    def root(self) -> Backend:
        """The transport this subgroup's messages travel on (the first non-subgroup parent)."""
        return self._root

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The ranks of :attr:`root` of the members, by local rank."""
        return self._global

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        """The root transport's failure for local rank ``peer``'s rank (see
        :meth:`Backend.peer_failure`).

        Parameters
        ----------
        op : str
            The operation that asks (named in the error).
        peer : int
            A local rank.

        Returns
        -------
        BaseException or None
        """
        if self._closed:
            if self._given_up:
                failure = self._root.subgroup_failure(op, self._group_id)
                if failure is not None:
                    return failure
            return PeerClosedError(f"{op}: rank {self._rank}'s subgroup backend is closed",
                                   peer=self._rank)
        return self._root.peer_failure(op, self._global[peer])

    def to_global(self, local: int) -> int:
        """The parent rank of local rank ``local`` (InvalidRankError if out of range).

        Parameters
        ----------
        local : int

        Returns
        -------
        int

        Raises
        ------
        InvalidRankError
            ``local`` is not in ``[0, world_size)``.
        """
        check_rank(local, len(self._members), "SubBackend.to_global: local rank")
        return self._members[local]

    def to_local(self, global_rank: int) -> int | None:
        """The local rank of parent rank ``global_rank``, or None if it is not a member.

        Parameters
        ----------
        global_rank : int

        Returns
        -------
        int or None
        """
        try:
            return self._members.index(global_rank)
        except ValueError:
            return None

    # -- messaging ----------------------------------------------------------------------
    def _route(self, op: str, peer: int, tag: int) -> tuple[int, int]:
        check_rank(peer, len(self._members), f"SubBackend.{op}: peer")
        check_tag(tag, (1 << GROUP_TAG_SHIFT) - 1)
        if self._closed:
            raise self.peer_failure(op, peer)
        return self._global[peer], self._tag_base | tag

    def _local_of_root(self, root_rank: int) -> int | None:
        """The local rank of the root transport's rank ``root_rank`` (a receive's sender), or
        None if it is not a member."""
        try:
            return self._global.index(root_rank)
        except ValueError:
            return None

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        g, t = self._route("send", dst, tag)
        self._root.send(data, g, tag=t)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        g, t = self._route("recv", src, tag)
        self._root.recv(out, g, tag=t, timeout=self.resolve_timeout(timeout, "recv: timeout"))

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        g, t = self._route("irecv", src, tag)
        return _LocalSource(self._root.irecv(out, g, tag=t), self._local_of_root)

    def irecv_any(self, out: Any, *, tag: int = 0) -> Request:
        """From any member: the subgroup's tags are its own, so only members' messages match.

        Parameters
        ----------
        out : writable buffer
        tag : int, default 0

        Returns
        -------
        Request
            Once complete, its ``source`` is the sender's local rank.
        """
        check_tag(tag, (1 << GROUP_TAG_SHIFT) - 1)
        if self._closed:
            raise self.peer_failure("irecv_any", 0)
        return _LocalSource(self._root.irecv_any(out, tag=self._tag_base | tag),
                            self._local_of_root)

    def isend(self, data: Any, dst: int, *, tag: int = 0) -> Request:
        g, t = self._route("isend", dst, tag)
        return self._root.isend(data, g, tag=t)

    def publish_before_close(self, thread: threading.Thread) -> None:
        """Register ``thread`` on this view and on the transport under it: closing either
        waits for it a short while (:meth:`Backend.publish_before_close`).

        Parameters
        ----------
        thread : threading.Thread
            A started thread that sends on this view and ends by itself.
        """
        super().publish_before_close(thread)
        self._root.publish_before_close(thread)

    def abort(self, reason: str) -> None:
        """Aborts the whole job: a failing rank fails every group it is in.

        Parameters
        ----------
        reason : str
            Why (peers' :class:`PeerAbortedError` carries it).
        """
        if not self._closed:  # (a closed backend publishes nothing)
            self._root.abort(reason)

    def abort_group(self, reason: str) -> None:
        """This rank gives up on the subgroup alone: every member's calls on it, those waiting
        and every later one, raise PeerAbortedError naming this rank and ``reason``, and this
        view is closed; the parent and the other subgroups go on (as torch's groups end one at
        a time). A collective that times out on a subgroup calls it: a late member that calls
        once the notice has reached it never completes the call with this rank's abandoned
        data (the notice follows the data this rank sent before it gave up, so a member calling
        in between may still complete with it). On a root transport that cannot tell the
        members (an outside one) it closes this view only.

        The error names the aborting member by its global rank (the root transport's); a
        ``reason`` naming ranks names the subgroup's (a collective's on it does), so where the
        two numberings differ the reason says which global rank each of the subgroup's is.

        Parameters
        ----------
        reason : str
            Why (the members' PeerAbortedError carries it).
        """
        if self._closed:
            return
        self.finish_publishing()  # (a refused call's reason goes out before the notice)
        if self._global != tuple(range(self._world)) and re.search(r"\brank", reason):
            shown = ", ".join(map(str, self._global[:32])) + (", ..." if self._world > 32 else "")
            reason = (f"{reason} (ranks of this subgroup, whose ranks 0 to {self._world - 1} are "
                      f"global ranks [{shown}])")
        tell = getattr(self._root, "abort_subgroup", None)
        if tell is not None:
            tell(self._group_id, self._global, reason)
        self.close()

    def _on_given_up(self) -> None:
        """A member gave up on the subgroup (this rank too, maybe): every later call raises its
        error, and the view's engine (if any) ends the calls waiting on it."""
        self._given_up = True
        self._closed = True
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.mark_failed(str(self._root.subgroup_failure("engine", self._group_id)))

    def close(self) -> None:
        """Every call on this view, those of this rank's threads waiting in one and every
        later one, raises PeerClosedError on this rank; it releases nothing else (the parent
        owns the transport, which stays open) but the view's own engine, if one was attached
        (``attach_engine(view)``: its calls end too)."""
        if not self._closed:
            self.finish_publishing()  # (a refused call's reason goes out first)
        was_closed, self._closed = self._closed, True
        closing = getattr(self._root, "close_subgroup", None)
        if closing is not None and not was_closed:
            closing(self._group_id)  # (a receive posted on it waited for its deadline)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __repr__(self) -> str:
        return (f"<SubBackend rank={self.rank} world_size={self.world_size} "
                f"members={self._members}>")


class _LocalSource(Request):
    """A parent's receive from any rank, its ``source`` told as the subgroup's rank."""

    __slots__ = ("_req", "_to_local")

    def __init__(self, req: Request, to_local) -> None:
        self._req, self._to_local = req, to_local

    @property
    def source(self) -> int | None:
        g = self._req.source
        return None if g is None else self._to_local(g)

    def cancel(self, error: BaseException) -> bool:
        return self._req.cancel(error)

    def wait(self, timeout: float | None = None) -> None:
        self._req.wait(timeout)

    def is_completed(self) -> bool:
        return self._req.is_completed()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._req.poll(timeout)

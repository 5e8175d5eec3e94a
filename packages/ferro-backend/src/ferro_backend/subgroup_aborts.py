"""A transport's side of subgroups ending (:meth:`ferro_backend.SubBackend.abort_group` and
:meth:`ferro_backend.SubBackend.close`), for a transport whose receives all go through its
:class:`~ferro_backend.mailbox.Mailbox`."""

from __future__ import annotations

from collections.abc import Callable

from .base import GROUP_ABORT_TAG, GROUP_TAG_SHIFT


class SubgroupAborts:
    """A transport's side of :meth:`ferro_backend.SubBackend.abort_group`, for a transport
    whose receives all go through its :class:`Mailbox` (``self._box``): a subgroup's abort
    notice travels to its members as a message on the subgroup's
    :data:`~ferro_backend.base.GROUP_ABORT_TAG`,
    which each member's mailbox takes for what it is (:meth:`Mailbox.deliver`)."""

    def abort_subgroup(self, group: int, members, reason: str) -> None:
        """Tell ``members`` that this rank gave up on a subgroup, and record it here too
        (what :meth:`ferro_backend.SubBackend.abort_group` calls).

        Parameters
        ----------
        group : int
            The subgroup's id (:attr:`ferro_backend.SubBackend.group_id`).
        members : iterable of int
            Its ranks on this transport.
        reason : str
            Why (the members' PeerAbortedError carries it).
        """
        notice = reason.encode("utf-8", "replace")[:60000]
        tag = (group << GROUP_TAG_SHIFT) | GROUP_ABORT_TAG
        for r in members:
            if r != self.rank:
                try:
                    self._send_notice(notice, r, tag)
                except Exception:  # (a member gone or a transport closed: none to tell)
                    pass
        self._box.abort_group(group, self.rank, reason)

    def _send_notice(self, notice: bytes, dst: int, tag: int) -> None:
        """Send an abort notice (a transport whose other routes deliver only when a receive
        drains them sends it where its receive loop reads unasked: the TCP mesh)."""
        self.isend(notice, dst, tag=tag)

    def subgroup_failure(self, op: str, group: int) -> BaseException | None:
        """The error an operation on a subgroup must raise, if a member gave up on it.

        Parameters
        ----------
        op : str
            The operation (named in the error).
        group : int
            The subgroup's id.

        Returns
        -------
        BaseException or None
            PeerAbortedError naming the member and its reason, or None.
        """
        return self._box.group_failure(op, group)

    def close_subgroup(self, group: int) -> None:
        """This rank closed its view of a subgroup: its receives waiting on the subgroup's
        tags raise PeerClosedError now (what :meth:`ferro_backend.SubBackend.close` calls).

        Parameters
        ----------
        group : int
            The subgroup's id.
        """
        self._box.close_group(group)

    def on_subgroup_abort(self, group: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once a member gives up on a subgroup (at once if one has).

        Parameters
        ----------
        group : int
            The subgroup's id.
        callback : callable
            Called with no arguments, from the thread that takes the notice.
        """
        self._box.add_group_abort_callback(group, callback)


__all__ = ["SubgroupAborts"]

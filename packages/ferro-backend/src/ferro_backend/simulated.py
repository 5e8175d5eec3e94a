"""An in-process backend: every rank is an object of one group, ranks usually run as threads.

Thread-safe, FIFO per ``(src, dst, tag)``. A send copies its bytes once: straight into the
destination's posted receive buffer when there is one, else into a queue. Sends never block.
"""

from __future__ import annotations

import time
from typing import Any

from .base import DEFAULT_TIMEOUT, Backend, FixedRanks, Request
from .checks import as_recv_view, check_tag, check_timeout, check_world_size
from .errors import CollectiveTimeoutError, PeerClosedError
from .mailbox import Mailbox
from .netsim import Network, TimedRequest, VirtualTime
from .subgroup_aborts import SubgroupAborts


class SimulatedBackend(FixedRanks, SubgroupAborts, Backend):
    """One rank of an in-process group made by :meth:`~ferro_backend.SimulatedBackend.create_group`.

    Build groups with :meth:`create_group`; the constructor is its building block.

    Parameters
    ----------
    mailboxes : list of ferro_backend.mailbox.Mailbox
        Every rank's receive side, index = rank (the group's size is their number).
    rank : int
        This rank's index in ``mailboxes``.
    timeout : float
        :attr:`Backend.timeout`, in seconds.
    vt : ferro_backend.netsim.VirtualTime, optional
        The group's virtual clocks when it runs on a modelled network.
    """

    def __init__(self, mailboxes: list[Mailbox], rank: int, timeout: float,
                 vt: VirtualTime | None = None) -> None:
        self.nodes = ("this process",) * len(mailboxes)
        self._vt = vt
        self._boxes = mailboxes
        self._rank = rank
        self._world = len(mailboxes)
        self.timeout = timeout
        self._box = mailboxes[rank]
        self._sends = 0
        self._fault: tuple[int, str, float] | None = None  # (from send number, kind, delay)

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                     network: Network | None = None,
                     hierarchical: bool = False) -> list[SimulatedBackend]:
        """Create ``world_size`` connected backends; index ``i`` is rank ``i``.

        Parameters
        ----------
        world_size : int
            The number of ranks (at least 1).
        timeout : float, default 60.0
            Every rank's :attr:`Backend.timeout`: the default deadline of its receives,
            barriers and collectives.
        network : ferro_backend.netsim.Network, optional
            A :class:`~ferro_backend.netsim.Network` whose links every message is charged to in
            virtual time (``backend.clock``).
        hierarchical : bool, default False
            Give every rank a simulated :class:`~ferro_backend.hierarchy.Hierarchy` from
            ``network``'s node layout (``backend.hierarchy``; needs ``network``, at least 2
            ranks per node and 2 nodes), so ferro-collective's hierarchical collectives run on
            it (their node stages over the intra-node links, in virtual time).

        Returns
        -------
        list of SimulatedBackend
            The group's ranks, index ``i`` being rank ``i``; run each in a thread.

        Raises
        ------
        InvalidWorldSizeError
            ``world_size < 1``.
        ValueError
            A timeout that is negative, NaN or not a number, or ``hierarchical`` without a
            network of several nodes.

        Examples
        --------
        >>> import numpy as np
        >>> from ferro_backend import SimulatedBackend
        >>> a, b = SimulatedBackend.create_group(2, timeout=5.0)
        >>> a.send(np.arange(3.0), dst=1)
        >>> out = np.empty(3)
        >>> b.recv(out, src=0)
        >>> out.tolist()
        [0.0, 1.0, 2.0]
        """
        check_world_size(world_size)
        timeout = check_timeout(timeout, "SimulatedBackend.create_group: timeout")
        ranks: list[SimulatedBackend] = []
        boxes = [Mailbox(r, lambda r=r: ranks[r].timeout, world_size) for r in range(world_size)]
        vt = VirtualTime(network, world_size) if network is not None else None
        ranks.extend(cls(boxes, r, timeout, vt) for r in range(world_size))
        if network is not None:
            for b in ranks:
                b.nodes = tuple(f"node {network.node(r)}" for r in range(world_size))
        if hierarchical:
            from .hierarchy import attach_simulated_hierarchy

            if network is None:
                raise ValueError("SimulatedBackend.create_group: hierarchical=True needs a "
                                 "network (its ranks_per_node is the node layout)")
            for b in ranks:
                attach_simulated_hierarchy(b)
        return ranks

    @property
    def network(self) -> Network | None:
        """The modelled network of a group made with ``network=``, else None."""
        return self._vt.network if self._vt is not None else None

    @property
    def clock(self) -> float:
        """This rank's virtual time in seconds (a group made with ``network=``), else 0.0."""
        return self._vt.clock[self._rank] if self._vt is not None else 0.0

    def inject(self, *, after_messages: int = 0, fault: str = "kill", delay: float = 0.1) -> None:
        """Make this rank fail on purpose, for tests of recovery code without processes.

        After this rank has sent ``after_messages`` more messages, every later send:

        - ``"kill"``: the rank dies: its peers' calls with it raise :class:`PeerClosedError`
          (as after a SIGKILL), and its own send raises PeerClosedError too;
        - ``"freeze"``: the rank stops (as after a SIGSTOP): nothing more is delivered, its
          peers time out at their deadlines, and its own send waits its timeout and raises
          :class:`CollectiveTimeoutError`;
        - ``"delay"``: each message is delivered ``delay`` seconds late (a slow rank).

        Example: ``group[1].inject(after_messages=5, fault="kill")``.

        Parameters
        ----------
        after_messages : int, default 0
            Sends of this rank that still go through before the fault.
        fault : {"kill", "freeze", "delay"}, default "kill"
        delay : float, default 0.1
            Seconds each message is late (``fault="delay"``).

        Raises
        ------
        ValueError
            An unknown ``fault``, ``after_messages`` not an int >= 0, or a bad ``delay``.
        """
        if fault not in ("kill", "freeze", "delay"):
            raise ValueError(f"inject: fault {fault!r} is not 'kill', 'freeze' or 'delay'")
        if isinstance(after_messages, bool) or not isinstance(after_messages, int) \
                or after_messages < 0:
            raise ValueError(f"inject: after_messages {after_messages!r} is not an int >= 0")
        self._fault = (self._sends + after_messages, fault,
                       check_timeout(delay, "inject: delay"))

    def _faulty_send(self, dst: int) -> bool:
        """Apply an injected fault to this send; True if the message must not be delivered."""
        start, kind, delay = self._fault
        if self._sends <= start:
            return False
        if kind == "delay":
            time.sleep(delay)
            return False
        if kind == "kill":
            reason = f"rank {self._rank} was killed by fault injection"
            for r, box in enumerate(self._boxes):
                if r != self._rank:
                    box.peer_closed(self._rank, reason)
            raise PeerClosedError(f"send: {reason}", peer=self._rank)
        time.sleep(self.timeout)
        raise CollectiveTimeoutError(f"send: rank {self._rank} -> {dst} is frozen by fault "
                                     f"injection (waited {self.timeout:g}s)")

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        view = self._send_view(data, dst, tag)
        self._box.check("send", dst)
        self._sends += 1
        if self._fault is not None and self._faulty_send(dst):
            return
        if self._vt is not None:
            self._vt.on_send(self._rank, dst, tag, len(view))
        box = self._boxes[dst]
        req = box.claim(self._rank, tag)
        if req is not None:
            box.fill(req, view)
        else:
            box.deliver(self._rank, tag, bytes(view))
        self.bytes_sent += len(view)

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        view = self._recv_view(out, src, tag)
        if self._vt is None:
            return self._box.post(src, tag, view)
        ticket = self._vt.on_post(src, self._rank, tag)
        return TimedRequest(self._box.post(src, tag, view), self._vt, (src, self._rank, tag),
                            ticket)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(out, src, tag=tag).wait(self.resolve_timeout(timeout, "recv: timeout"))

    def irecv_any(self, out: Any, *, tag: int = 0) -> Request:
        if self._vt is not None:  # virtual time pairs each receive with its sender's message
            raise NotImplementedError("SimulatedBackend with a network model does not receive "
                                      "from any source (irecv_any): receive from a named rank")
        check_tag(tag)
        return self._box.post_any(tag, as_recv_view(out))

    def link_transports(self) -> tuple[str, str]:
        return "in-process (threads, one copy per message)", "none (one process)"

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        # (as the TCP mesh: a closed or aborted backend says so before a call's own checks)
        return self._box.failure(op, peer)

    def abort(self, reason: str) -> None:
        if self._box.closed:  # (as the TCP mesh: a closed backend publishes nothing)
            return
        self.finish_publishing()  # (a refused call's reason goes out first)
        for box in self._boxes:
            box.abort(self._rank, reason)
        self.close()

    def close(self) -> None:
        if self._box.closed:
            return
        self.finish_publishing()  # (a refused call's reason goes out first)
        for r, box in enumerate(self._boxes):
            if r == self._rank:
                box.close()
            else:
                box.peer_closed(self._rank, "closed")

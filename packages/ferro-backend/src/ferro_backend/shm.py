"""A same-host transport: messages move through shared memory or one kernel copy.

``ShmBackend`` keeps TcpBackend's mesh (over loopback) as its control plane: rendezvous,
authentication, failure detection and abort. Its data moves through the job's engine segment
(:mod:`.engine`, an anonymous ``memfd``: nothing has a name in ``/dev/shm``, so a SIGKILLed
rank leaks nothing): collectives through the slots (ferro-collective's fast path), point-to-point
messages through a ring per ordered pair of ranks (:mod:`.rings`): small ones copied in and out,
large ones streamed through the ring or, when the ranks outnumber the cores, copied once
straight out of the sender's memory into the receive buffer with ``process_vm_readv``
(``_shm.cma_read``, GIL released, as Open MPI's CMA path does) where the kernel allows it.

With the engine off (``engine=False``, ``FERRO_SHM_ENGINE=0``) messages travel the sockets, the
large ones as a descriptor the receiver's reader thread copies from.

Same contract and errors as :class:`TcpBackend`: a dead peer fails waiting receives (and a send
waiting for its receiver) at once, timeouts raise CollectiveTimeoutError, ``abort`` reaches
everyone.
"""

from __future__ import annotations

import itertools
import os
import queue
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from . import settings
from ._platform import SAME_HOST_ENGINE, _shm
from .base import size_mismatch
from .engine import SharedSegment
from .errors import CollectiveTimeoutError, PeerClosedError
from .framing import Link
from .rings import CMA_THRESHOLD, RingMesh
from .tcp import TcpBackend

K_CMA, K_ACK = 4, 5
_DESC = struct.Struct("<QQQQ")  # pid, address, nbytes, send id
_ACK = struct.Struct("<QQ")  # send id, status
ACK_OK, ACK_RETRY = 0, 1



class ShmBackend(TcpBackend):
    """One rank of a job whose ranks share a host. Arguments as :class:`TcpBackend`, plus:

    engine
        Map the job's shared segment (:mod:`ferro_backend.engine`), on which ferro-collective
        runs its same-host fast path (default: on, ``FERRO_SHM_ENGINE=0`` turns it off).
    slot_bytes
        Data bytes per rank and slot of that segment (default 1 MiB,
        ``FERRO_SHM_SLOT_BYTES``): collectives up to this size go through the segment.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, *,
                 engine: bool | None = None, slot_bytes: int | None = None,
                 **kwargs: Any) -> None:
        if not SAME_HOST_ENGINE:
            raise RuntimeError(f"ShmBackend needs Linux (process_vm_readv, memfd, futexes); this "
                               f"is {sys.platform}: use TcpBackend (ferrorun --transport tcp)")
        if engine is None:
            engine = settings.SHM_ENGINE.get()
        if slot_bytes is None:
            slot_bytes = settings.SHM_SLOT_BYTES.get()
        _shm.allow_peers_to_read()
        self._pid = os.getpid()
        self._send_ids = itertools.count(1)
        self._acks: dict[int, list] = {}  # send id -> [event, status]
        self._acks_lock = threading.Lock()
        self._cma_peers: set[int] = set(range(world_size))
        self._ack_queue: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(rank, world_size, master_addr, **kwargs)
        self._ack_thread = threading.Thread(target=self._ack_sender, daemon=True,
                                            name=f"ferro-shm-acks-{rank}")
        self._ack_thread.start()
        #: the job's shared segment, where ferro-collective runs its fast path (None: off)
        self.engine: SharedSegment | None = None
        if world_size > 1 and engine:
            try:
                self.engine = SharedSegment.join(self, slot_bytes=slot_bytes)
            except BaseException:
                self.abort("the engine segment could not be set up")
                raise
            self._box.add_failure_callback(self.engine.mark_failed)
        #: point-to-point messages through the segment's rings (None: through the sockets)
        if self.engine is not None:
            self._rings = RingMesh(self.engine, self._box, lambda: self.timeout)

    @property
    def bytes_sent(self) -> int:  # type: ignore[override]
        """Payload bytes sent over the links plus those written for peers into the segment."""
        return super().bytes_sent + (0 if self.engine is None else self.engine.sent)

    @property
    def bytes_received(self) -> int:  # type: ignore[override]
        return super().bytes_received + (0 if self.engine is None else self.engine.received)

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        """The error an ``op`` involving ``peer`` must raise now (an abort, this backend
        closed, or ``peer`` gone), or None: how the engine's users name a failure."""
        return self._box.failure(op, peer)

    # ------------------------------------------------------------------ sending
    def _send_frames(self, view: memoryview, dst: int, tag: int) -> None:
        """Without the engine's rings: large messages as a descriptor over the socket, which
        the receiver's reader thread copies from (one cross-memory copy)."""
        if len(view) < CMA_THRESHOLD or dst not in self._cma_peers:
            return super()._send_frames(view, dst, tag)
        arr = np.frombuffer(view, dtype=np.uint8)  # keeps `view` alive and gives its address
        send_id = next(self._send_ids)
        pending = [threading.Event(), None]
        with self._acks_lock:
            self._acks[send_id] = pending
        link = self._links[dst]
        try:
            desc = memoryview(_DESC.pack(self._pid, arr.ctypes.data, len(view), send_id))
            deadline = time.monotonic() + self.timeout
            link.send_frame(K_CMA, tag, desc, deadline, lambda: self._fail_if_down("send", dst))
            while not pending[0].wait(0.05):
                self._fail_if_down("send", dst)
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"send: rank {self.rank} -> {dst} (tag {tag}): {len(view)} bytes not "
                        f"read by the peer within {self.timeout:g}s")
        finally:
            with self._acks_lock:
                self._acks.pop(send_id, None)
        if pending[1] == ACK_RETRY:  # the peer cannot read our memory: use the socket
            self._cma_peers.discard(dst)
            super()._send_frames(view, dst, tag)
        else:
            link.sent += len(view)

    def _ack_sender(self) -> None:
        while True:
            item = self._ack_queue.get()
            if item is None:
                return
            peer, send_id, status = item
            try:
                self._links[peer].send_frame(K_ACK, 0, memoryview(_ACK.pack(send_id, status)),
                                             time.monotonic() + self.timeout)
            except Exception:
                pass

    # ------------------------------------------------------------------ receiving
    def _on_frame(self, link: Link, kind: int, tag: int, length: int) -> bool:
        if kind == K_ACK:
            payload = bytearray(_ACK.size)
            link.read_into(memoryview(payload))
            send_id, status = _ACK.unpack(payload)
            with self._acks_lock:
                pending = self._acks.get(send_id)
            if pending is not None:
                pending[1] = status
                pending[0].set()
            return True
        if kind != K_CMA:
            return False
        payload = bytearray(_DESC.size)
        link.read_into(memoryview(payload))
        pid, addr, nbytes, send_id = _DESC.unpack(payload)
        self._ack_queue.put((link.peer, send_id, self._cma_receive(link, tag, pid, addr, nbytes)))
        return True

    def _cma_receive(self, link: Link, tag: int, pid: int, addr: int, nbytes: int) -> int:
        """Copy a published message out of the sender's memory; the status to acknowledge."""
        box, peer = self._box, link.peer
        # a receive about to be posted is worth a short wait: no buffer, one copy
        req = box.claim(peer, tag) or box.claim_wait(peer, tag, 0.05, self._may_wait_for_receive)
        try:
            if req is None:
                buf = np.empty(nbytes, dtype=np.uint8)
                _shm.cma_read(pid, addr, buf)
                box.deliver(peer, tag, buf)
            elif len(req.view) != nbytes:
                req.fail(size_mismatch("recv", peer, self.rank, tag, len(req.view), nbytes))
            else:
                _shm.cma_read(pid, addr, req.view)
                req.complete()
        except OSError as exc:
            if exc.errno in (1, 13, 38):  # EPERM, EACCES, ENOSYS: the socket must carry it
                if req is not None:
                    box.repost_front(req)
                return ACK_RETRY
            if req is not None:  # the sender died under us
                req.fail(PeerClosedError(f"recv: rank {self.rank} <- {peer}: the sender "
                                         f"is gone ({exc})", peer=peer))
            box.peer_closed(peer, str(exc))
            return ACK_OK
        link.received += nbytes
        return ACK_OK

    def _may_wait_for_receive(self) -> bool:
        # nor while a send of ours waits for its acknowledgement: it may be behind the frame
        # this reader holds, and the receive we would post comes after that send returns
        return not self._acks and super()._may_wait_for_receive()

    def link_transports(self) -> tuple[str, str]:
        cma = (f"cross-memory copy for point-to-point messages >= {CMA_THRESHOLD >> 10} KiB, "
               "TCP loopback for smaller ones and control")
        if self.engine is not None:
            lay = self.engine.layout
            big = ("cross-memory copy" if self._rings is not None
                   and self._rings.cma_threshold is not None else "streamed through the ring")
            within = (f"shared-memory engine (collectives: {lay['slot_bytes'] >> 10} KiB slots; "
                      f"point-to-point: {lay['ring_bytes'] >> 10} KiB rings, messages >= "
                      f"{CMA_THRESHOLD >> 10} KiB {big}), TCP loopback for control")
        else:
            within = cma
        return within, "none (ShmBackend needs every rank on one host)"

    def close(self) -> None:
        """Send the acknowledgements still queued, then close like TcpBackend."""
        if not self._box.closed:
            self._ack_queue.put(None)
            self._ack_thread.join(5.0)
        super().close()

    def _teardown(self, wait: float) -> None:
        super()._teardown(wait)
        if self._rings is not None:
            self._rings.close()
        if self.engine is not None:
            self.engine.close()
        self._ack_queue.put(None)
        with self._acks_lock:
            for pending in self._acks.values():
                pending[0].set()

"""A same-host transport: large messages move with one kernel copy between the processes.

``ShmBackend`` keeps TcpBackend's mesh (over loopback) as its control plane: rendezvous,
authentication, small messages, failure detection and abort. A message of at least
``CMA_THRESHOLD`` bytes never crosses a socket: the sender publishes a descriptor (pid, address,
length) and blocks; the receiver's reader thread copies the bytes straight out of the sender's
memory into the posted receive buffer with ``process_vm_readv`` (``_shm.cma_read``, GIL released:
a single copy, as Open MPI's CMA path does) and acknowledges. Nothing is mapped or created in
``/dev/shm``, so a SIGKILLed rank leaks nothing. If the kernel forbids cross-memory reads
(another user, a hardened ptrace policy), the pair falls back to sending through the socket.

Same contract and errors as :class:`TcpBackend`: a dead peer fails waiting receives (and a send
waiting for its acknowledgement) at once, timeouts raise CollectiveTimeoutError, ``abort``
reaches everyone.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from . import _shm
from .base import as_send_view, check_tag, size_mismatch
from .errors import CollectiveTimeoutError, PeerClosedError
from .tcp import TcpBackend

K_CMA, K_ACK = 4, 5
_DESC = struct.Struct("<QQQQ")  # pid, address, nbytes, send id
_ACK = struct.Struct("<QQ")  # send id, status
ACK_OK, ACK_RETRY = 0, 1

#: messages at least this large move by cross-memory copy; smaller ones through the socket
CMA_THRESHOLD = 64 << 10


class ShmBackend(TcpBackend):
    """One rank of a job whose ranks share a host. Arguments as :class:`TcpBackend`."""

    def __init__(self, rank: int, world_size: int, master_addr: str, **kwargs: Any) -> None:
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

    # ------------------------------------------------------------------ sending
    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        view = as_send_view(data)
        if len(view) < CMA_THRESHOLD or dst not in self._cma_peers:
            return super().send(view, dst, tag=tag)
        self._check_peer("send", dst, "dst")
        check_tag(tag)
        self._raise_if_failed("send", dst)
        arr = np.frombuffer(view, dtype=np.uint8)  # keeps `view` alive and gives its address
        send_id = next(self._send_ids)
        pending = [threading.Event(), None]
        with self._acks_lock:
            self._acks[send_id] = pending
        try:
            desc = memoryview(_DESC.pack(self._pid, arr.ctypes.data, len(view), send_id))
            deadline = time.monotonic() + self.timeout
            with self._send_locks[dst]:
                self._send_frame(dst, K_CMA, tag, desc, deadline)
            while not pending[0].wait(0.05):
                self._raise_if_failed("send", dst)
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"send: rank {self._rank} -> {dst} (tag {tag}): {len(view)} bytes not "
                        f"read by the peer within {self.timeout:g}s")
        finally:
            with self._acks_lock:
                self._acks.pop(send_id, None)
        if pending[1] == ACK_RETRY:  # the peer cannot read our memory: use the socket
            self._cma_peers.discard(dst)
            super().send(view, dst, tag=tag)
        else:
            self.bytes_sent += len(view)

    def _ack_sender(self) -> None:
        while True:
            item = self._ack_queue.get()
            if item is None:
                return
            peer, send_id, status = item
            try:
                with self._send_locks[peer]:
                    self._send_frame(peer, K_ACK, 0, memoryview(_ACK.pack(send_id, status)),
                                     time.monotonic() + self.timeout)
            except Exception:
                pass

    # ------------------------------------------------------------------ receiving
    def _extra_frame(self, peer: int, sock: socket.socket, kind: int, tag: int,
                     length: int) -> bool:
        box = self._box
        if kind == K_ACK:
            payload = bytearray(_ACK.size)
            self._read_exact(sock, memoryview(payload))
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
        self._read_exact(sock, memoryview(payload))
        pid, addr, nbytes, send_id = _DESC.unpack(payload)
        req = box.claim(peer, tag) or box.claim_wait(peer, tag, 0.05)
        status = ACK_OK
        try:
            if req is None:
                buf = np.empty(nbytes, dtype=np.uint8)
                _shm.cma_read(pid, addr, buf)
                box.deliver(peer, tag, buf)
            elif len(req.view) != nbytes:
                req.fail(size_mismatch("recv", peer, self._rank, tag, len(req.view), nbytes))
            else:
                _shm.cma_read(pid, addr, req.view)
                req.complete()
        except OSError as exc:
            if req is not None and exc.errno in (1, 13, 38):  # EPERM, EACCES, ENOSYS
                box.repost_front(req)
                status = ACK_RETRY
            elif exc.errno in (1, 13, 38):
                status = ACK_RETRY
            else:  # the sender died under us
                if req is not None:
                    req.fail(PeerClosedError(f"recv: rank {self._rank} <- {peer}: the sender "
                                             f"is gone ({exc})", peer=peer))
                box.peer_closed(peer, str(exc))
        self.bytes_received += nbytes if status == ACK_OK else 0
        self._ack_queue.put((peer, send_id, status))
        return True

    def close(self) -> None:
        """Send the acknowledgements still queued, then close like TcpBackend."""
        if not self._closed:
            self._ack_queue.put(None)
            self._ack_thread.join(5.0)
        super().close()

    def _teardown(self, wait: float) -> None:
        super()._teardown(wait)
        self._ack_queue.put(None)
        with self._acks_lock:
            for pending in self._acks.values():
                pending[0].set()

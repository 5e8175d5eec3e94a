"""The receive state of one link in the receive loop (:mod:`.reactor`): the frame header being
read, then its payload, and where that payload goes."""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from ..mailbox import PostedRecv
from .framing import FRAME, Link

HEADER, PAYLOAD, PARKED, DONE = 0, 1, 2, 3


def allocate(length: int, peer: int, rank: int, tag: int) -> np.ndarray:
    """The buffer of an unexpected frame (no zero-fill); ProtocolError if a header announces
    more than this process can allocate (a corrupt or hostile peer: the link is dropped)."""
    try:
        return np.empty(length, dtype=np.uint8)
    except (MemoryError, ValueError) as exc:
        raise ProtocolError(f"recv: rank {rank} <- {peer} (tag {tag}): a frame of {length} "
                            f"bytes cannot be allocated ({exc})") from exc


class Incoming:
    """The receive state of one link: the frame header being read, then its payload."""

    __slots__ = ("link", "state", "header", "got", "kind", "tag", "length", "view", "req", "buf",
                 "skip", "parked_until", "fd")

    def __init__(self, link: Link) -> None:
        self.link = link
        self.state = HEADER
        self.header = memoryview(bytearray(FRAME.size))
        self.got = 0
        self.kind = self.tag = self.length = 0
        self.view: memoryview | None = None
        self.req: PostedRecv | None = None
        self.buf: np.ndarray | None = None
        self.skip = False
        self.parked_until = 0.0
        self.fd = link.sock.fileno()

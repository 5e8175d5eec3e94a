"""Point-to-point messages of a ferro process group: torch's send/recv (and so isend/irecv)
as ferro's tagged messages between two ranks."""

from __future__ import annotations

import numpy as np
import torch

from ferro_backend.base import USER_TAG_LIMIT

from ._convert import flat, readable
from ._group_core import GroupCore
from ._work import DEFERRING, FerroWork, RequestWork, hand_over_deferred
from .errors import as_torch_error

#: torch's send/recv tags must stay below ferro's user tag limit
TAG_LIMIT = USER_TAG_LIMIT


class PointToPoint(GroupCore):
    """send/recv of :class:`~ferro_torch.ProcessGroupFerro`: a send completes before it
    returns; a recv completes when ferro's request does (a non-contiguous tensor is received
    into a contiguous copy first)."""

    def _check_tag(self, name: str, tag: int) -> int:
        if not 0 <= tag < TAG_LIMIT:
            raise ValueError(f"{name}: tag {tag} is outside [0, {TAG_LIMIT})")
        return tag

    def send(self, tensors, dstRank, tag=0):
        """torch's ``send``/``isend``: ``tensors[0]`` to rank ``dstRank`` under ``tag``; a Work that
        completes when it is sent."""
        self._check("send", tensors)
        self._check_tag("send", tag)
        if DEFERRING:  # (the peer may need these before it receives)
            hand_over_deferred()
        work = FerroWork("send", list(tensors), self._b.timeout)
        try:
            for t in tensors:
                x = readable(t)
                self._b.send(x.view(np.uint8), dstRank, tag=tag)
        except BaseException as exc:
            work._finish(as_torch_error(exc, "ferro send", self._b.timeout))
        else:
            work._finish()
        return self._issued(work)

    def recv(self, tensors, srcRank, tag=0):
        """torch's ``recv``/``irecv``: a message from rank ``srcRank`` under ``tag`` into
        ``tensors[0]``; a Work."""
        return self._recv("recv", tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv``/``irecv`` without ``src``: ferro's receive from any rank
        (``Backend.irecv_any``); the work's ``_source_rank()`` names the sender.

        Parameters
        ----------
        tensors : list of torch.Tensor
            One CPU tensor to fill.
        tag : int, default 0

        Returns
        -------
        torch.distributed.Work
        """
        return self._recv("recv", tensors, None, tag)

    def _recv(self, name: str, tensors, src: int | None, tag: int):
        self._check(name, tensors)
        self._check_tag(name, tag)
        if len(tensors) != 1:
            raise ValueError(f"{name}: {len(tensors)} tensors, expected 1")
        if src is not None and src == self._b.rank:  # (its deadline, else)
            raise ValueError(f"{name}: rank {src} is this rank: no message from itself ever "
                             "comes")
        if DEFERRING:  # (the peer may need these before it sends)
            hand_over_deferred()
        (t,) = tensors
        staged = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        out = flat(staged).view(np.uint8)
        try:
            req = (self._b.irecv_any(out, tag=tag) if src is None
                   else self._b.irecv(out, src, tag=tag))
        except NotImplementedError as exc:  # a transport without receives from any rank
            raise RuntimeError(f"ferro recv: {exc}") from None

        def after() -> None:
            if staged is not t:
                with torch.no_grad():
                    t.copy_(staged)

        work = RequestWork(name, [t], req, self._b.timeout, after)
        self._receives.add(work)
        return self._issued(work)


__all__ = ["TAG_LIMIT", "PointToPoint"]

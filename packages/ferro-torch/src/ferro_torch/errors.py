"""How ferro's failures reach torch: one error class, a torch ``DistBackendError``."""

from __future__ import annotations

import torch.distributed as dist

from ferro_backend import DistributedError


class FerroTorchError(dist.DistBackendError):
    """A ferro collective or message failed under torch.distributed.

    A subclass of ``torch.distributed.DistBackendError`` (so of ``DistError`` and
    ``RuntimeError``) carrying ferro's message; the ferro exception (a dead peer's
    ``PeerClosedError``, ``CollectiveMismatchError``, ``CollectiveTimeoutError``,
    ``AuthenticationError``...) is its ``__cause__`` and its attribute ``ferro_error``.

    Parameters
    ----------
    message : str
        The error message (what failed, where, then ferro's message).
    ferro_error : BaseException, optional
        The ferro exception, kept as the ``ferro_error`` attribute.
    """

    def __init__(self, message: str, ferro_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.ferro_error = ferro_error


def as_torch_error(exc: BaseException, where: str, timeout: float | None = None
                   ) -> BaseException:
    """``exc`` as torch should see it: ferro's errors (and lost connections) become
    :class:`FerroTorchError` naming ``where``; argument errors (TypeError, ValueError that are
    not ferro's) and FerroTorchError itself are returned as they are.

    A timeout is worded as torch's backends word theirs (gloo: "Timed out waiting 1000ms for
    recv operation to complete"), ``timeout`` (seconds) being the deadline the operation had,
    then ferro's own detail (which rank, which round, which peers) follows in parentheses.
    """
    if isinstance(exc, FerroTorchError):
        return exc
    if isinstance(exc, TimeoutError):
        waited = "" if timeout is None else f" waiting {timeout * 1000:.0f}ms"
        err = FerroTorchError(f"{where}: Timed out{waited} for the operation to complete "
                              f"({type(exc).__name__}: {exc})", exc)
        err.__cause__ = exc
        return err
    if isinstance(exc, DistributedError | ConnectionError):
        err = FerroTorchError(f"{where}: {type(exc).__name__}: {exc}", exc)
        err.__cause__ = exc
        return err
    return exc


__all__ = ["FerroTorchError", "as_torch_error"]

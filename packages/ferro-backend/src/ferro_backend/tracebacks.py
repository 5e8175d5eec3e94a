"""How ferro's errors reach the user: a public call's error with its traceback cut to the
frames the user can act on (the call and the user's own), ``FERRO_TRACEBACK=full`` keeping
every frame inside ferro for debugging ferro itself.
"""

from __future__ import annotations

from . import settings


def user_facing(exc: BaseException) -> BaseException:
    """``exc`` made ready for the caller of a public ferro call: its traceback cut to nothing,
    so that the frames shown are the user's and the public call's (``raise user_facing(exc)``
    from the public entry point), and each exception it was raised from or during cut to the
    frame that raised it. ``FERRO_TRACEBACK=full`` keeps every frame (for debugging ferro).

    Parameters
    ----------
    exc : BaseException
        The error a public call is about to raise.

    Returns
    -------
    BaseException
        ``exc`` itself (changed in place).
    """
    if settings.TRACEBACK.get() == "full":
        return exc
    exc.__traceback__ = None
    seen = {id(exc)}
    chained = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        tb = chained.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        chained.__traceback__ = tb
        chained = chained.__cause__ or (None if chained.__suppress_context__
                                        else chained.__context__)
    return exc

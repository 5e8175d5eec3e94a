"""The files of the timeline (:mod:`ferro_backend.timeline`): a ``FERRO_TRACE`` directory
checked before a job starts, the ranks' ``rank_<r>.json`` in it (not the user's other files),
the events a process wrote there before (a later backend's appended), and ``ferrorun
--trace``'s merge of them into one trace."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: a rank's file in a FERRO_TRACE / ``ferrorun --trace`` directory (not ``rank_0_metrics.json``)
_RANK_FILE = re.compile(r"rank_\d+\.json")


def check_env_dir(directory: str) -> Path:
    """``FERRO_TRACE=directory``: made now (before the job starts), so that a path that is a
    file or cannot be created is said at once, not found when the rank exits.

    Parameters
    ----------
    directory : str
        The value of ``FERRO_TRACE``.

    Returns
    -------
    pathlib.Path
        The directory, which exists.

    Raises
    ------
    ferro_backend.errors.SettingError
        It cannot be a directory this process writes to: the message names ``FERRO_TRACE``
        and the path.
    """
    from . import settings
    from .errors import SettingError

    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = ("it is a file, not a directory" if path.exists() and not path.is_dir()
                else f"cannot create the directory: {exc.strerror or exc}")
        raise SettingError(f"{settings.TRACE.name} {directory!r} is invalid, {what}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingError(f"{settings.TRACE.name} {directory!r} is invalid, cannot write to "
                           "the directory: Permission denied")
    return path


def _earlier_events(path: Path) -> list:
    """The events (not the metadata) of ``path``, which this process wrote before."""
    try:
        return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") != "M"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def rank_files(directory) -> list[Path]:
    """The ranks' files in a ``FERRO_TRACE`` directory: ``rank_<r>.json`` only (not a
    ``rank_0_metrics.json`` of the user's), sorted by rank.

    Parameters
    ----------
    directory : str or os.PathLike
        The directory.

    Returns
    -------
    list of pathlib.Path
        Its entries named ``rank_<digits>.json``.
    """
    found = [p for p in Path(directory).iterdir() if _RANK_FILE.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:-5]))


def merge(files, out) -> Path:
    """One trace of the whole job from the ranks' files (``ferrorun --trace``).

    Parameters
    ----------
    files : iterable of str or os.PathLike
        The ranks' trace-event files.
    out : str or os.PathLike
        The merged file written.

    Returns
    -------
    pathlib.Path
        ``out``.

    Raises
    ------
    ValueError
        A file is no trace-event JSON (the message names it).
    OSError
        A file cannot be read, or ``out`` written.
    """
    events: list = []
    for f in sorted(map(Path, files)):
        try:
            events.extend(json.loads(f.read_text())["traceEvents"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{f} is no trace-event JSON ({type(exc).__name__}: {exc})") from None
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    return out


__all__ = ["check_env_dir", "merge", "rank_files"]

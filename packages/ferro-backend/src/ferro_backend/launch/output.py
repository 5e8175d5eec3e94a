"""How ``ferrorun`` copies each rank's output: one ``[rank N]`` prefix per line, progress bars
(lines redrawn with carriage returns) kept readable, and per-rank log files (``--log-dir``).

Each of a rank's two streams is read by a thread of its own (:func:`pump`) and cut into lines
(:class:`Lines`), never decoded (any bytes pass through). What ferrorun writes depends on where
its own stream goes, each of stdout and stderr decided apart:

- **a terminal** (live): every carriage-return segment is drawn with the prefix as it arrives,
  the cursor left at the start of the line, so a bar animates with its prefix;
- **anything else** (a file, a pipe, a CI log): a line rewritten with ``\\r`` is written once,
  as it last read (its last segment that is not blank), when the line ends with ``\\n``, when
  the rank exits or when ferrorun stops reading. A line over :data:`MAX_LINE` bytes without an
  end is written in pieces of that size, each a line of its own.

A prefix is added only at the start of a line that is written whole, so no line carries two
(before, the empty segment in front of each ``\\r`` a bar starts with got a prefix of its own:
``[rank 0] \\r[rank 0]  10%|#``). A line the rank left unfinished at exit is written with its
prefix and a ``\\n``, so the next line does not start inside it.

``--log-dir DIR`` (:func:`open_logs`): each rank's output also goes, without prefix and with
bars collapsed as above, to ``DIR/rank_<N>.log`` (stdout and stderr as they came) and to
``DIR/rank_<N>.stdout`` and ``DIR/rank_<N>.stderr``; a run starts them empty, restarts of the
job (``--max-restarts``) append.
"""

from __future__ import annotations

import os
import re
import select
import threading
from pathlib import Path

from ..errors import LauncherError

#: bytes a line may grow to without an end before it is written as a line of its own
MAX_LINE = 1 << 20
#: seconds each read of a rank's stream waits before it looks whether it should stop
POLL_SECONDS = 0.1

_LOCK = threading.Lock()   # whole lines: the ranks' writes never interleave inside one
_PARTS = re.compile(rb"(\r|\n)")


class LogDirError(LauncherError, OSError):
    """``ferrorun --log-dir``: the directory or one of its files could not be made; the message
    names the path, :attr:`filename` holds it and :attr:`errno` the system's reason."""

    def __init__(self, path: Path, what: str, cause: OSError) -> None:
        message = f"--log-dir: cannot {what} {str(path)!r}: {cause.strerror or cause}"
        super().__init__(cause.errno, message)
        self.errno, self.strerror, self.filename = cause.errno, message, str(path)

    def __str__(self) -> str:
        return str(self.strerror)


def prepare_log_dir(path: Path, world_size: int | None = None) -> Path:
    """Create ``path`` (and its parents) if missing; :class:`LogDirError` names it if that fails.
    ``world_size``: the log files of ranks this job has not (``rank_<N>.*``, N >= it) are left
    from an earlier, larger job: deleted, so the directory holds this job's logs only."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LogDirError(path, "create the directory", exc) from exc
    if world_size is not None:
        for old in path.glob("rank_*.*"):
            m = _LOG_NAME.fullmatch(old.name)
            if m and int(m.group(1)) >= world_size:
                try:
                    old.unlink()
                except OSError as exc:
                    raise LogDirError(old, "delete an earlier job's log", exc) from exc
    return path


#: a rank's log file (:func:`open_logs`)
_LOG_NAME = re.compile(r"rank_(0|[1-9][0-9]*)\.(log|stdout|stderr)")


def open_logs(log_dir: Path, rank: int, append: bool = False) -> dict[str, object]:
    """The log files of ``rank``: ``{"log": rank_<N>.log, "stdout": rank_<N>.stdout,
    "stderr": rank_<N>.stderr}``, binary; truncated unless ``append``. :class:`LogDirError`
    names the file that cannot be written (none is left open)."""
    files: dict[str, object] = {}
    for key, name in (("log", f"rank_{rank}.log"), ("stdout", f"rank_{rank}.stdout"),
                      ("stderr", f"rank_{rank}.stderr")):
        path = log_dir / name
        try:
            files[key] = open(path, "ab" if append else "wb")  # closed by Job.finish_output
        except OSError as exc:
            for f in files.values():
                f.close()
            raise LogDirError(path, "write", exc) from exc
    return files


class Lines:
    """One stream cut into lines, each line prefixed with ``prefix`` once: :meth:`feed` takes
    what the rank wrote and returns what to write; :meth:`finish` ends an unfinished line.
    ``live``: draw every carriage-return segment (a terminal), else collapse each line to its
    last state (module docstring)."""

    def __init__(self, prefix: bytes, live: bool) -> None:
        self.prefix, self.live = prefix, live
        self.segment = b""   # the current line since its last \r
        self.last = b""      # the line's last segment that was not blank (collapsed mode)
        self.shown = None    # live: the segment as last drawn (None: not drawn yet)

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for part in _PARTS.split(data):
            if part == b"\n":
                out.append(self._end())
            elif part == b"\r":
                if self.live and self.segment and self.shown != self.segment:
                    out.append(self.prefix + self.segment + b"\r")
                if self.segment.strip():
                    self.last = self.segment
                self.segment, self.shown = b"", None
            elif part:
                self.segment += part
                while len(self.segment) > MAX_LINE:
                    head, self.segment = self.segment[:MAX_LINE], self.segment[MAX_LINE:]
                    out.append(self.prefix + head + b"\n")
                    self.last, self.shown = b"", None
        if self.live and self.segment and self.shown != self.segment:
            out.append(self.prefix + self.segment + b"\r")   # the cursor back at the start
            self.shown = self.segment
        return b"".join(out)

    def _end(self) -> bytes:
        text = self.segment
        if not self.live and not text.strip() and self.last:
            text = self.last   # a bar's last state (or a line ended by \r\n)
        self.segment, self.last, self.shown = b"", b"", None
        return self.prefix + text + b"\n"

    def finish(self) -> bytes:
        """The unfinished line, ended (b"" if there is none)."""
        if not (self.segment.strip() or self.last):
            self.segment = b""
            return b""
        return self._end()


class Sink:
    """ferrorun's own stream: bytes written whole, a closed pipe (``ferrorun | head``) ends the
    writing, not the reading (a rank must never block on a full pipe)."""

    def __init__(self, stream) -> None:
        self.stream, self.broken = stream, False
        try:
            self.live = stream.isatty()
        except (AttributeError, ValueError, OSError):
            self.live = False

    def write(self, data: bytes) -> None:
        if not data or self.broken:
            return
        try:
            raw = getattr(self.stream, "buffer", None)
            if raw is not None:
                raw.write(data)
            else:   # a text stream without bytes underneath (a test's capture)
                self.stream.write(data.decode("utf-8", errors="replace"))
            self.stream.flush()
        except (OSError, ValueError) as exc:
            self.broken = True
            if isinstance(exc, BrokenPipeError):   # what Python's docs advise: the rest, and
                try:                                # the flush at exit, go nowhere
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, self.stream.fileno())
                    os.close(devnull)
                except (OSError, ValueError, AttributeError):
                    pass


def pump(stream, sink: Sink, prefix: str, logs: list, stop: threading.Event) -> None:
    """Copy a rank's ``stream`` (a pipe) to ``sink`` and ``logs`` (binary files) until it ends
    or ``stop`` is set; every read waits at most :data:`POLL_SECONDS`, then the unfinished line
    is written too."""
    shown = Lines(prefix.encode(), sink.live)
    logged = Lines(b"", False)
    fd = stream.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    def emit(to_out: bytes, to_logs: bytes) -> None:
        with _LOCK:
            sink.write(to_out)
            if to_logs:
                for log in logs:
                    try:
                        log.write(to_logs)
                        log.flush()
                    except (OSError, ValueError):   # full disk, or closed after a stop
                        pass

    try:
        while not stop.is_set():
            if not poller.poll(POLL_SECONDS * 1000):
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            emit(shown.feed(data), logged.feed(data))
    finally:
        emit(shown.finish(), logged.finish())
        stream.close()

"""Every ``FERRO_*`` environment variable ferro reads, declared once.

Each :class:`Setting` has its name, its kind (how a value is parsed and validated), its default,
who reads it and one line of documentation. Nothing else in ferro reads ``os.environ`` for a
``FERRO_*`` name: code asks the setting (``settings.TIMEOUT.get()``), and code that writes the
environment of child processes (ferrorun, the test launchers) names it by ``setting.name``.

A value is parsed and validated once per raw string (a cache keyed by the string, so a changed
environment is seen at once); a bad value raises :class:`~ferro_backend.errors.SettingError`
naming the variable, the value and what was expected. :func:`override` sets values for a block
of code (tests), ahead of the environment. :func:`markdown_table` prints the table the
ferro-backend README carries (a test holds the two equal).

>>> from ferro_backend import settings
>>> settings.SHM_SLOT_BYTES.parse("256k")
262144
>>> with settings.override(SHM_ENGINE=False):
...     settings.SHM_ENGINE.get()
False
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import SettingError

#: the prefix of every variable here
PREFIX = "FERRO_"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _bytes(raw: str) -> int:
    """A byte count: ``4096``, ``64k``, ``1M``, ``2g`` (powers of 1024) or ``inf``."""
    word = raw.strip().lower().removesuffix("b").removesuffix("i")
    if word in ("inf", "infinity"):
        return 1 << 62
    unit = word[-1:] if word[-1:] in _UNITS else ""
    number = word[: len(word) - len(unit)]
    if not number.isdigit():
        raise ValueError("expected a byte count (4096, 64k, 1M) or inf")
    return int(number) * _UNITS[unit]


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds >= 0") from None
    if math.isnan(value) or value < 0:
        raise ValueError("expected a number of seconds >= 0")
    return value


def _deadline(raw: str) -> float:
    """A deadline: seconds > 0, or inf for none (0 would end every call at once)."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds > 0 (inf: no deadline)") from None
    if math.isnan(value) or value <= 0:
        raise ValueError("expected a number of seconds > 0 (inf: no deadline)")
    return value


def _count(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        word = raw.strip()
        if not word.lstrip("-").isdigit() or int(word) < minimum:
            raise ValueError(f"expected a whole number >= {minimum}")
        return int(word)

    return parse


def _port(raw: str) -> int:
    word = raw.strip()
    if not word.isdigit() or not 0 < int(word) < 65536:
        raise ValueError("expected a TCP port in [1, 65535]")
    return int(word)


def _text(raw: str) -> str | None:
    return raw.strip() or None


def _choice(*choices: str, aliases: Mapping[str, str] | None = None) -> Callable[[str], str]:
    aliases = dict(aliases or {})

    def parse(raw: str) -> str:
        word = raw.strip().lower()
        word = aliases.get(word, word)
        if word not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return word

    parse.choices = choices  # type: ignore[attr-defined]
    return parse


def _min_bytes(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = _bytes(raw)
        if value < minimum:
            raise ValueError(f"expected a byte count >= {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"expected a byte count <= {maximum} ({maximum >> 30} GiB)")
        return value

    return parse


#: the most bytes an engine slot or ring may take (a segment holds 2 slots a rank and a ring
#: a pair: beyond this its size would not fit the address space, and "inf" means no limit)
ENGINE_BYTES_MAX = 1 << 30


def _power_of_two_bytes(raw: str) -> int:
    value = _bytes(raw)
    if value < 4096 or value & (value - 1):
        raise ValueError("expected a power of two >= 4096")
    if value > ENGINE_BYTES_MAX:
        raise ValueError(f"expected a byte count <= {ENGINE_BYTES_MAX} (1 GiB)")
    return value


_overrides: dict[str, Any] = {}


@dataclass(frozen=True)
class Setting:
    """One ``FERRO_*`` variable: ``kind`` says in words what it takes; ``parser`` turns the raw
    string into the value (raising ValueError with what was expected); ``default`` is the
    value when the variable is unset or empty."""

    name: str
    kind: str
    default: Any
    readers: str
    doc: str
    parser: Callable[[str], Any] = field(repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def parse(self, raw: str) -> Any:
        """``raw`` parsed and validated (SettingError naming the variable if it is not)."""
        try:
            return self.parser(raw)
        except ValueError as exc:  # the parsers say what they expected
            raise SettingError(f"{self.name} {raw!r} is invalid, {exc}") from None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value from ``environ`` (default: :func:`override`'s, else ``os.environ``)."""
        if environ is None:
            if self.name in _overrides:
                return _overrides[self.name]
            environ = os.environ
        raw = environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        cache = self._cache
        if raw in cache:
            return cache[raw]
        value = self.parse(raw)
        if len(cache) > 64:
            cache.clear()
        cache[raw] = value
        return value

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable has a (non-empty) value."""
        if environ is None and self.name in _overrides:
            return _overrides[self.name] is not None
        raw = (os.environ if environ is None else environ).get(self.name)
        return raw is not None and bool(raw.strip())


def _declare(name: str, kind: str, parser: Callable[[str], Any], default: Any, readers: str,
             doc: str) -> Setting:
    return Setting(name, kind, default, readers, doc, parser)


# ----------------------------------------------------------------------------- the table
TOKEN = _declare("FERRO_TOKEN", "text", _text, None, "TCP/shm backends, ferrorun",
                 "the job's shared secret (HMAC handshake); ferrorun makes one per job")
TRANSPORT = _declare("FERRO_TRANSPORT", "tcp, shm or mpi", _choice("tcp", "shm", "mpi"), None,
                     "`init_from_env`, ferro-torch",
                     "`shm` (same host, the engine), `tcp` or `mpi` (MpiBackend; not under "
                     "ferro-torch); default: the fastest for the job's topology")
TCP_CONNECT = _declare("FERRO_TCP_CONNECT", "eager, lazy or auto",
                       _choice("eager", "lazy", "auto"), "auto", "`TcpBackend` (and the "
                       "multi-node mesh)", "`eager`: every pair connects at start (the full "
                       "mesh); `lazy`: a pair connects on its first message; `auto`: lazy beyond "
                       "32 ranks")
TCP_READER = _declare("FERRO_TCP_READER", "loop or threads", _choice("loop", "threads"), "loop",
                      "`TcpBackend`", "`loop`: one epoll receive loop per process drains every "
                      "peer's socket (a waiting thread reads them itself); `threads`: a reader "
                      "thread per connected peer")
TRACE = _declare("FERRO_TRACE", "directory", _text, None, "`init_from_env`",
                 "write a Chrome/Perfetto timeline of this rank to `DIR/rank_<r>.json` "
                 "(`ferrorun --trace DIR` sets it and merges the ranks)")
NODE_ID = _declare("FERRO_NODE_ID", "text", _text, None, "`init_from_env`, ferro-torch",
                   "this rank's node, for comparing hosts (tests: two \"nodes\" on one machine)")
HOST_RANKS = _declare("FERRO_HOST_RANKS", "count", _count(1), None,
                      "`ShmBackend`, ferro-collective",
                      "ranks of the job on this host where its node holds fewer (`ferrorun "
                      "--emulate-nodes` sets it: the emulated nodes share this host's cores): "
                      "engine waits then yield as on an oversubscribed host, no rank is bound "
                      "to a core, and `FERRO_BACKGROUND=auto` counts them")
MASTER_PORT = _declare("FERRO_MASTER_PORT", "port", _port, None, "`init_from_env`",
                       "rank 0's port for ferro's own rendezvous (any launcher)")
MASTER_ADDR = _declare("FERRO_MASTER_ADDR", "host", _text, None, "`init_from_env`",
                       "the address rank 0 advertises to the other nodes (mpirun, torchrun)")
HIERARCHY = _declare("FERRO_HIERARCHY", "bool", _bool, True, "`init_from_env`",
                     "`0`: a multi-node job keeps plain TCP (or MPI, `FERRO_TRANSPORT=mpi`) for "
                     "everything (no engine per node)")
TIMEOUT = _declare("FERRO_TIMEOUT", "seconds", _deadline, None,
                   "every backend made from the environment",
                   "`Backend.timeout`: the default deadline of every blocking call")
RESTART_COUNT = _declare("FERRO_RESTART_COUNT", "count", _count(0), 0, "your script",
                         "how many times ferrorun restarted the job (set by ferrorun)")
ELASTIC = _declare("FERRO_ELASTIC", "host:port", _text, None, "`ferro_backend.elastic.join`",
                   "the elastic job's coordinator (set by `ferrorun --nproc MIN:MAX`)")
ELASTIC_TIMEOUT = _declare("FERRO_ELASTIC_TIMEOUT", "seconds", _seconds, 120.0,
                           "`ferro_backend.elastic`", "how long a rank waits for the "
                           "coordinator to form the next generation (ferrorun sets it for its "
                           "ranks: --settle + --join-timeout + --timeout + 10)")
LOG_LEVEL = _declare("FERRO_LOG_LEVEL", "debug, info, warning or error",
                     _choice("debug", "info", "warning", "error"), None, "`import ferro_backend`",
                     "level of the `ferro_backend`, `ferro_collective`, `ferro_fsdp` and "
                     "`ferro_checkpoint` loggers (`ferrorun --log-level`)")
SHM_ENGINE = _declare("FERRO_SHM_ENGINE", "bool", _bool, True, "`ShmBackend`",
                      "`0` turns the same-host engine off (messages then travel the sockets)")
SHM_SLOT_BYTES = _declare("FERRO_SHM_SLOT_BYTES", "bytes, 64 to 1 GiB",
                          _min_bytes(64, ENGINE_BYTES_MAX), 1 << 20, "`ShmBackend`",
                          "data bytes per rank and slot: collectives up to this size take one "
                          "engine step")
SHM_SPLIT_BYTES = _declare("FERRO_SHM_SPLIT_BYTES", "bytes", _bytes, 32 << 10, "`ShmBackend`",
                           "allreduces from this size (within a slot) run split: each rank "
                           "folds one part, pipelined in chunks (rank 0's value holds; 0: "
                           "never; unset while the ranks outnumber the cores: 512 KiB / ranks "
                           "when that is more)")
SHM_STREAM_BYTES = _declare("FERRO_SHM_STREAM_BYTES", "bytes", _bytes, 256 << 10, "`ShmBackend`",
                            "collectives from 16 KiB up to this size whose data stays put in "
                            "the slot (over half a slot per rank) copy into the shared segment "
                            "with non-temporal stores; others only while plain copies there "
                            "run 12 times slower than between private buffers (measured as "
                            "they go)")
SHM_BIND = _declare("FERRO_SHM_BIND", "auto, cores or off", _choice("auto", "cores", "off"),
                    "auto", "`ShmBackend`",
                    "bind each rank of a same-host engine to a core of its own, as MPI does: "
                    "`auto` when the ranks are exactly as many as the usable cores (or k times "
                    "as many: k ranks to a core), `cores` whenever there are enough (one job "
                    "per host), `off` never")
SHM_REPROBE = _declare("FERRO_SHM_REPROBE", "seconds", _seconds, 10.0, "`ShmBackend`",
                       "the engine probes the link between its ranks' cores again (every rank, "
                       "after the same call) at least this often while calls run, and sooner "
                       "when its copies into shared memory change speed 2x (rank 0's value "
                       "holds; 0: only as the job forms and on request)")
SHM_RING_BYTES = _declare("FERRO_SHM_RING_BYTES", "bytes, a power of two >= 4096",
                          _power_of_two_bytes, None, "`ShmBackend`",
                          "bytes of each point-to-point ring (default 256 KiB up to 8 ranks, "
                          "less beyond)")
SHM_CMA = _declare("FERRO_SHM_CMA", "auto, always or never",
                   _choice("auto", "always", "never", aliases={"0": "never", "1": "auto"}),
                   "auto", "`ShmBackend`, ferro-collective",
                   "cross-memory copies: `auto` (where the kernel allows; point-to-point "
                   "messages by descriptor only when the ranks outnumber the cores), `always` "
                   "(also from 64 KiB with a core per rank), `never`")
SHM_YIELDS = _declare("FERRO_SHM_YIELDS", "count", _count(0), 100, "ferro-collective",
                      "when the ranks outnumber the cores: `sched_yield` calls (for 1 ms at "
                      "most) before a collective step's wait sleeps")
SHM_RING_YIELDS = _declare("FERRO_SHM_RING_YIELDS", "count", _count(0), 1000, "`ShmBackend`",
                           "when the ranks outnumber the cores: `sched_yield` calls (for 1 ms at "
                           "most) before a ring wait sleeps")
ASYNC_WORKERS = _declare("FERRO_ASYNC_WORKERS", "count", _count(1), 4, "ferro-collective",
                         "threads running the `*_async` collectives")
SCRATCH_BYTES = _declare("FERRO_SCRATCH_BYTES", "bytes", _bytes, 256 << 20, "ferro-collective",
                         "working buffers of the point-to-point algorithms kept for reuse between "
                         "calls, per process (`0`: none; fresh pages cost a fault each)")
COLLECTIVE_CHECK = _declare("FERRO_COLLECTIVE_CHECK", "bool", _bool, True, "ferro-collective",
                            "`0` turns the mismatch header off on the point-to-point path")
BACKGROUND = _declare("FERRO_BACKGROUND", "auto, on or off",
                      _choice("auto", "on", "off", aliases={"1": "on", "0": "off"}), "auto",
                      "ferro-fsdp, ferro-torch",
                      "where `DDP` and `FSDP` run their collectives, and ferro-torch its "
                      "asynchronous ones: `on` on a background thread while the model computes, "
                      "`off` in the calling thread at the same points (where the data is hot), "
                      "`auto` in the background only when this host has a core to spare beyond "
                      "its ranks")
TRACEBACK = _declare("FERRO_TRACEBACK", "short or full", _choice("short", "full"), "short",
                      "ferro-collective",
                      "`short`: a collective's error shows the frames down to the public call "
                      "(and one for each error it came from); `full`: every frame inside ferro")
JAX_RUNTIME_TOKENS = _declare("FERRO_JAX_RUNTIME_TOKENS", "bool", _bool, False, "ferro-jax",
                               "`1` keeps JAX's runtime tokens on jitted computations with ferro's "
                               "calls (JAX's own dispatch, about 350 us a call) instead of "
                               "ferro-jax's ordering by the effect alone")

#: every setting, by variable name, in the order of the README's table
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    TOKEN, TRANSPORT, TCP_CONNECT, TCP_READER, NODE_ID, HOST_RANKS, MASTER_PORT, MASTER_ADDR, HIERARCHY,
    TIMEOUT, RESTART_COUNT, ELASTIC, ELASTIC_TIMEOUT, TRACE,
    LOG_LEVEL, SHM_ENGINE, SHM_SLOT_BYTES, SHM_SPLIT_BYTES, SHM_STREAM_BYTES, SHM_BIND,
    SHM_REPROBE, SHM_RING_BYTES,
    SHM_CMA, SHM_YIELDS,
    SHM_RING_YIELDS, ASYNC_WORKERS, SCRATCH_BYTES,
    COLLECTIVE_CHECK, BACKGROUND, TRACEBACK, JAX_RUNTIME_TOKENS)}
_BY_ATTR = {key: value for key, value in globals().items() if isinstance(value, Setting)}


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Use these values (by attribute name: ``SHM_ENGINE=False``) instead of the environment's
    inside the block; None means unset (the default)."""
    unknown = sorted(set(values) - set(_BY_ATTR))
    if unknown:
        raise TypeError(f"settings.override: no settings {unknown}; known: {sorted(_BY_ATTR)}")
    saved = dict(_overrides)
    for key, value in values.items():
        setting = _BY_ATTR[key]
        _overrides[setting.name] = setting.default if value is None else value
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if value is True or value is False:
        return "1" if value else "0"
    if isinstance(value, int) and value >= 1 << 62:
        return "inf"
    if isinstance(value, int) and value >= 1 << 10 and value % (1 << 10) == 0:
        return f"{value >> 20}M" if value % (1 << 20) == 0 else f"{value >> 10}k"
    return str(value)


def markdown_table() -> str:
    """The README's table of variables: one row per setting."""
    rows = ["| variable | takes | default | read by | what it does |", "|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.kind} | {_shown(s.default)} | {s.readers} | {s.doc} |"
             for s in SETTINGS.values()]
    return "\n".join(rows)


__all__ = ["PREFIX", "SETTINGS", "Setting", "markdown_table", "override", *sorted(_BY_ATTR)]

"""ferro_backend.settings: one table of every FERRO_* variable, the README's table equal to it,
and no other module of any ferro distribution naming a FERRO_* variable."""

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ferro_backend
from ferro_backend import SettingError, settings

PACKAGE = Path(__file__).resolve().parent.parent
README = PACKAGE / "README.md"
SOURCES = PACKAGE.parent  # packages/: every distribution's src tree
NAME = re.compile(r"^FERRO_[A-Z0-9_]+$")


def test_readme_table_is_the_settings_table():
    text = README.read_text()
    table = settings.markdown_table()
    assert table in text, "packages/ferro-backend/README.md's table of variables differs from " \
        "settings.markdown_table(): paste the latter into the README"
    documented = set(re.findall(r"^\| `(FERRO_[A-Z0-9_]+)` \|", text, re.M))
    assert documented == set(settings.SETTINGS)


#: the names of the engine door's constants (ferro/engine.h: its statuses, dtypes, ops), which
#: a client may spell out (a status name in a message) without reading any variable
DOOR_NAMES = set(re.findall(r"^\s+(FERRO_[A-Z0-9_]+) = ", (
    Path(ferro_backend.get_include()) / "ferro" / "engine.h").read_text(), re.M))


def _named_variables(path: Path) -> list[str]:
    """The FERRO_* variable names a source file spells out (string constants that are exactly
    a name; docstrings and messages that mention one in a sentence do not count; nor do the
    door's constants)."""
    text = path.read_text()
    if path.suffix == ".py":
        names = [node.value for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and NAME.match(node.value)]
    else:
        names = re.findall(r"[\"'](FERRO_[A-Z0-9_]+)[\"']", text)  # Cython kernels
    return [n for n in names if n not in DOOR_NAMES]


def test_no_other_module_reads_a_ferro_variable():
    sources = [p for p in SOURCES.glob("*/src/**/*") if p.suffix in (".py", ".pyx")]
    assert len(sources) > 50, f"found only {len(sources)} source files under {SOURCES}"
    offenders = {str(p.relative_to(SOURCES)): names for p in sources
                 if p.name != "settings.py" and (names := _named_variables(p))}
    assert not offenders, f"FERRO_* variables named outside ferro_backend.settings: {offenders}"


def test_every_setting_is_declared_once_with_a_doc():
    names = [s.name for s in settings.SETTINGS.values()]
    assert len(names) == len(set(names))
    for s in settings.SETTINGS.values():
        assert s.name.startswith(settings.PREFIX) and s.doc and s.kind and s.readers


@pytest.mark.parametrize("raw, value", [("4096", 4096), ("64k", 64 << 10), ("1M", 1 << 20),
                                        ("2MiB", 2 << 20), (" 1g ", 1 << 30), ("inf", 1 << 62)])
def test_byte_counts(raw, value):
    assert settings.SHM_SPLIT_BYTES.parse(raw) == value


@given(st.integers(0, 1 << 40), st.sampled_from(["", "k", "K", "m", "M", "g"]))
def test_byte_counts_any_number_and_unit(number, unit):
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]
    assert settings.SHM_SPLIT_BYTES.parse(f"{number}{unit}") == number * scale


@pytest.mark.parametrize("setting, raw, expected", [
    (settings.SHM_SLOT_BYTES, "12", "a byte count >= 64"),
    (settings.SHM_RING_BYTES, "5000", "a power of two >= 4096"),
    (settings.TRANSPORT, "carrier-pigeon", "one of tcp, shm, mpi"),
    (settings.SHM_ENGINE, "maybe", "1/0, true/false"),
    (settings.TIMEOUT, "nan", "a number of seconds > 0 (inf: no deadline)"),
    (settings.TIMEOUT, "-1", "a number of seconds > 0 (inf: no deadline)"),
    (settings.TIMEOUT, "0", "a number of seconds > 0"),  # (every call then failed to connect)
    (settings.ELASTIC_TIMEOUT, "-1", "a number of seconds >= 0"),
    (settings.MASTER_PORT, "70000", "a TCP port"),
    (settings.ASYNC_WORKERS, "0", "a whole number >= 1"),
])
def test_bad_values_name_the_variable_and_what_was_expected(monkeypatch, setting, raw, expected):
    monkeypatch.setenv(setting.name, raw)
    with pytest.raises(SettingError, match=re.escape(f"{setting.name} {raw!r}")) as info:
        setting.get()
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unset_and_empty_give_the_default(monkeypatch):
    monkeypatch.delenv("FERRO_SHM_SLOT_BYTES", raising=False)
    assert settings.SHM_SLOT_BYTES.get() == 1 << 20
    monkeypatch.setenv("FERRO_SHM_SLOT_BYTES", "  ")
    assert settings.SHM_SLOT_BYTES.get() == 1 << 20
    assert settings.SHM_SLOT_BYTES.get({"FERRO_SHM_SLOT_BYTES": "8k"}) == 8192


def test_a_changed_environment_is_seen_at_once(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_CMA", "always")
    assert settings.SHM_CMA.get() == "always"
    monkeypatch.setenv("FERRO_SHM_CMA", "0")  # the old spelling of "never"
    assert settings.SHM_CMA.get() == "never"


def test_override_wins_over_the_environment_and_ends_with_the_block(monkeypatch):
    monkeypatch.setenv("FERRO_SHM_ENGINE", "1")
    with settings.override(SHM_ENGINE=False, TIMEOUT=2.5):
        assert settings.SHM_ENGINE.get() is False and settings.TIMEOUT.get() == 2.5
        assert settings.SHM_ENGINE.get({"FERRO_SHM_ENGINE": "1"}) is True  # explicit mapping
    assert settings.SHM_ENGINE.get() is True
    with pytest.raises(TypeError, match="no settings"):
        with settings.override(NO_SUCH=1):
            pass


@pytest.mark.parametrize("raw", ["inf", str(1 << 62), "2g"])
def test_engine_sizes_beyond_a_gib_are_refused_naming_the_variable(monkeypatch, raw):
    """FERRO_SHM_SLOT_BYTES=inf (a documented byte count) overflowed the segment's size: a
    segment too small, written past (SIGSEGV)."""
    for name in ("FERRO_SHM_SLOT_BYTES", "FERRO_SHM_RING_BYTES"):
        monkeypatch.setenv(name, raw)
        setting = settings.SHM_SLOT_BYTES if "SLOT" in name else settings.SHM_RING_BYTES
        with pytest.raises(SettingError, match=re.escape(f"{name} {raw!r}") + f".*<= {1 << 30}"):
            setting.get()
        monkeypatch.delenv(name)


def test_an_engine_refuses_a_slot_beyond_a_gib_before_it_maps_anything():
    from ferro_backend import SimulatedBackend
    from ferro_backend.engine.segment import Engine

    (b,) = SimulatedBackend.create_group(1)
    with pytest.raises(ValueError, match="slot_bytes 4611686018427387904, expected an int"):
        Engine.join(b, slot_bytes=1 << 62)

"""One process: the build cache (one build when every rank builds at once), the calls on one
rank, the effect that orders them, argument checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import ferro_jax as fj
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ferro_jax import _build
from hypothesis import given, settings
from hypothesis import strategies as st

from ferro_backend import InvalidRankError, SimulatedBackend


@pytest.fixture(scope="module")
def one():
    backend = SimulatedBackend.create_group(1)[0]
    fj.init(backend)
    return backend


def test_the_handlers_build_once_when_every_rank_builds_at_once(tmp_path):
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx.sh"
    real = _build.compiler()
    wrapper.write_text(f"#!/bin/sh\necho x >> {log}\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    code = textwrap.dedent(f"""
        from ferro_jax import _build
        _build.set_cache_dir({str(tmp_path / "cache")!r})
        lib = _build.load()
        print(lib.ferro_jax_attach is not None)
    """)
    env = dict(os.environ, CXX=str(wrapper))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert log.read_text().count("x") == 1
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([f for f in files if f.endswith(".so")]) == 1, files
    assert not [f for f in files if f.startswith(".build-")], files


def test_the_cache_key_names_what_the_binary_depends_on(monkeypatch, tmp_path):
    before = _build.key()
    monkeypatch.setattr(_build, "SOURCE", tmp_path / "other.cc")
    (tmp_path / "other.cc").write_text("int x;\n")
    assert _build.key() != before


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    _build.set_cache_dir(tmp_path)
    try:
        monkeypatch.setattr(_build, "SOURCE", tmp_path / "broken.cc")
        (tmp_path / "broken.cc").write_text("this is not C++\n")
        with pytest.raises(_build.BuildError, match="failed"):
            _build.build()
    finally:
        _build.set_cache_dir(None)


def test_every_call_on_one_rank_in_and_out_of_jit(one):
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)

    def calls(x):
        return [fj.allreduce(x), fj.allreduce(x, "mean"), fj.reduce_scatter(x), fj.all_gather(x),
                fj.broadcast(x), fj.all_to_all(x), fj.reduce(x), fj.allreduce(x, "max")]

    for got in (calls(x), jax.jit(calls)(x)):
        for y in got:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert fj.barrier() is None
    assert "Python path" in repr(fj.comm())


def _main_signature(text: str) -> str:
    return next(line for line in text.splitlines() if "func.func public @main" in line)


def test_the_calls_carry_an_ordered_effect_and_thread_its_token(one):
    f = jax.jit(lambda x: fj.allreduce(fj.allreduce(x)) + fj.all_gather(x))
    assert fj.EFFECT in jax.make_jaxpr(f)(jnp.ones(2)).effects
    text = f.lower(jnp.ones(2)).as_text()
    # the token starts inside the computation (no token argument or result: JAX's fast path)
    assert "token" not in _main_signature(text)
    created = re.findall(r"(%\w+) = stablehlo.create_token", text)
    assert len(created) == 1, text
    calls = re.findall(r"(%\w+):2 = stablehlo.custom_call @ferro_jax_py\((%[\w#]+),", text)
    assert len(calls) == 3, text
    # a chain: the first call takes the created token, each next one the previous one's
    assert calls[0][1] == created[0]
    for (prev, _), (_, tok) in zip(calls, calls[1:]):
        assert tok == prev + "#0", (prev, tok)


def test_a_jitted_call_has_no_runtime_token_and_takes_the_fast_path(one):
    from ferro_jax import _dispatch

    assert _dispatch.ACTIVE
    f = jax.jit(lambda x: fj.allreduce(x) * 2)
    call = f.lower(jnp.ones(2)).compile()._executable.unsafe_call
    assert not call.ordered_effects and not call.has_unordered_effects
    np.testing.assert_array_equal(np.asarray(f(jnp.ones(2))), np.full(2, 2.0))
    # loops, conds and nested jits thread the same token (they carry the effect inside)
    g = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, v: jax.jit(fj.allreduce)(v) + 1,
                                            fj.barrier(token=x)[1]))
    assert "token" not in _main_signature(g.lower(jnp.ones(2)).as_text())
    np.testing.assert_array_equal(np.asarray(g(jnp.ones(2))), np.full(2, 4.0))


def test_tokens_by_hand_are_accepted_and_returned(one):
    token = fj.create_token()
    y, token = fj.allreduce(jnp.ones(3), token=token)
    token = fj.barrier(token=token)
    z, token = jax.jit(lambda x, t: fj.broadcast(x, token=t))(y, token)
    np.testing.assert_array_equal(np.asarray(z), np.ones(3))


def test_gradients_on_one_rank(one):
    from jax.test_util import check_grads

    x = jnp.arange(4.0, dtype=jnp.float32)
    check_grads(lambda x: fj.allreduce(x) ** 2, (x,), order=2, modes=["fwd", "rev"], rtol=2e-2)
    check_grads(lambda x: fj.all_gather(x) * 3, (x,), order=1, modes=["fwd", "rev"])
    g = jax.grad(lambda x: fj.reduce_scatter(x * x).sum())(x)
    np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda x: fj.allreduce(x, "max").sum())(x)


@pytest.mark.parametrize("call, match, exc", [
    (lambda: fj.allreduce(jnp.ones(2), "median"), "unknown op", ValueError),
    (lambda: fj.allreduce(jnp.ones(2), "band"), "bitwise", TypeError),
    (lambda: fj.allreduce(jnp.ones(2, jnp.int32), "mean"), "mean", TypeError),
    (lambda: fj.allreduce(jnp.ones(2, bool), "sum"), "bool", TypeError),
    (lambda: fj.broadcast(jnp.ones(2), root=3), "rank 3", InvalidRankError),
    (lambda: fj.reduce_scatter(jnp.ones(())), "divisible", ValueError),
    (lambda: fj.allreduce(jnp.ones(2), timeout=-1), "timeout", ValueError),
])
def test_bad_arguments_are_refused_before_any_call(one, call, match, exc):
    with pytest.raises(exc, match=match):
        call()


def test_no_backend_is_a_clear_error(monkeypatch):
    from ferro_jax import _api

    monkeypatch.setattr(_api, "_default", None)
    with pytest.raises(RuntimeError, match="init"):
        fj.allreduce(jnp.ones(2))


def test_the_package_ships_the_handlers_source():
    here = Path(fj.__file__).parent
    assert (here / "_handlers.cc").is_file()
    assert fj.__version__


def test_every_binding_a_record_names_exists():
    """A collective's record (ferro_collective.records) names its ferro-jax function; each
    exists, and every collective ferro-jax offers has a record naming it."""
    import ferro_jax

    from ferro_collective import records

    named = {c.jax for c in records.ALL if c.jax}
    assert named == {"allreduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                     "reduce", "all_to_all"}
    for name in named:
        assert callable(getattr(ferro_jax, name)), name


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16", "float8_e4m3fn",
                              "int8", "uint16", "int64", "bool", "complex64"]),
       shape=st.lists(st.integers(0, 5), max_size=3))
def test_the_python_paths_views_are_xlas_buffers(dtype, shape):
    """The Python path reads and writes XLA's buffers through views at their addresses
    (``__array_interface__``: 1.3 us a view against 3.0 through a ctypes array): every dtype
    JAX has on CPU, ml_dtypes' too, any shape, 0-d and empty included."""
    import ml_dtypes
    from ferro_jax import _pypath

    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    buf = (np.arange(int(np.prod(shape)), dtype=np.int64) % 3).astype(dt).reshape(shape)
    v = _pypath.view(buf.ctypes.data, shape, dt)
    assert v.dtype == dt and v.shape == tuple(shape) and v.flags.writeable
    assert v.tobytes() == buf.tobytes()
    if buf.size:
        v[...] = np.ones(shape, dt)
        assert buf.tobytes() == np.ones(shape, dt).tobytes()  # the same memory


def test_a_call_site_keeps_its_views_by_address_and_reads_what_is_there_now():
    from ferro_jax import _pypath

    views = _pypath.Views((4,), np.float32)
    bufs = [np.full(4, k, np.float32) for k in range(_pypath.Views.KEEP + 2)]
    first = views(bufs[0].ctypes.data)
    assert views(bufs[0].ctypes.data) is first  # kept: no new view
    bufs[0][...] = 7  # a view reads the memory as it is when used
    assert views(bufs[0].ctypes.data).tolist() == [7.0] * 4
    for k, b in enumerate(bufs):  # past KEEP addresses the kept ones start again
        assert views(b.ctypes.data).tolist() == [7.0 if k == 0 else float(k)] * 4
    assert len(views._made) <= _pypath.Views.KEEP

"""What the ranks of the multi-process tests run (module-level: run_processes imports them).

Each rank regenerates every rank's input from the rank's number, so it computes numpy's
reference of every call by itself; a rank returns its results' bytes' digest too, so the test
checks that every rank got the same bits.
"""

from __future__ import annotations

import hashlib
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import ferro_jax as fj  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
WIDE = (np.dtype(np.float16), BF16)
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor, "mean": np.add}


def ops_for(dtype: np.dtype) -> list[str]:
    if dtype == np.bool_:
        return ["band", "bor", "bxor"]
    if dtype.kind in "iu":
        return ["sum", "prod", "max", "min", "band", "bor", "bxor"]
    if dtype.kind == "c":
        return ["sum", "mean"]
    return ["sum", "prod", "max", "min", "mean"]


def data(rank: int, dtype: np.dtype, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    count = int(np.prod(shape))
    if dtype == np.bool_:
        x = rng.integers(0, 2, count).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    elif dtype.kind == "c":
        x = (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    else:
        x = (rng.standard_normal(count) * 8).astype(dtype)
    return x.reshape(shape)


def fold(op: str, dtype: np.dtype, inputs: list[np.ndarray]) -> np.ndarray:
    """The engine's fold: rank order; float16/bfloat16 in float32, rounded once; mean's
    divide last (complex: as pairs of floats)."""
    if dtype.kind == "c":
        pairs = [x.view(x.real.dtype) for x in inputs]
        return fold(op, pairs[0].dtype, pairs).view(dtype)
    work = [x.astype(np.float32) for x in inputs] if dtype in WIDE else inputs
    acc = work[0].copy()
    with np.errstate(all="ignore"):
        for x in work[1:]:
            acc = UFUNC[op](acc, x)
        if op == "mean" and len(work) > 1:
            acc = np.divide(acc, len(work)).astype(acc.dtype)
    return acc.astype(dtype) if dtype in WIDE else acc


def expected(dtype: np.dtype, n: int, rank: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    xs = [data(r, dtype, shape) for r in range(n)]
    k = shape[0] // n
    out = {}
    for op in ops_for(dtype):
        full = fold(op, dtype, xs)
        out[f"allreduce_{op}"] = full
        out[f"reduce_scatter_{op}"] = full[rank * k:(rank + 1) * k]
        if op in ("sum", "bxor"):
            out[f"reduce_{op}"] = full if rank == n - 1 else np.zeros_like(full)
    out["all_gather"] = np.concatenate(xs)
    out["broadcast"] = xs[n - 1]
    out["all_to_all"] = np.concatenate([xs[r][rank * k:(rank + 1) * k] for r in range(n)])
    return out


def calls(x, dtype: np.dtype, n: int) -> dict:
    """Every collective on ``x``: what :func:`expected` names."""
    out = {}
    for op in ops_for(dtype):
        out[f"allreduce_{op}"] = fj.allreduce(x, op)
        out[f"reduce_scatter_{op}"] = fj.reduce_scatter(x, op)
        if op in ("sum", "bxor"):
            out[f"reduce_{op}"] = fj.reduce(x, n - 1, op)
    out["all_gather"] = fj.all_gather(x)
    out["broadcast"] = fj.broadcast(x, root=n - 1)
    out["all_to_all"] = fj.all_to_all(x)
    return out


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def every_call(backend, dtype_names: list[str], eager_names: list[str]) -> dict:
    """Every call on every dtype in ``dtype_names`` inside jit (one jitted function per dtype)
    and, for ``eager_names``, outside jit; compared with numpy bit for bit. Returns the digest
    of every result and the names that differed."""
    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    shape = (2 * n, 3)
    bad, digest = [], hashlib.sha256()
    for name in dtype_names:
        dtype = BF16 if name == "bfloat16" else np.dtype(name)
        want = expected(dtype, n, rank, shape)
        x = jnp.asarray(data(rank, dtype, shape))
        runs = [("jit", jax.jit(lambda x, dt=dtype: calls(x, dt, n))(x))]
        if name in eager_names:
            runs.append(("eager", calls(x, dtype, n)))
        for how, got in runs:
            for key, value in got.items():
                value = np.asarray(value)
                if key.startswith(("allreduce", "all_gather", "broadcast")):  # every rank's
                    digest.update(_bits(value))
                if value.dtype != want[key].dtype or _bits(value) != _bits(want[key]):
                    bad.append(f"{name} {how} {key}")
    return {"bad": bad, "digest": digest.hexdigest(), "comm": repr(fj.comm())}


def scalars_and_barrier(backend) -> list:
    """0-d inputs, barrier, a zero-size array."""
    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    f = jax.jit(lambda s: (fj.all_gather(s), fj.allreduce(s), fj.broadcast(s, 0),
                           fj.allreduce(jnp.zeros((0, 2))), fj.barrier()))
    g, s, b, z, _ = f(jnp.float32(rank + 1))
    fj.barrier()
    return [np.asarray(g).tolist(), float(s), float(b), list(z.shape), n]


def odd_arrays(backend) -> list:
    """What a bug hunt found on the Python path and the door: point-to-point calls of 0-d
    complex and bfloat16, of zero-size arrays of two dims, of float8_e5m2 (numpy does not read
    its type string), in and out of jit; int4 refused before any call (XLA packs two a byte)."""
    fj.init(backend)
    rank, peer = backend.rank, 1 - backend.rank
    out = []
    for x in (jnp.complex64(1 + 2j) * (rank + 1), jnp.bfloat16(rank + 1),
              jnp.zeros((0, 3)), jnp.zeros((0,), jnp.bfloat16),
              jnp.arange(4).astype(ml_dtypes.float8_e5m2) + rank):
        for how, call in (("eager", fj.sendrecv), ("jit", jax.jit(fj.sendrecv,
                                                                  static_argnums=(1, 2)))):
            got = np.asarray(call(x, peer, peer))
            out.append((how, str(got.dtype), list(got.shape),
                         got.astype(np.complex128).tolist() if got.size else []))
    try:
        fj.all_gather(jnp.ones(4, ml_dtypes.int4))
        out.append("int4 gathered")
    except TypeError as exc:
        out.append(str(exc))
    fj.barrier()
    return out


def ordering(backend, rounds: int) -> list:
    """Send and receive inside one jitted function, in an order XLA could reorder (no data
    dependence between the send and the receive), many times over."""
    fj.init(backend)
    rank, peer = backend.rank, 1 - backend.rank
    x = jnp.arange(1000.0) + rank

    @jax.jit
    def step(x):
        if rank == 0:
            fj.send(x, peer, tag=1)
            fj.send(x * 2, peer, tag=2)
            y = fj.recv(x, peer, tag=3)
            z = fj.allreduce(x)
        else:
            a = fj.recv(x, peer, tag=1)
            b = fj.recv(x, peer, tag=2)
            fj.send(a + b, peer, tag=3)
            y = a
            z = fj.allreduce(x)
        return y, z

    for _ in range(rounds):
        y, z = step(x)
    ys = [float(v) for v in (y[0], y[999], z[0])]
    swapped = jax.jit(lambda x: fj.sendrecv(x, peer, peer, tag=4))(x)
    t = fj.create_token()
    a, t = fj.allreduce(x, token=t)
    t = fj.barrier(token=t)
    return ys + [float(swapped[0]), float(a[0])]


def chained(backend, rounds: int) -> dict:
    """The token chain inside a computation and the order between computations: many
    independent door calls in one jitted function (XLA:CPU's thunk executor runs independent
    custom calls concurrently: the chain must keep them one at a time, or the door refuses the
    second as busy); calls around a loop and a cond of calls on independent data; jitted calls
    dispatched back to back with no wait between them (no runtime token: the CPU client runs
    them in dispatch order), send and recv in opposite program orders on the two ranks."""
    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    peer = (rank + 1) % n
    xs = [jnp.full(1024, float(100 * rank + i), jnp.float32) for i in range(12)]
    many = jax.jit(lambda xs: [fj.allreduce(x) for x in xs])
    for _ in range(rounds):
        outs = many(xs)
    many_ok = [float(np.asarray(o)[0]) for o in outs] == [
        float(sum(100 * r + i for r in range(n))) for i in range(12)]

    @jax.jit
    def nested(x, y):
        a = fj.allreduce(x)
        b = jax.lax.fori_loop(0, 3, lambda i, v: fj.allreduce(v) / n, y)
        c = jax.lax.cond(y[0] > -1, fj.all_gather, lambda v: fj.all_gather(v * 0), y)
        d = fj.broadcast(y * 2, root=n - 1)
        return a, b, c, d

    x, y = jnp.arange(2048.0) + rank, jnp.ones(2048) * (rank + 1)
    for _ in range(rounds):
        a, b, c, d = nested(x, y)
    mean_y = sum(range(1, n + 1)) / n
    nested_ok = [bool(np.array_equal(np.asarray(a), sum(np.arange(2048.0) + r for r in range(n)))),
                 bool(np.allclose(np.asarray(b), mean_y)),
                 bool(np.array_equal(np.asarray(c), np.concatenate(
                     [np.ones(2048) * (r + 1) for r in range(n)]))),
                 bool(np.array_equal(np.asarray(d), np.ones(2048) * 2 * n))]

    send = jax.jit(lambda v: fj.send(v, peer, tag=7))
    recv = jax.jit(lambda v: fj.recv(v, (rank - 1) % n, tag=7))
    got = []
    for i in range(rounds):  # no wait between the dispatches
        v = jnp.full(256, float(1000 * rank + i))
        if rank % 2 == 0:
            send(v)
            got.append(recv(v))
        else:
            got.append(recv(v))
            send(v)
    src = (rank - 1) % n
    p2p_ok = [float(np.asarray(g)[0]) for g in got] == [float(1000 * src + i)
                                                        for i in range(rounds)]
    fj.barrier()
    return {"many": many_ok, "nested": nested_ok, "p2p": p2p_ok}


def grads(backend) -> dict:
    """Forward-mode checks (jax.test_util.check_grads, fwd) of every differentiable call, and the
    reverse mode against the transpose's identity summed over the ranks:
    sum_r <ct_r, (J t)_r> == sum_r <(J^T ct)_r, t_r>."""
    from jax.test_util import check_grads

    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    peer_up, peer_down = (rank + 1) % n, (rank - 1) % n
    fns = {
        "allreduce_sum": lambda x: fj.allreduce(x) * 3,
        "allreduce_mean": lambda x: fj.allreduce(x, "mean") ** 2,
        "all_gather": lambda x: fj.all_gather(x) * 2,
        "reduce_scatter": lambda x: fj.reduce_scatter(x),
        "reduce_scatter_mean": lambda x: fj.reduce_scatter(x, "mean"),
        "broadcast": lambda x: fj.broadcast(x, root=n - 1) * 2,
        "reduce": lambda x: fj.reduce(x, root=0),
        "all_to_all": lambda x: fj.all_to_all(x),
        "sendrecv": lambda x: fj.sendrecv(jnp.sin(x), peer_up, peer_down),
    }
    x = jnp.asarray(data(rank, np.dtype(np.float64), (2 * n, 2)))
    out = {}
    for name, f in fns.items():
        check_grads(f, (x,), order=2 if name == "allreduce_mean" else 1, modes=["fwd"])
        t = jnp.asarray(data(rank, np.dtype(np.float64), x.shape, salt=1))
        y, jt = jax.jvp(f, (x,), (t,))
        ct = jnp.asarray(data(rank, np.dtype(np.float64), y.shape, salt=2))
        _, vjp = jax.vjp(f, x)
        (jtct,) = jax.jit(vjp)(ct)
        lhs = fj.allreduce(jnp.vdot(ct, jt))
        rhs = fj.allreduce(jnp.vdot(jtct, t))
        out[name] = [float(lhs), float(rhs)]
    # data parallel: the gradient of the mean loss, averaged inside jit, equals numpy's
    w = jnp.ones(3)
    xs = jnp.asarray(data(rank, np.dtype(np.float64), (5, 3), salt=3))

    @jax.jit
    def grad_step(w):
        g = jax.grad(lambda w: jnp.mean((xs @ w) ** 2))(w)
        return fj.allreduce(g, "mean")

    everyone = [data(r, np.dtype(np.float64), (5, 3), salt=3) for r in range(n)]
    want = np.mean([2 * a.T @ (a @ np.ones(3)) / 5 for a in everyone], axis=0)
    out["dp"] = bool(np.allclose(np.asarray(grad_step(w)), want, rtol=1e-12))
    return out


def differentiation_disagrees(backend) -> dict:
    """Rank 0 differentiates a broadcast, its peers pass a constant (they make no derivative
    call): every rank gets the mismatch, with the hint, in and out of jit, at the forward call,
    and the communicator goes on. Then the fix (p * 0) and marked calls of the shapes the
    Python path views differently (a 0-d all_gather, a reduce_scatter) against the formula."""
    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    p = jnp.arange(1.0, 4.0) * (rank + 1)

    def loss(p, dummy):
        x = p if rank == 0 else dummy(p)
        return jnp.sum(fj.broadcast(x, root=0, timeout=30) * (rank + 1))

    out = {}
    for how, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        try:
            with fj.typed_errors():
                np.asarray(wrap(jax.grad(lambda p: loss(p, jnp.zeros_like)))(p))
            out[how] = "no error"
        except Exception as exc:
            out[how] = f"{type(exc).__name__}: {exc}"
    fj.barrier(timeout=30)
    out["fixed"] = np.asarray(jax.jit(jax.grad(lambda p: loss(p, lambda p: p * 0)))(p)).tolist()

    def shapes(q):
        gathered = fj.all_gather(jnp.sum(q), timeout=30)  # 0-d in, (n,) out
        scattered = fj.reduce_scatter(jnp.tile(q, n), timeout=30)
        return jnp.sum(gathered ** 2) + jnp.sum(scattered ** 2)

    qs = [np.arange(1.0, 4.0) * (r + 1) for r in range(n)]
    want = 2 * n * qs[rank].sum() + 2 * n * np.sum(qs, axis=0)
    got = [np.asarray(g(p)) for g in (jax.grad(shapes), jax.jit(jax.grad(shapes)))]
    out["shapes"] = [bool(np.allclose(g, want, rtol=1e-12)) for g in got]
    return out


def _wait_until(ready, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not ready() and time.monotonic() < end:
        time.sleep(0.05)
    return bool(ready())


def late_peer(backend, flags: str) -> list:
    """Rank 0's jitted allreduce times out (1 s) while rank 1 has not called; rank 1's call,
    late, could take rank 0's contribution from the engine's slots and return [102, 102, 102].
    Now rank 0's door aborts the backend and the late call raises. Both ranks compile first
    (the deadline times the call, not the trace); rank 1 calls once rank 0's abort has reached
    it (late by construction, not by a sleep a slow compile of rank 0's can outlast), and rank 0
    keeps its backend open until rank 1 has its answer (a file in ``flags``). Returns [whether
    the abort had come (rank 1), what the call returned or raised]."""
    import pathlib

    fj.init(backend)
    me = backend.rank
    answered = pathlib.Path(flags) / "rank1-done"
    x = jnp.full(3, 100.0 if me == 0 else 2.0)
    call = jax.jit(lambda x: fj.allreduce(x, timeout=1.0 if me == 0 else 20.0)).lower(x).compile()
    told = me == 0 or _wait_until(lambda: backend.peer_failure("allreduce", 0) is not None)
    try:
        with fj.typed_errors():
            got = call(x)
            out = str(np.asarray(got).tolist())
    except Exception as exc:
        out = f"{type(exc).__name__}: {exc}"
    if me == 1:
        answered.touch()
    else:
        _wait_until(answered.exists)
    return [told, out]


def mismatch(backend) -> str:
    """Ranks call allreduce on different shapes inside jit: every rank gets the mismatch."""
    fj.init(backend)
    shape = (4,) if backend.rank == 0 else (5,)
    try:
        with fj.typed_errors():
            jax.jit(fj.allreduce)(jnp.ones(shape)).block_until_ready()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def vmapped(backend) -> list:
    """vmap: the collectives batched exactly, point-to-point refused."""
    fj.init(backend)
    n, rank = backend.world_size, backend.rank
    xb = jnp.asarray(data(rank, np.dtype(np.float32), (3, 2 * n, 2)))  # batch of 3
    got = {"allreduce": jax.vmap(fj.allreduce)(xb), "all_gather": jax.vmap(fj.all_gather)(xb),
           "reduce_scatter": jax.vmap(fj.reduce_scatter)(xb),
           "all_to_all": jax.vmap(fj.all_to_all)(xb),
           "gather_scalars": jax.vmap(fj.all_gather)(xb[:, 0, 0])}
    want = {k: jnp.stack([f(xb[i]) for i in range(3)]) for k, f in
            [("allreduce", fj.allreduce), ("all_gather", fj.all_gather),
             ("reduce_scatter", fj.reduce_scatter), ("all_to_all", fj.all_to_all),
             ("gather_scalars", lambda v: fj.all_gather(v[0, 0]))]}
    same = [k for k in got if np.array_equal(np.asarray(got[k]), np.asarray(want[k]))]
    try:
        jax.vmap(lambda v: fj.send(v, (rank + 1) % n))(xb)
        refused = "no error"
    except NotImplementedError as exc:
        refused = str(exc)
    return [sorted(same), refused]


def overhead(backend, count: int, calls: int) -> float:
    """Seconds per allreduce of ``count`` float32 inside a jitted loop."""
    fj.init(backend)
    x = jnp.ones(count, jnp.float32)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, calls, lambda i, v: fj.allreduce(v) * 0.5, x))
    loop(x).block_until_ready()
    t = time.perf_counter()
    loop(x).block_until_ready()
    return (time.perf_counter() - t) / calls


def reprobes_inside_jit(backend, seconds: float) -> list:
    """Jitted allreduces (the door called from XLA's thread) for ``seconds``, every rank
    stopping after the same call; the engine's probe numbers before and after, and whether
    every result was right."""
    fj.init(backend)
    n = backend.world_size
    x = np.ones(1024, np.float32)
    f = jax.jit(lambda x: fj.allreduce(x)).lower(jnp.asarray(x)).compile()  # not in `seconds`
    first, right, end = backend.engine.link.probe, True, time.monotonic() + seconds
    while True:
        x[1] = time.monotonic() > end
        got = np.asarray(f(jnp.asarray(x)))
        right = right and got[0] == n
        if got[1]:
            break
    return [first, backend.engine.link.probe, right]


def closed_then_again(backend) -> list:
    """A subgroup with an engine as the default, closed: eager calls (barrier's too) raise
    PeerClosedError; a second one made the default: a function jitted for the first runs on
    the second (JAX's cache held the first's closed communicator in the compiled call)."""
    from ferro_backend import PeerClosedError, SubBackend
    from ferro_backend.engine import attach_engine

    out = []
    first = SubBackend(backend, range(backend.world_size), name="first")
    attach_engine(first)
    fj.init(first)
    step = jax.jit(fj.allreduce)
    out.append(np.asarray(step(jnp.full(2, 1.0 + backend.rank))).tolist())
    fj.barrier()
    first.close()
    for name, call in (("barrier", fj.barrier), ("allreduce", lambda: fj.allreduce(jnp.ones(2)))):
        try:
            call()
            out.append(f"{name} ran")
        except PeerClosedError:
            out.append(f"{name} closed")
        except Exception as exc:
            out.append(f"{name} {type(exc).__name__}: {exc}")
    second = SubBackend(backend, range(backend.world_size), name="second")
    attach_engine(second)
    fj.init(second)
    with fj.typed_errors():
        out.append(np.asarray(step(jnp.full(2, 10.0 * (1 + backend.rank)))).tolist())
    return out

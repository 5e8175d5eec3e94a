"""Rank programs for the tests: ``python workers.py SCENARIO`` in each rank's process (under
ferrorun, torchrun or tests/_launch.py). A rank writes its results as JSON to
``$TEST_RESULT_DIR/rank<r>.json`` and exits 0 when its checks pass; a failed check raises
(exit 1, the assertion on stderr)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import ferro_torch  # noqa: E402 - registers "ferro" (after the thread cap)

R = dist.ReduceOp
RANK = int(os.environ.get("RANK", "0"))
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def report(**kw) -> None:
    """This rank's result: a file in TEST_RESULT_DIR (ranks' output may interleave)."""
    with open(os.path.join(os.environ["TEST_RESULT_DIR"], f"rank{kw['rank']}.json"), "w") as f:
        json.dump(kw, f)
    print(f"rank {kw['rank']} done", flush=True)


def init(timeout: float = 60.0, **kw) -> str:
    """init_process_group("ferro"); the kind of backend it runs ("compiled" or "python")."""
    dist.init_process_group("ferro", timeout=timedelta(seconds=timeout), **kw)
    assert dist.get_backend() == "ferro", dist.get_backend()
    kind = ferro_torch.backend_kind()
    world = dist.group.WORLD
    if kind == "python":
        assert isinstance(world, ferro_torch.ProcessGroupFerro), world
    else:
        assert type(world._get_backend(torch.device("cpu"))).__name__ == "FerroBackend", world
    return kind


# ----------------------------------------------------------------------------- inputs
def make(shape, dtype, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 1009 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(1, 4, shape, generator=g, dtype=dtype)  # PRODUCT stays small


def reference_reduce(shape, dtype, n: int, salt: int, op) -> torch.Tensor:
    xs = [make(shape, dtype, r, salt) for r in range(n)]
    if op in (R.BAND, R.BOR, R.BXOR):
        f = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        return acc
    s = torch.stack([x.double() for x in xs])
    out = {R.SUM: s.sum(0), R.AVG: s.mean(0), R.MIN: s.min(0).values, R.MAX: s.max(0).values,
           R.PRODUCT: s.prod(0)}[op]
    return out.to(dtype)


def same(got, want, exact: bool, what: str) -> None:
    got, want = list(got), list(want)
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        if exact:
            assert torch.equal(g, w), f"{what}: not bit-identical\n{g}\n{w}"
        else:
            tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(g.dtype, 1e-5)
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=what)


# ----------------------------------------------------------------------------- collectives
def collective_cases(n: int, me: int):
    """(name, dtype, op-or-None, run(group) -> list of result tensors)."""
    cases = []
    for dtype in (*FLOATS, torch.int32, torch.int64, torch.bool):
        ops = [R.SUM, R.MIN, R.MAX, R.PRODUCT]
        if dtype.is_floating_point:
            ops.append(R.AVG)
        else:
            ops += [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            def ar(group, dtype=dtype, op=op):
                t = make((6, 5), dtype, me, 1)
                dist.all_reduce(t, op, group=group)
                return [t]
            cases.append(("all_reduce", dtype, op, ar))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        def bc(group, dtype=dtype):
            t = make((7,), dtype, me, 2)
            dist.broadcast(t, group_src(group, n - 1), group=group)
            return [t]

        def ag(group, dtype=dtype):
            x = make((3, 2), dtype, me, 3)
            outs = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(outs, x, group=group)
            chunks = list(torch.empty(n * 3, 2, dtype=dtype).chunk(n))  # one storage: no staging
            dist.all_gather(chunks, x, group=group)
            return outs + chunks

        def agt(group, dtype=dtype):
            x = make((4,), dtype, me, 4)
            out = torch.empty(n * 4, dtype=dtype)
            dist.all_gather_into_tensor(out, x, group=group)
            out2 = torch.empty(n, 4, dtype=dtype).t()  # non-contiguous output
            tmp = torch.empty(n * 4, dtype=dtype)
            dist.all_gather_into_tensor(tmp, x, group=group)
            out2.copy_(tmp.view(n, 4).t())
            return [out, out2]

        def a2a(group, dtype=dtype):
            ins = [make((r + 1 + me,), dtype, me, 5 + r) for r in range(n)]
            outs = [torch.empty(me + 1 + r, dtype=dtype) for r in range(n)]
            dist.all_to_all(outs, ins, group=group)
            return outs

        def a2as(group, dtype=dtype):
            x = make((2 * n, 3), dtype, me, 6)
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            send = [(me + r) % 3 for r in range(n)]
            recv = [(r + me) % 3 for r in range(n)]
            y = make((sum(send), 2), dtype, me, 7)
            out2 = torch.empty(sum(recv), 2, dtype=dtype)
            dist.all_to_all_single(out2, y, recv, send, group=group)
            return [out, out2]

        def gat(group, dtype=dtype):
            x = make((2,), dtype, me, 8)
            outs = [torch.zeros(2, dtype=dtype) for _ in range(n)] if me == 0 else None
            dist.gather(x, outs, dst=group_src(group, 0), group=group)
            return outs or [x]

        def sca(group, dtype=dtype):
            ins = [make((3,), dtype, r, 9) for r in range(n)] if me == n - 1 else None
            out = torch.empty(3, dtype=dtype)
            dist.scatter(out, ins, src=group_src(group, n - 1), group=group)
            return [out]

        for name, fn in (("broadcast", bc), ("all_gather", ag), ("all_gather_into_tensor", agt),
                         ("all_to_all", a2a), ("all_to_all_single", a2as), ("gather", gat),
                         ("scatter", sca)):
            cases.append((name, dtype, None, fn))
    for dtype in (*FLOATS, torch.int32):
        for op in (R.SUM, R.MAX, R.MIN) + ((R.AVG,) if dtype.is_floating_point else ()):
            def rs(group, dtype=dtype, op=op):
                ins = [make((2, 3), dtype, me, 10 + r) for r in range(n)]
                out = torch.empty(2, 3, dtype=dtype)
                dist.reduce_scatter(out, ins, op, group=group)
                return [out]

            def rst(group, dtype=dtype, op=op):
                x = make((n * 4, 2), dtype, me, 11)
                out = torch.empty(4, 2, dtype=dtype)
                dist.reduce_scatter_tensor(out, x, op, group=group)
                return [out]

            def red(group, dtype=dtype, op=op):
                t = make((5,), dtype, me, 12)
                dist.reduce(t, group_src(group, n - 1), op, group=group)
                return [t] if me == n - 1 else []

            cases += [("reduce_scatter", dtype, op, rs), ("reduce_scatter_tensor", dtype, op, rst),
                      ("reduce", dtype, op, red)]
    return cases


def group_src(group, local: int) -> int:
    return dist.get_global_rank(group, local)


def expected(name, dtype, op, fn, gloo, n, me):
    """gloo's result on the same inputs, or (ops/dtypes gloo lacks) a float64 reference.

    float16/bfloat16 sums and products of more than 2 ranks are held to the float64 reference:
    ferro accumulates them in float32 and rounds once, gloo rounds at every step (its results
    are up to several units in the last place away, ferro's at most one)."""
    half_fold = (dtype in (torch.float16, torch.bfloat16) and n > 2
                 and op in (R.SUM, R.AVG, R.PRODUCT))
    try:
        gloo_result = fn(gloo)
    except (RuntimeError, ValueError):
        gloo_result = None
    if gloo_result is not None and not half_fold:
        return gloo_result, "gloo"
    if name == "all_reduce":
        return [reference_reduce((6, 5), dtype, n, 1, op)], "reference"
    if name == "reduce_scatter_tensor":
        full = reference_reduce((n * 4, 2), dtype, n, 11, op)
        return [full[me * 4:(me + 1) * 4]], "reference"
    if name == "reduce_scatter":
        xs = [[make((2, 3), dtype, r, 10 + k) for k in range(n)] for r in range(n)]
        s = torch.stack([x[me].double() for x in xs])
        out = {R.SUM: s.sum(0), R.AVG: s.mean(0), R.MIN: s.min(0).values,
               R.MAX: s.max(0).values}[op]
        return [out.to(dtype)], "reference"
    if name == "all_to_all":  # rank r sent us its tensor number `me`
        return [make((me + 1 + r,), dtype, r, 5 + me) for r in range(n)], "reference"
    if name == "reduce":
        return ([reference_reduce((5,), dtype, n, 12, op)] if me == n - 1 else []), "reference"
    raise AssertionError(f"gloo cannot run {name} {dtype} and there is no reference")


def check_collectives(group, gloo) -> dict:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    sources: dict[str, int] = {}
    for name, dtype, op, fn in collective_cases(n, me):
        got = fn(group)
        want, source = expected(name, dtype, op, fn, gloo, n, me)
        sources[source] = sources.get(source, 0) + 1
        if source == "reference":
            sources.setdefault("reference_cases", []).append(f"{name} {dtype} {op}")
        # bit-identical wherever the order of a float reduction cannot differ (2 ranks, data
        # movement, integers, MIN/MAX); gloo's own ring order differs on more ranks
        exact = (not dtype.is_floating_point or op in (None, R.MIN, R.MAX)
                 or (n == 2 and source == "gloo" and op is not R.AVG))
        same(got, want, exact, f"{name} {dtype} {op}")
    dist.barrier(group=group)
    return sources


def check_async_and_p2p(group) -> None:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    ts = [torch.full((1000,), float(me + k)) for k in range(4)]
    works = [dist.all_reduce(t, async_op=True, group=group) for t in ts]
    out = torch.empty(n * 3)
    works.append(dist.all_gather_into_tensor(out, torch.full((3,), float(me)), async_op=True,
                                             group=group))
    futs = [w.get_future() for w in works]
    chained = futs[0].then(lambda f: f.value()[0] * 2)
    torch.futures.wait_all(futs)
    for w in works:
        w.wait()
        assert w.is_completed()
    total = sum(range(n))
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((1000,), float(total + k * n))), (k, t[:3])
    assert torch.equal(futs[0].value()[0], ts[0])
    assert torch.equal(chained.wait(), ts[0] * 2)
    assert torch.equal(out, torch.arange(n).repeat_interleave(3).float())
    # send/recv in a ring, blocking and not, big (past the cross-memory threshold) and small
    right, left = (me + 1) % n, (me - 1) % n
    gr, gl = group_src(group, right), group_src(group, left)
    for size in (5, 200_000):
        x = torch.arange(size, dtype=torch.float32) + me
        y = torch.empty(size)
        req = dist.irecv(y, gl, group=group, tag=3)
        dist.send(x, gr, group=group, tag=3)
        req.wait()
        assert torch.equal(y, torch.arange(size, dtype=torch.float32) + left)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(me)), gr, group),
           dist.P2POp(dist.irecv, y4 := torch.empty(4), gl, group)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert torch.equal(y4, torch.full((4,), float(left)))
    yt = torch.empty(6, 2).t()  # non-contiguous receive buffer
    if me % 2 == 0 and right != me:
        dist.send(torch.arange(12.).view(2, 6), gr, group=group)
    if me % 2 == 1:
        dist.recv(yt, gl, group=group)
        assert torch.equal(yt, torch.arange(12.).view(2, 6))
    dist.barrier(group=group)


# ----------------------------------------------------------------------------- training
def mlp(sizes, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batches(steps: int, me: int, sizes):
    g = torch.Generator().manual_seed(100 + me)
    return [(torch.randn(16, sizes[0], generator=g),
             torch.randint(0, sizes[-1], (16,), generator=g)) for _ in range(steps)]


def train(model, data, lr=0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


SIZES = (12, 32, 32, 5)


def ddp_losses(group, steps=6, hook=None) -> list[float]:
    """DDP's losses; ``hook``: one of torch's communication hooks by name ("fp16": its
    fp16_compress_hook; "powerSGD": powerSGD_hook at rank 1, compressing from step 3; torch's
    bf16_compress_hook refuses any CPU build: "required CUDA 11+ and NCCL 2.10+")."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(mlp(SIZES), process_group=group, bucket_cap_mb=0.002)  # several buckets
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=3, min_compression_rate=0.5)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return train(model, batches(steps, dist.get_rank(), SIZES))


def fsdp_losses(mesh, steps=6) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    model = mlp(SIZES)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train(model, batches(steps, dist.get_rank(), SIZES))


def check_training(gloo) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    n = dist.get_world_size()
    out = {}
    for name, run in (("ddp", ddp_losses), ("fsdp", fsdp_losses)):
        arg_f = dist.group.WORLD if name == "ddp" else DeviceMesh.from_group(dist.group.WORLD, "cpu")
        arg_g = gloo if name == "ddp" else DeviceMesh.from_group(gloo, "cpu")
        lf, lg = run(arg_f), run(arg_g)
        exact = n == 2 and name == "ddp"
        if exact:
            assert lf == lg, f"{name}: ferro {lf} != gloo {lg}"
        else:
            torch.testing.assert_close(lf, lg, rtol=1e-5, atol=1e-6, msg=name)
        out[name] = lf
    # torch's own communication hooks over "ferro" (two ranks: the compiled backend's job).
    # fp16: the same losses as over gloo, exactly (a sum of two has one rounding on both).
    # PowerSGD (its futures chain allreduces in their callbacks; over gloo it hangs here, in
    # torch 2.13's gloo): exact for its first 3 steps, so the first 4 losses are plain DDP's;
    # then the gradients are approximated (rank 1), and the losses differ
    for hook in ("fp16", "powerSGD") if n == 2 else ():
        lf = ddp_losses(dist.group.WORLD, 8, hook)
        if hook == "fp16":
            lg = ddp_losses(gloo, 8, hook)
            assert lf == lg, f"DDP {hook} hook: ferro {lf} != gloo {lg}"
        else:
            assert lf[:4] == out["ddp"][:4] and lf[5] != out["ddp"][5], (lf, out["ddp"])
            assert all(x == x for x in lf), lf
        out[f"ddp_{hook}"] = lf
    return out


def check_mesh_2d() -> dict:
    """4 ranks: subgroups and a 2-D DeviceMesh (HSDP) over ferro vs the same over gloo."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    me = dist.get_rank()
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if me % 2 == 0 else odds
    assert isinstance(mine, ferro_torch.ProcessGroupFerro)
    assert isinstance(ferro_torch.ferro_backend(mine), __import__("ferro_backend").SubBackend)
    t = torch.tensor([float(me)])
    dist.all_reduce(t, group=mine)
    assert t.item() == (2.0 if me % 2 == 0 else 4.0), t
    pair = dist.new_group([0, 1])  # ranks 2, 3 are not members
    if me < 2:
        t = torch.tensor([float(me + 1)])
        dist.all_reduce(t, group=pair)
        assert t.item() == 3.0
    # the collectives of a subgroup against gloo's same subgroup
    gloo_mine = (dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo"))
    sources = check_collectives(mine, gloo_mine[me % 2])

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = torch.arange(4).view(2, 2)
    rows = [dist.new_group(r.tolist(), backend="gloo") for r in ref]
    cols = [dist.new_group(c.tolist(), backend="gloo") for c in ref.t()]
    gmesh = DeviceMesh.from_group([cols[me % 2], rows[me // 2]], "cpu", mesh=ref,
                                  mesh_dim_names=("replicate", "shard"))
    lf, lg = fsdp_losses(mesh), fsdp_losses(gmesh)
    torch.testing.assert_close(lf, lg, rtol=1e-5, atol=1e-6, msg="hsdp")
    return {"hsdp": lf, "subgroup_sources": sources}


# ----------------------------------------------------------------------------- scenarios
def scenario_suite() -> None:
    kind = init()
    gloo = dist.new_group(backend="gloo")
    sources = check_collectives(dist.group.WORLD, gloo)
    check_async_and_p2p(dist.group.WORLD)
    losses = check_training(gloo)
    extra = check_mesh_2d() if dist.get_world_size() == 4 else {}
    transport = type(ferro_torch.ferro_backend()).__name__
    dist.barrier()
    dist.destroy_process_group()
    report(rank=RANK, sources=sources, transport=transport, kind=kind, **losses, **extra)


def scenario_dead_peer() -> None:
    kind = init(timeout=60)
    n = dist.get_world_size()
    t = torch.ones(3)
    dist.all_reduce(t)
    if RANK == n - 1:
        os._exit(17)  # dies without a word
    start = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(1000))
            time.sleep(0.05)
    except dist.DistError as exc:
        report(rank=RANK, error=type(exc).__name__, message=str(exc), kind=kind,
               is_ferro=isinstance(exc, ferro_torch.FerroTorchError),
               is_backend_error=isinstance(exc, dist.DistBackendError),
               seconds=time.monotonic() - start)
        os._exit(0)
    raise AssertionError("the collective did not fail after the peer died")


def scenario_kind() -> None:
    """Which backend init_process_group("ferro") chose, and the warnings it gave (or its
    error): for the fallback and FERRO_TORCH_BACKEND tests."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kind = init(timeout=30)
        except Exception as exc:
            report(rank=RANK, error=f"{type(exc).__name__}: {exc}")
            os._exit(0)
        t = torch.full((3,), RANK + 1.0)
        dist.all_reduce(t)
        n = dist.get_world_size()
        sub = dist.new_group(list(range(n)))
        dist.all_reduce(t, group=sub)
        sub_kind = ferro_torch.backend_kind(sub)
    lines = [str(w.message) for w in caught if "ferro-torch" in str(w.message)]
    report(rank=RANK, kind=kind, sub_kind=sub_kind, warnings=lines, value=t.tolist())
    dist.destroy_process_group()


def scenario_background() -> None:
    """Asynchronous calls on the compiled backend's worker thread (FERRO_BACKGROUND=on): in
    issue order with the synchronous ones, futures, p2p beside them, DDP equal to gloo's."""
    kind = init()
    gloo = dist.new_group(backend="gloo")
    check_async_and_p2p(dist.group.WORLD)
    n, me = dist.get_world_size(), dist.get_rank()
    xs = [torch.full((1 << 14,), float(me + k)) for k in range(6)]  # async, sync, async...
    works = [dist.all_reduce(x, async_op=k % 2 == 0) for k, x in enumerate(xs)]
    for w in works:
        if w is not None:
            w.wait()
    assert all(torch.equal(x, torch.full_like(x, float(sum(range(n)) + n * k)))
               for k, x in enumerate(xs)), [x[0].item() for x in xs]
    # a future's callback that issues a collective and waits for it (PowerSGD's hook does):
    # the futures complete off the worker thread, which stays free to run it
    def then(fut):
        u = torch.full((4,), float(me))
        dist.all_reduce(u, async_op=True).wait()
        return fut.value()[0] + u

    first = torch.ones(4)
    chained = dist.all_reduce(first, async_op=True).get_future().then(then)
    assert torch.equal(chained.wait(), torch.full((4,), n + float(sum(range(n)))))
    lf, lg = ddp_losses(dist.group.WORLD), ddp_losses(gloo)
    assert lf == lg, (lf, lg)
    inline = dist.group.WORLD._get_backend(torch.device("cpu")).inline_async
    # the engine's re-probes (FERRO_SHM_REPROBE: the test sets 0.2 s) run on the worker thread
    # and the issuing one alike: a second of calls, every rank stopping after the same one
    engine = ferro_torch.ferro_backend().engine
    first, end = engine.link.probe, time.monotonic() + 1.0
    while True:
        y = torch.tensor([1.0, float(time.monotonic() > end)])
        dist.all_reduce(y, async_op=True).wait()
        dist.all_reduce(z := torch.ones(3))
        assert y[0].item() == n and z[0].item() == n, (y, z)
        if y[1].item():
            break
    report(rank=RANK, kind=kind, inline_async=inline, ddp=lf, probes=[first, engine.link.probe])
    dist.destroy_process_group()


def scenario_token() -> None:
    """Run with FERRO_TOKEN unset on the last rank: it cannot join."""
    try:
        init(timeout=float(os.environ.get("TEST_TIMEOUT", "6")),
             init_method=os.environ.get("TEST_INIT_METHOD", "env://"),
             **({} if "RANK" in os.environ else {}))
    except dist.DistError as exc:
        report(rank=RANK, error=type(exc).__name__, message=str(exc),
               is_ferro=isinstance(exc, ferro_torch.FerroTorchError))
        os._exit(0)
    report(rank=RANK, error=None)
    os._exit(0)


def scenario_tcp_init() -> None:
    """init_method="tcp://..." (no MASTER_* in the environment)."""
    dist.init_process_group("ferro", init_method=os.environ["TEST_INIT_METHOD"],
                            rank=int(os.environ["TEST_RANK"]),
                            world_size=int(os.environ["TEST_WORLD"]),
                            timeout=timedelta(seconds=30))
    t = torch.tensor([dist.get_rank() + 1.0], dtype=torch.bfloat16)
    dist.all_reduce(t)
    report(rank=dist.get_rank(), value=t.item(),
           transport=type(ferro_torch.ferro_backend()).__name__)
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]]()

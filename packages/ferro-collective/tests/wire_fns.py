"""Rank functions for test_wire.py's real-process runs (spawned processes import them)."""

from unittest import mock

import numpy as np

import ferro_collective as fc
from ferro_collective import ReduceOp, compressed
from ferro_collective.wire import decode, encode


def _through(x, wire):
    x = np.asarray(x, np.float32).reshape(-1)
    return decode(encode(x, wire), wire, x.size)


def suite(b) -> list[str]:
    """Every wire format on allreduce (small and past the engine's slot), reduce_scatter and
    all_gather, against the reference; the failures. fp16's large allreduces run in pieces."""
    bad: list[str] = []
    for wire in ("bf16", "fp16", "int8", "int4"):
        if wire == "fp16":
            with mock.patch.object(compressed, "PIECE_BYTES", 1 << 16):
                bad += _one_format(b, wire)
        else:
            bad += _one_format(b, wire)
    return bad


def _one_format(b, wire) -> list[str]:
    n, r = b.world_size, b.rank
    bad: list[str] = []
    for size in (7, 300_000):
        xs = [np.linspace(-3, 3, size, dtype=np.float32) * (k + 1) + k for k in range(n)]
        acc = _through(xs[0], wire).copy()
        for x in xs[1:]:
            acc += _through(x, wire)
        got = fc.allreduce(xs[r], b, ReduceOp.SUM, wire=wire)
        if not np.array_equal(got, _through(acc, wire)):
            bad.append(f"allreduce {wire} {size}")
    x = np.arange(n * 4, dtype=np.float32) * (r + 1)
    part = sum(_through((np.arange(n * 4, dtype=np.float32) * (k + 1))[r * 4:(r + 1) * 4],
                        wire) for k in range(n))
    if not np.array_equal(fc.reduce_scatter(x, b, wire=wire), part):
        bad.append(f"reduce_scatter {wire}")
    got = fc.all_gather(np.full(3, r + 0.1, np.float32), b, wire=wire)
    want = np.concatenate([_through(np.full(3, k + 0.1), wire) for k in range(n)])
    if not np.array_equal(got, want):
        bad.append(f"all_gather {wire}")
    return bad + in_the_background(b, wire)


def in_the_background(b, wire) -> list[str]:
    """The ``*_async`` forms with ``wire``: the blocking forms' bits, in the order they were
    issued among other calls (an exact call made while they wait for a worker, and one made
    before: each gets its own result), the input encoded when the call was made."""
    n, r = b.world_size, b.rank
    bad: list[str] = []
    x = np.linspace(-2, 2, 300_001, dtype=np.float32) * (r + 1)
    blocks = np.arange(n * 6, dtype=np.float32).reshape(n * 2, 3) * (r + 1)
    want = (fc.allreduce(x, b, ReduceOp.MEAN, wire=wire),
            fc.reduce_scatter(blocks, b, wire=wire),
            fc.all_gather(x[:5], b, wire=wire))
    before = fc.allreduce_async(np.full(4, r, np.int64), b)
    works = (fc.allreduce_async(x, b, ReduceOp.MEAN, wire=wire),
             fc.reduce_scatter_async(blocks, b, wire=wire),
             fc.all_gather_async(x[:5], b, wire=wire))
    x[:] = -7  # (the compressed calls encoded it already)
    exact = fc.allreduce(np.full(2, r + 1.0), b)
    out = np.empty_like(want[0])
    last = fc.allreduce_async(np.linspace(-2, 2, 300_001, dtype=np.float32) * (r + 1), b,
                              ReduceOp.MEAN, wire=wire, out=out)
    for name, w, got in zip(("allreduce", "reduce_scatter", "all_gather"), want,
                            [k.wait(60) for k in works]):
        if got.tobytes() != w.tobytes():
            bad.append(f"{name}_async {wire}")
    if last.wait(60) is not out or out.tobytes() != want[0].tobytes():
        bad.append(f"allreduce_async {wire} out=")
    if before.wait(60).tolist() != [n * (n - 1) // 2] * 4 or \
            exact.tolist() != [n * (n + 1) / 2] * 2:
        bad.append(f"the exact calls beside the compressed ones ({wire})")
    return bad


def hierarchical(b, nodes) -> list[str]:
    """On two nodes: only the cross-node stage on the wire. The reference: each node's exact
    sum (in float32, as the node stage folds this input), through the wire, folded across
    nodes, through the wire again; the failures."""
    from ferro_backend.hierarchy import attach_hierarchy

    h = attach_hierarchy(b, nodes)
    n, r = b.world_size, b.rank
    members = h.members
    bad: list[str] = []
    for wire in ("bf16", "int8"):
        xs = [np.linspace(-1, 1, 1000, dtype=np.float32) * (k + 1) + 0.01 * k for k in range(n)]
        node_sums = []
        for m in members:
            s = xs[m[0]].copy()
            for k in m[1:]:
                s += xs[k]
            node_sums.append(s)
        # the cross stage folds each local rank's slice; int8 blocks count from the slice's
        # start: the reference per slice
        local = len(members[0])
        per = -(-1000 // local)
        want = np.empty(per * local, np.float32)
        for i in range(local):
            parts = [np.pad(s, (0, per * local - 1000))[i * per:(i + 1) * per]
                     for s in node_sums]
            acc = _through(parts[0], wire).copy()
            for p in parts[1:]:
                acc += _through(p, wire)
            want[i * per:(i + 1) * per] = _through(acc, wire)
        got = fc.allreduce(xs[r], b, wire=wire)
        if not np.array_equal(got, want[:1000]):
            bad.append(f"hierarchical allreduce {wire}: max error "
                       f"{np.abs(got - want[:1000]).max()}")
        work = fc.allreduce_async(xs[r], b, wire=wire)
        exact = fc.allreduce(np.ones(3), b)  # (issued after it: runs after it)
        if work.wait(60).tobytes() != got.tobytes() or exact.tolist() != [n] * 3:
            bad.append(f"hierarchical allreduce_async {wire}")
        if wire == "bf16":  # in pieces (each its own hierarchical call): the same bits
            with mock.patch.object(compressed, "PIECE_BYTES", 16):
                if fc.allreduce(xs[r], b, wire=wire).tobytes() != got.tobytes():
                    bad.append("hierarchical allreduce bf16 in pieces")
    return bad + hierarchical_reduce_scatter(b, members)


def hierarchical_pieces(b, nodes) -> list[str]:
    """A multi-node bf16 allreduce in pieces (every piece's node stage, the pieces' cross-node
    stages at once, the node all_gathers in order): the bits of the call in one piece, blocking
    and three in the background at once, with an exact call issued after them."""
    from ferro_backend.hierarchy import attach_hierarchy

    attach_hierarchy(b, nodes)
    n, r = b.world_size, b.rank
    xs = [np.linspace(-1, 1, 2000, dtype=np.float32) * (k + 1) + 0.01 * r for k in range(3)]
    whole = [fc.allreduce(x, b, ReduceOp.MEAN, wire="bf16") for x in xs]  # one piece each
    bad: list[str] = []
    with mock.patch.object(compressed, "PIECE_BYTES", 64):
        if fc.allreduce(xs[0], b, ReduceOp.MEAN, wire="bf16").tobytes() != whole[0].tobytes():
            bad.append("blocking, in pieces")
        works = [fc.allreduce_async(x, b, ReduceOp.MEAN, wire="bf16") for x in xs]
        exact = fc.allreduce(np.ones(3), b)
        got = [w.wait(60) for w in works]
    if [g.tobytes() for g in got] != [w.tobytes() for w in whole]:
        bad.append("three in the background, in pieces")
    if exact.tolist() != [n] * 3:
        bad.append("the exact call issued after them")
    return bad


def hierarchical_reduce_scatter(b, members) -> list[str]:
    """bf16/fp16 reduce_scatter on two nodes: each node's exact float32 sum of this rank's
    block (in rank order), through the wire, folded across nodes in node order; the async
    form the same bits; int8 flat (every rank's own blocks through the wire, folded in rank
    order)."""
    n, r = b.world_size, b.rank
    rows = 3
    xs = [np.linspace(-1, 1, n * rows * 2, dtype=np.float32).reshape(n * rows, 2) * (k + 1)
          + 0.01 * k for k in range(n)]
    bad: list[str] = []
    for wire, op in (("bf16", ReduceOp.SUM), ("fp16", ReduceOp.MEAN), ("bf16", ReduceOp.MAX)):
        fold = np.maximum if op is ReduceOp.MAX else np.add
        acc = None
        for m in members:
            node = xs[m[0]][r * rows:(r + 1) * rows].copy()
            for q in m[1:]:
                node = fold(node, xs[q][r * rows:(r + 1) * rows])
            t = _through(node, wire).reshape(rows, 2)
            acc = t if acc is None else fold(acc, t)
        if op is ReduceOp.MEAN:
            acc = acc / np.float32(n)
        got = fc.reduce_scatter(xs[r], b, op, wire=wire)
        if got.shape != (rows, 2) or not np.array_equal(got, acc):
            bad.append(f"hierarchical reduce_scatter {wire} {op.name}: {got} != {acc}")
        if fc.reduce_scatter_async(xs[r], b, op, wire=wire).wait(60).tobytes() != \
                got.tobytes():
            bad.append(f"hierarchical reduce_scatter_async {wire} {op.name}")
    acc = sum(_through(x[r * rows:(r + 1) * rows], "int8") for x in xs).reshape(rows, 2)
    if not np.array_equal(fc.reduce_scatter(xs[r], b, wire="int8"), acc):
        bad.append("reduce_scatter int8 on two nodes (flat)")
    return bad


def disagreements(b, nodes=None, timeout=20.0) -> list[str]:
    """Rank 0 disagrees with the others on a compressed call in several ways, each followed by
    agreeing calls (exact, then compressed in pieces), which must give the right values:
    ``"rank r, case: error type"`` for each disagreement, and anything that went wrong.
    ``nodes``: the ranks' node names (a multi-node job: the node stages on the engine)."""
    if nodes is not None:
        from ferro_backend.hierarchy import attach_hierarchy

        attach_hierarchy(b, nodes)
    total = b.world_size * (b.world_size + 1) / 2
    small = np.ones(4, np.float32)
    cut = np.ones(2000, np.float32)  # 4 pieces of 16 encoded bytes at least
    cases = {
        "sizes that cut differently": lambda: fc.allreduce(
            cut if b.rank == 0 else small, b, wire="bf16", timeout=timeout),
        "the same in the background": lambda: fc.allreduce_async(
            cut if b.rank == 0 else small, b, wire="fp16", timeout=timeout).wait(timeout),
        "sizes whose first pieces agree": lambda: fc.allreduce(
            cut if b.rank == 0 else cut[:1999], b, wire="bf16", timeout=timeout),
        "a refused dtype": lambda: fc.allreduce(
            np.ones(2000, np.int32) if b.rank == 0 else cut, b, wire="bf16", timeout=timeout),
        "a refused wire": lambda: fc.allreduce(
            cut, b, wire="bf17" if b.rank == 0 else "bf16", timeout=timeout),
        "another compressed collective": lambda: (
            fc.allreduce(cut, b, wire="bf16", timeout=timeout) if b.rank == 0 else
            fc.reduce_scatter(cut, b, wire="bf16", timeout=timeout)),
    }
    if nodes is None:  # (a multi-node call's decider is a cross-node one: not caught up)
        cases.update(exact_against(b, small, cut, timeout))
    seen: list[str] = []
    with mock.patch.object(compressed, "PIECE_BYTES", 16):
        for case, call in cases.items():
            try:
                call()
                seen.append(f"rank {b.rank}, {case}: no error")
            except Exception as exc:  # each rank says what it raised
                seen.append(f"rank {b.rank}, {case}: {type(exc).__name__}")
            mine = np.full(5, b.rank + 1.0, np.float32)
            got = fc.allreduce(mine, b, timeout=timeout)
            if not np.array_equal(got, np.full(5, total)):
                seen.append(f"{case}: the exact allreduce after it gave {got}")
            got = fc.allreduce_async(np.full(2000, b.rank + 1.0, np.float32), b, wire="bf16",
                                     timeout=timeout).wait(timeout)
            if not np.array_equal(got, np.full(2000, total)):
                seen.append(f"{case}: the allreduce in pieces after it gave {got[:4]}")
    return seen


def exact_against(b, small, cut, timeout) -> dict:
    """Rank 0's compressed call against its peers' exact call of the same collective (which
    takes one sequence number where the compressed call takes a block: the exact ranks catch
    up, the headers saying how many the block is): one piece, in pieces, in the background on
    both sides, a refused wire, an all_gather."""
    def pair(compressed_call, exact_call):
        return lambda: compressed_call() if b.rank == 0 else exact_call()

    return {
        "an exact call against one piece": pair(
            lambda: fc.allreduce(small, b, wire="bf16", timeout=timeout),
            lambda: fc.allreduce(small, b, timeout=timeout)),
        "an exact call against pieces": pair(
            lambda: fc.allreduce(cut, b, wire="bf16", timeout=timeout),
            lambda: fc.allreduce(cut, b, timeout=timeout)),
        "both in the background": pair(
            lambda: fc.allreduce_async(cut, b, wire="fp16", timeout=timeout).wait(timeout),
            lambda: fc.allreduce_async(cut, b, timeout=timeout).wait(timeout)),
        "an exact call against a refused wire": pair(
            lambda: fc.allreduce(small, b, wire="bf17", timeout=timeout),
            lambda: fc.allreduce(small, b, timeout=timeout)),
        "an exact all_gather": pair(
            lambda: fc.all_gather(small, b, wire="int8", timeout=timeout),
            lambda: fc.all_gather(small, b, timeout=timeout)),
        "an exact all_to_all_single": pair(  # (on the engine: its Python steps catch up)
            lambda: fc.reduce_scatter(small, b, wire="bf16", timeout=timeout),
            lambda: fc.all_to_all_single(small, b, timeout=timeout)),
    }


def peer_gone(b, name: str, wire: str, flag: str) -> str | None:
    """Rank 2 closes its backend (then writes ``flag``); ranks 0 and 1 then make the compressed
    call ``name`` and return the error they meet, as ``Type: message``, each holding its
    backend open until the other has its error."""
    import os
    import time

    if b.rank == 2:
        b.close()
        with open(flag, "w"):
            pass
        return None
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    x = np.arange(12, dtype=np.float32)
    try:
        getattr(fc, name)(x, b, wire=wire, timeout=30)
        got = "returned"
    except Exception as exc:
        got = f"{type(exc).__name__}: {exc}"
    # open until the other survivor has its error too (its close would be a second peer gone)
    with open(f"{flag}.{b.rank}", "w"):
        pass
    other = f"{flag}.{1 - b.rank}"
    while not os.path.exists(other) and time.monotonic() < deadline + 60:
        time.sleep(0.01)
    return got

import importlib.machinery

import ferro_collective
from ferro_collective import _doorplan, _onecall, _wire, api, api_uneven, dispatch, wire


def test_the_one_call_paths_are_extension_modules():
    for mod in (_doorplan, _onecall, dispatch, _wire):
        assert mod.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), mod


def test_the_public_calls_are_compiled_with_their_python_signatures():
    """api.py and api_uneven.py run compiled (Cython's pure-Python mode), and still read as
    Python: keyword-only arguments, defaults, annotations and docstrings as written."""
    import inspect

    assert api.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), api
    assert ferro_collective.allreduce is api.allreduce
    sig = inspect.signature(api.allreduce)
    assert list(sig.parameters) == ["tensor", "backend", "op", "timeout", "algorithm", "out", "wire",
                                    "feedback"]
    assert sig.parameters["timeout"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["op"].default is ferro_collective.ReduceOp.SUM
    assert "Reduce ``tensor`` element-wise" in api.allreduce.__doc__
    assert api_uneven.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert ferro_collective.all_to_all_single is api_uneven.all_to_all_single
    sig = inspect.signature(api_uneven.broadcast_object)
    assert list(sig.parameters) == ["obj", "backend", "root", "timeout"]
    assert sig.parameters["timeout"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "Unpickling runs code chosen by the root" in api_uneven.broadcast_object.__doc__
    # annotations are not C types: a numpy integer root is taken as Python's int is
    import numpy as np

    from ferro_backend import SimulatedBackend
    (b,) = SimulatedBackend.create_group(1)
    assert api.broadcast(np.ones(2), b, root=np.int64(0)).tolist() == [1.0, 1.0]


def test_public_names():
    for name in ferro_collective.__all__:
        assert getattr(ferro_collective, name) is not None
    assert ferro_collective.DEFAULT_COLLECTIVE_TIMEOUT == 60.0
    assert ferro_collective.__version__ == "0.1.0"


def test_the_kernels_share_one_compiled_cython_utility_module():
    """Cython's utility code (memoryviews) is built once per distribution and imported by each
    kernel as it loads, not compiled into every kernel."""
    import sys

    import ferro_collective._onecall  # noqa: F401

    util = sys.modules["ferro_collective._cyutility"]
    assert util.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_the_hooks_a_core_subclass_must_define_are_declared_on_core():
    import pytest

    from ferro_collective.engine_group import EngineGroup

    class Bare(_onecall.Core):
        pass

    with pytest.raises(NotImplementedError, match="Bare must define _resolve"):
        Bare()._resolve(1.0, "allreduce")
    with pytest.raises(NotImplementedError, match="Bare must define _raise"):
        Bare()._raise(1, "allreduce", 0, 1.0)
    # the engine's group defines both (and nothing else the compiled half calls on it)
    for name in ("_resolve", "_raise"):
        assert getattr(EngineGroup, name) is not getattr(_onecall.Core, name)


def test_the_wire_formats_run_on_the_compiled_kernel():
    assert wire._kernel is _wire and wire.BLOCK == _wire.BLOCK == 256


def _one_rank_engine():
    """A backend of one rank with an engine of its own (a world of one makes none)."""
    import os

    from ferro_backend import SimulatedBackend
    from ferro_backend.engine import Engine, _segment

    (b,) = SimulatedBackend.create_group(1)
    size = _segment.layout(1, 1 << 16, 4096)["size"]
    fd = os.memfd_create("ferro-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        b.engine = Engine(0, 1, fd, size, 1 << 16, 4096, b.timeout)
    finally:
        os.close(fd)
    return b


def test_the_one_call_path_finds_each_backends_own_group_and_forgets_the_gone():
    """The dispatcher keeps the last backend and its group (weakly): calls alternating between
    backends each run on their own engine, a group bound anew is the one used, and a backend
    that is gone leaves nothing behind."""
    import gc
    import weakref

    import numpy as np

    from ferro_collective.engine_group import EngineGroup

    one_rank = _one_rank_engine

    b1, b2 = one_rank(), one_rank()
    x = np.arange(4.0)
    for b in (b1, b2):
        ferro_collective.barrier(b)  # (the first call makes the group)
    steps = [b.engine.comm.step for b in (b1, b2)]
    for _ in range(3):
        for b in (b1, b2, b2):
            assert ferro_collective.allreduce(x, b).tolist() == x.tolist()
    assert [b.engine.comm.step - s for b, s in zip((b1, b2), steps)] == [3, 6]
    # a group bound anew on b2's engine is the one its calls use (the old one is broken here)
    old = b2.engine.client
    new = EngineGroup(b2, b2.engine)
    old.broken = RuntimeError("the old group was used")
    ferro_collective.barrier(b2)
    assert b2.engine.client is new
    # a backend let go is freed (the dispatcher holds it weakly), and calls go on elsewhere
    gone = weakref.ref(b1)
    for b in (b1, b2):
        b.engine.close() if b is b1 else None
    del b, b1, old
    gc.collect()
    assert gone() is None
    assert ferro_collective.allreduce(x, b2).tolist() == x.tolist()
    assert ferro_collective.allreduce(x, one_rank()).tolist() == x.tolist()
    b2.engine.close()


def test_the_barrier_takes_its_one_call_entry_and_its_errors_end_at_the_public_call():
    """``barrier`` goes to ``dispatch.run_barrier``: on an engine with its group made, the
    group's own checks run (a broken group raises its error, a bad timeout is refused naming
    the barrier) and the traceback ends within three of ferro's frames; no engine: the
    general path, as before."""
    import traceback

    import pytest

    from ferro_backend import SimulatedBackend

    b = _one_rank_engine()
    try:
        ferro_collective.barrier(b)  # (the first call makes the group)
        step = b.engine.comm.step
        for _ in range(5):
            assert ferro_collective.barrier(b) is None
        assert b.engine.comm.step == step + 5
        with pytest.raises(ValueError, match="barrier: timeout") as info:
            ferro_collective.barrier(b, timeout=-1.0)
        ours = [f for f in traceback.extract_tb(info.value.__traceback__)
                if "ferro" in f.filename]
        assert 1 <= len(ours) <= 3, ours
        b.engine.client.broken = RuntimeError("the group was broken earlier")
        with pytest.raises(RuntimeError, match="broken earlier"):
            ferro_collective.barrier(b)
    finally:
        b.engine.close()
    (alone,) = SimulatedBackend.create_group(1)
    assert ferro_collective.barrier(alone) is None and dispatch.run_barrier.__module__ == \
        "ferro_collective.dispatch"

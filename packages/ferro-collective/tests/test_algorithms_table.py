"""``ferro_collective.ALGORITHMS`` lists what a user can choose: exactly the collectives whose
public call (and its ``*_async`` form) takes ``algorithm=``, each with its record's algorithms."""

import inspect

import ferro_collective as fc
from ferro_collective import records


def _takes_algorithm(name: str) -> bool:
    return "algorithm" in inspect.signature(getattr(fc, name)).parameters


def test_algorithms_lists_only_the_calls_that_take_algorithm():
    for name, algorithms in fc.ALGORITHMS.items():
        assert _takes_algorithm(name) and _takes_algorithm(name + "_async"), name
        assert algorithms == records.BY_NAME[name].algorithms
    # every public call with an algorithm= argument is listed
    public = {n for n in fc.__all__ if not n.endswith("_async") and callable(getattr(fc, n))
              and n in records.BY_NAME}
    assert {n for n in public if _takes_algorithm(n)} == set(fc.ALGORITHMS)


def test_the_full_table_keeps_every_record():
    assert set(records.ALL_ALGORITHMS) >= set(fc.ALGORITHMS) | {"reduce", "gather", "scatter"}

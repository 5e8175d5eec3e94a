import warnings

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))


@pytest.fixture(scope="session", autouse=True)
def compiled_backend():
    """The compiled backend, built once (or loaded from torch's extension cache) before any
    test's ranks start, so that they load it from the cache; None where it cannot build (the
    ranks then run the Python backend, and test_compiled_backend says why)."""
    from ferro_torch import _compiled

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return _compiled.module()
        except _compiled.BuildError:
            return None

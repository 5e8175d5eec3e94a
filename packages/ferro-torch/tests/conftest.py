import warnings

import pytest

#: the first test's limit also covers the session's build of the compiled backend (the
#: autouse fixture below; 36-42 s here alone, more beside other test sessions)
FIRST_TEST_TIMEOUT = 360


@pytest.hookimpl(trylast=True)  # after -k/-m deselected: items[0] is the first to run
def pytest_collection_modifyitems(items):
    for i, item in enumerate(items):
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FIRST_TEST_TIMEOUT if i == 0 else 120))


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

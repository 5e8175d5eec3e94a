import pytest
from hypothesis import settings

settings.register_profile("line", derandomize=True, deadline=None)  # noxfile.HYPOTHESIS


def pytest_collection_modifyitems(items):
    # a backstop above the tests' own process limits (up to 240 s: every rank compiles its
    # jitted calls, 24 s in CI for the longest test, several times that on a loaded line)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(300))

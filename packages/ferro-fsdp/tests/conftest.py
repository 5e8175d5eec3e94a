import pytest
from hypothesis import settings

settings.register_profile("line", derandomize=True, deadline=None)  # noxfile.HYPOTHESIS


def pytest_collection_modifyitems(items):
    # A backstop: every test ends on its own, this only catches a bug that would hang.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))

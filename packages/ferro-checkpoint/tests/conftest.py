import inspect

import pytest
from hypothesis import settings

settings.register_profile("line", derandomize=True, deadline=None)  # noxfile.HYPOTHESIS

#: what a test that needs ferro-backend calls first (it is skipped where ferro-checkpoint is
#: installed alone, as in its own session of the test line)
NEEDS_BACKEND = 'importorskip("ferro_backend")'


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backend: needs ferro-backend (given to every test that calls "
        f"pytest.{NEEDS_BACKEND}); the test line runs them with `-m backend` where it is installed")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))
        function = getattr(item, "function", None)
        if function is not None and NEEDS_BACKEND in inspect.getsource(function):
            item.add_marker(pytest.mark.backend)

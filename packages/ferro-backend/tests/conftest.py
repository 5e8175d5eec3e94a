import pytest

try:  # (ferro-torch's session runs test_launchers.py from here without hypothesis)
    from hypothesis import settings
except ImportError:
    pass
else:
    settings.register_profile("line", derandomize=True, deadline=None)  # noxfile.HYPOTHESIS


def pytest_collection_modifyitems(items):
    # A backstop: every test ends on its own, this only catches a bug that would hang.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))

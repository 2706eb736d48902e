import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HPC_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only when asked for (``-m slow``), so a plain run stays short."""
    import pytest
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords and "cache" in str(item.fspath):
            item.add_marker(skip)

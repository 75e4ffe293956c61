"""Shared pytest setup for shardwise's tests."""

import sys


def pytest_sessionfinish(session, exitstatus):
    """Stop the distributed test harness's worker pools so the session ends promptly."""
    testing = sys.modules.get("shardwise.testing")
    if testing is not None:
        testing.shutdown_pools()

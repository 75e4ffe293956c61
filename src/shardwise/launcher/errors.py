"""The one error type the launcher raises for bad arguments, before any rank starts."""

from __future__ import annotations


class LaunchError(ValueError):
    """A launch that cannot start: bad flags, a missing script, a host not in the hostfile.

    The message is one line that says what is wrong and how to fix it; the CLI prints it
    and exits 2, the same contract as `ConfigError`.
    """

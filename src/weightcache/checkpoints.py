"""Deprecated alias of ``weightcache.testing.checkpoints`` (random-weight checkpoints for tests and demos)."""

import warnings

from .testing import checkpoints as _moved

warnings.warn("weightcache.checkpoints moved to weightcache.testing.checkpoints", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    return getattr(_moved, name)

"""Checks shared by the argument validation of several modules."""

from __future__ import annotations

import numpy as np

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """True for a Python or NumPy integer; False for a bool (`True` would otherwise pass as 1) and anything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

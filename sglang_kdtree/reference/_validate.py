"""Argument checks shared by the reference modules: dtype, NaN and budget errors name the argument, the
offending value and what is expected."""

from __future__ import annotations

import numpy as np


def _require_float(name: str, a: np.ndarray) -> None:
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")


def _require_int(name: str, a: np.ndarray) -> None:
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")


def _require_no_nan(name: str, a: np.ndarray) -> None:
    if np.isnan(a).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(a))[0])
        raise ValueError(f"{name} contains NaN (first at index {idx}); the drafter produced invalid logits")


def _check_budget(budget) -> int:
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int, got {type(budget).__name__} {budget!r}")
    return int(budget)

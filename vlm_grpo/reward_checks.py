"""Reward functions checked on every call: a raise, a wrong length or a NaN names the function and the row.

TRL would otherwise surface these as a shape error or a NaN loss several frames away from the cause.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

__all__ = ["RewardFunctionError", "checked_reward_func", "reward_name"]


class RewardFunctionError(RuntimeError):
    """A reward function misbehaved; the message names it, the row, and what to fix."""


def _excerpt(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def reward_name(func: Callable) -> str:
    """The name a reward function is reported under: its `__name__` (as in TRL's `rewards/<name>` metrics), else its
    type's name (e.g. a callable object without one)."""
    return getattr(func, "__name__", None) or type(func).__name__


def _find_failing_row(func: Callable, prompts: list, completions: list, kwargs: dict) -> int | None:
    """Call `func` one row at a time to find the first row it raises on (plain functions are cheap)."""
    n = len(completions)
    for i in range(n):
        row_kwargs = {k: ([v[i]] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            func(prompts=[prompts[i]], completions=[completions[i]], **row_kwargs)
        except Exception:  # noqa: BLE001  (whatever the user's function raises marks the row)
            return i
    return None


def checked_reward_func(func: Callable) -> Callable:
    """Wrap a TRL-style reward function `(prompts, completions, **columns) -> list[float | None]` with checks.

    Raises `RewardFunctionError` naming the function and the row when it raises, returns a list of the
    wrong length, or returns NaN / a non-number. `None` stays allowed (TRL's "does not apply").
    Async functions and reward models (`nn.Module`) are returned unchanged.
    """
    if inspect.iscoroutinefunction(func) or not callable(func) or getattr(func, "_vlm_grpo_checked", False):
        return func
    try:
        import torch

        if isinstance(func, torch.nn.Module):
            return func
    except ImportError:  # pragma: no cover
        pass
    name = reward_name(func)

    @functools.wraps(func)
    def checked(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        try:
            values = func(prompts=prompts, completions=completions, **kwargs)
        except Exception as error:
            row = _find_failing_row(func, prompts, completions, kwargs)
            where = f"on row {row} (completion {_excerpt(completions[row])})" if row is not None else "on this batch"
            raise RewardFunctionError(
                f"Reward function {name!r} raised {type(error).__name__}: {error} {where}. Fix the function, or "
                "return None for rows it cannot score."
            ) from error
        if values is None or not hasattr(values, "__len__") or len(values) != len(completions):
            sized = hasattr(values, "__len__")
            got = "None" if values is None else _count(len(values), "value") if sized else type(values).__name__
            raise RewardFunctionError(
                f"Reward function {name!r} returned {got} for {_count(len(completions), 'completion')}; it must return "
                "one float (or None) per completion, in order."
            )
        for row, value in enumerate(values):
            if value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {_excerpt(value)} for row {row}; rewards must be numbers or None."
                ) from None
            if math.isnan(number) or math.isinf(number):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {number} for row {row} (completion "
                    f"{_excerpt(completions[row])}); return a finite number, or None where the reward does not apply."
                )
        return values

    checked._vlm_grpo_checked = True  # type: ignore[attr-defined]
    return checked

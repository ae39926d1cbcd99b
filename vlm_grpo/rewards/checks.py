"""Reward functions checked on every call: a raise, a wrong length or a NaN names the function and the row.

TRL would otherwise surface these as a shape error or a NaN loss several frames away from the cause. The row is
named by its completion, its prompt and, for rows read from a JSON Lines or CSV file, its line there: the loader keeps
that in the `ROW_ORIGIN` column (`vlm_grpo.data.load_grpo_dataset(keep_origin=True)`, as the command does), which
reward functions never see (`vlm_grpo.data.rows.dataset_row` leaves it out) and the trainer adds to the error
(`RewardFunctionError.origin`).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["ROW_ORIGIN", "RewardFunctionError", "checked_reward_func", "reward_name"]

# Where a row came from ("data.jsonl line 7"), for messages that name it.
ROW_ORIGIN = "_vlm_grpo_origin"


class RewardFunctionError(RuntimeError):
    """A reward function misbehaved; the message names it, the row (its completion, prompt and, once the trainer set
    `origin`, its file and line) and what to fix. `row` is the row's index in the batch (None: the whole batch)."""

    def __init__(self, problem: str, fix: str, row: int | None = None, prompt: Any = None, completion: Any = None,
                 preposition: str = "on") -> None:  # fmt: skip
        super().__init__(problem)
        self.problem, self.fix, self.row, self.prompt, self.completion = problem, fix, row, prompt, completion
        self.preposition = preposition  # "raised ... on row 2", "returned nan for row 2"
        self.origin: str | None = None

    def __str__(self) -> str:
        if self.row is None:
            return f"{self.problem}; {self.fix}"
        parts = [f"completion {_excerpt(_text(self.completion, 'assistant'))}",
                 f"prompt {_excerpt(_text(self.prompt, 'user'))}"]  # fmt: skip
        if self.origin:
            parts.append(self.origin)
        return f"{self.problem} {self.preposition} row {self.row} of the batch ({'; '.join(parts)}); {self.fix}"


def _text(messages: Any, role: str) -> Any:
    """The text of a prompt or completion: a string as it is, else the text parts of its last `role` message (images
    left out)."""
    if not isinstance(messages, list):
        return messages
    ours = [m for m in messages if isinstance(m, dict) and m.get("role") == role] or messages
    content = ours[-1].get("content") if isinstance(ours[-1], dict) else ours[-1]
    if isinstance(content, list):
        return " ".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text").strip()
    return content


def _where_raised(func: Callable, error: BaseException) -> str:
    """` (rewards.py line 12)`: the line of the reward's own file the error came through last ("" if unknown)."""
    frames = traceback.extract_tb(error.__traceback__)
    try:
        source = inspect.getsourcefile(inspect.unwrap(func))
    except TypeError:  # a builtin or a callable object without source
        source = None
    own = [f for f in frames if source and os.path.abspath(f.filename) == os.path.abspath(source)] or frames[-1:]
    return f" ({os.path.basename(own[-1].filename)} line {own[-1].lineno})" if own else ""


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
            said = " ".join(str(error).split())  # one line, whatever the function's message holds
            raise RewardFunctionError(
                f"Reward function {name!r} raised {type(error).__name__}: {said}{_where_raised(func, error)}"
                + ("" if row is not None else " on this batch"),
                "fix the function, or return None for rows it cannot score.",
                row,
                prompts[row] if row is not None else None,
                completions[row] if row is not None else None,
            ) from error
        if values is None or not hasattr(values, "__len__") or len(values) != len(completions):
            sized = hasattr(values, "__len__")
            got = "None" if values is None else _count(len(values), "value") if sized else type(values).__name__
            raise RewardFunctionError(
                f"Reward function {name!r} returned {got} for {_count(len(completions), 'completion')} (the first "
                f"prompt: {_excerpt(_text(prompts[0], 'user') if prompts else None)})",
                "it must return one float (or None) per completion, in order.",
            )
        for row, value in enumerate(values):
            if value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {_excerpt(value)}",
                    "rewards must be numbers or None.",
                    row,
                    prompts[row],
                    completions[row],
                    preposition="for",
                ) from None
            if math.isnan(number) or math.isinf(number):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {number}",
                    "return a finite number, or None where the reward does not apply.",
                    row,
                    prompts[row],
                    completions[row],
                    preposition="for",
                )
        return values

    checked._vlm_grpo_checked = True  # type: ignore[attr-defined]
    return checked

"""Reward functions by name: what `--reward_funcs` and a YAML recipe's `reward_funcs:` list resolve through.

A name is one of :func:`reward_names` (the TRL-signature rewards of :mod:`vlm_grpo.rewards`) or an import path to
your own function, so a recipe can name a reward it cannot hold. :func:`reward_columns` says which dataset columns
a reward reads its gold answer from, so a dataset that lacks them is refused before training rather than at the
first reward call.

Example::

    >>> from vlm_grpo.rewards import resolve_reward, reward_columns
    >>> resolve_reward("answer_accuracy")
    <reward answer_accuracy (gold column answer/solution)>
    >>> reward_columns(resolve_reward("vlm_grpo.rewards:iou"))
    ('bbox',)
    >>> reward_columns(resolve_reward("think_answer_format"))   # a format reward reads no gold
    ()
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from .adaptor import _TRL_EXTRAS, BatchReward

__all__ = ["resolve_reward", "reward_columns", "reward_names"]

# Parameters of a TRL reward function that are not dataset columns.
_NOT_COLUMNS = frozenset({"prompts", "completions"}) | _TRL_EXTRAS


def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return None


def reward_names() -> list[str]:
    """Names of the reward functions in `vlm_grpo.rewards` usable by name: callables (not classes) that take
    `completions`, as TRL calls them. Factories such as `make_choice_reward` are left out: they build a reward."""
    from vlm_grpo import rewards

    names = []
    for name in getattr(rewards, "__all__", dir(rewards)):
        value = getattr(rewards, name, None)
        if callable(value) and not inspect.isclass(value):
            signature = _signature(value)
            if signature is not None and "completions" in signature.parameters:
                names.append(name)
    return sorted(names)


def resolve_reward(name: str) -> Callable:
    """A reward function by `vlm_grpo.rewards` name (see :func:`reward_names`) or import path (`pkg.mod:fn` or
    `pkg.mod.fn`).

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or a path that cannot be imported.
    """
    from vlm_grpo import rewards

    if name in reward_names():
        return getattr(rewards, name)
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if sep and module_name and attr:
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r}: cannot import it ({error}).") from error
        if callable(func):
            return func
    raise ValueError(
        f"unknown reward {name!r}; choose from {', '.join(reward_names())} or give an import path pkg.mod:fn."
    )


def reward_columns(func: Callable) -> tuple[str, ...]:
    """The dataset columns `func` reads its gold answer from; empty for a reward that reads none (a format reward).

    A :class:`~vlm_grpo.rewards.BatchReward` declares them (`gold_columns`; it reads the first one present). A plain
    TRL function names them as required parameters, e.g. TRL's `accuracy_reward(completions, solution, **kwargs)`
    reads `solution`; parameters with a default, `**kwargs` and TRL's own keywords are not columns.
    """
    if isinstance(func, BatchReward):
        return func.gold_columns
    signature = _signature(func)
    if signature is None:
        return ()
    return tuple(
        name
        for name, param in signature.parameters.items()
        if name not in _NOT_COLUMNS
        and param.default is inspect.Parameter.empty
        and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )

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
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from .adaptor import _TRL_EXTRAS, BatchReward, RewardFunc

__all__ = ["FromAnswers", "resolve_reward", "reward_columns", "reward_names"]

# Parameters of a TRL reward function that are not dataset columns.
_NOT_COLUMNS = frozenset({"prompts", "completions"}) | _TRL_EXTRAS


def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return None


def reward_names() -> list[str]:
    """Names of the reward functions in `vlm_grpo.rewards` usable by name: callables (not classes) that take
    `completions` and keyword columns, as TRL calls them. Factories such as `make_choice_reward` are left out: they
    build a reward."""
    from vlm_grpo import rewards

    names = []
    for name in getattr(rewards, "__all__", dir(rewards)):
        value = getattr(rewards, name, None)
        if callable(value) and not inspect.isclass(value):
            signature = _signature(value)
            # and the `**kwargs` TRL passes every column in: `completion_texts(completions, columns)` is a helper
            takes_columns = signature is not None and any(
                p.kind is p.VAR_KEYWORD for p in signature.parameters.values()
            )
            if takes_columns and "completions" in signature.parameters:
                names.append(name)
    return sorted(names)


def resolve_reward(name: str) -> Callable:
    """A reward function by `vlm_grpo.rewards` name (see :func:`reward_names`) or import path (`pkg.mod:fn` or
    `pkg.mod.fn`), imported as a script run from the current directory imports: `my_rewards:score` finds
    `./my_rewards.py`.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or a path that cannot be imported (a module
            not found, or one whose own imports fail: the message names the module and line).
    """
    from vlm_grpo import rewards

    if name in reward_names():
        return getattr(rewards, name)
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if sep and module_name and attr:
        module = _import_module(name, module_name)
        if not hasattr(module, attr):
            raise ValueError(f"reward {name!r}: cannot import it (module {module_name!r} has no attribute {attr!r}).")
        if callable(getattr(module, attr)):
            return getattr(module, attr)
    raise ValueError(
        f"unknown reward {name!r}; choose from {', '.join(reward_names())} or give an import path pkg.mod:fn."
    )


def _import_module(name: str, module_name: str) -> Any:
    """`module_name` imported as a Python script run from the current directory would import it: the working
    directory goes first on `sys.path` (and stays, so a spawned worker finds the module too). A module that is not
    found says where it was looked for; an import failing inside it (a dependency it lacks) is named as such."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        missing = getattr(error, "name", None)
        if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(f"reward {name!r}: cannot import it (no module {missing!r} in the current directory "
                             f"{cwd} nor on the Python path).") from error  # fmt: skip
        raise ValueError(f"reward {name!r}: importing {module_name} failed: {type(error).__name__}: {error}"
                         f"{_raised_in(error)}.") from error  # fmt: skip


def _raised_in(error: BaseException) -> str:
    """` (my_rewards.py line 3)`: the import statement that failed, the innermost line of a file in the traceback."""
    here = (os.path.abspath(__file__), os.path.abspath(importlib.__file__))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith("<") and os.path.abspath(f.filename) not in here]  # fmt: skip
    return f" ({frames[-1].filename} line {frames[-1].lineno})" if frames else ""


class FromAnswers:
    """A reward made from the data's answer column, so it can be named before the data is loaded (`answer_choice`):
    `vlm_grpo.cli.task` calls `build(answers)`. Called as a reward itself it raises, naming the fix."""

    def __init__(self, factory: Callable[..., RewardFunc], name: str) -> None:
        self.factory, self.__name__, self.__doc__ = factory, name, factory.__doc__

    def __repr__(self) -> str:
        return f"<reward {self.__name__}, made from the answer column once the data is loaded>"

    def build(self, answers: Iterable[Any]) -> RewardFunc:
        """The reward for these answers (an answer column's values)."""
        return self.factory(answers, name=self.__name__)

    def __call__(self, prompts: Any, completions: Any, **columns: Any) -> list[float | None]:
        raise ValueError(f"{self.__name__} is made from your data's answers: use {self.factory.__name__}(answers), "
                         "or pass it to vlm_grpo.cli.task.dataset_task / synthetic_task, which build it.")  # fmt: skip


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

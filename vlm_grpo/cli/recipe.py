"""The `--config` YAML recipe checked before TRL's parser reads it: each problem one line naming the file and the fix."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from .usage import PROG, UsageError

__all__ = ["check_recipe"]


def check_recipe(parser: Any, argv: list[str]) -> dict[str, Any]:
    """The `--config` YAML checked as flags are: a missing or unparsable file, or a key that is no flag, named with
    the file, the key and the closest real one (TrlParser's own message names neither the file nor a fix), and a
    single value for a flag that takes a list (TrlParser set it as is: `reward_weights: 1.0` failed far from the
    file). Returns its settings ({} without one)."""
    import yaml

    path = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--config"), None)
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            recipe = yaml.safe_load(file)
    except OSError as error:
        raise UsageError(f"--config {path}: cannot read it ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(
            f"--config {path}{where}: not valid YAML ({getattr(error, 'problem', None) or error})"
        ) from error
    if recipe is None:
        return {}
    if not isinstance(recipe, dict):
        raise UsageError(f"--config {path}: expected `flag: value` lines, found a {type(recipe).__name__}")
    known = {option[2:] for option in parser._option_string_actions if option.startswith("--")}
    for key in recipe:
        if key == "env" or str(key) in known:  # `env:` sets environment variables (TrlParser)
            continue
        near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]}?" if near else f" (keys are flag names without --: {PROG} --help-all)"
        raise UsageError(f"--config {path}: unknown key {key!r}{hint}")
    for key, value in recipe.items():
        action = parser._option_string_actions.get(f"--{key}")
        if action is None or action.nargs not in ("+", "*") or value is None or isinstance(value, list):
            continue
        if not _takes_a_single_value(parser, str(key)):  # `debug: underflow_overflow` is split by its owner
            raise UsageError(f"--config {path}: {key} takes a list; write `{key}: [{value}]`")
    return recipe


def _takes_a_single_value(parser: Any, name: str) -> bool:
    """Whether the field `name` of the parser's dataclasses also takes a value that is not a list (`str | list[...]`)."""
    for cls in parser.dataclass_types:
        try:
            hint = typing.get_type_hints(cls).get(name)
        except (NameError, TypeError):  # an annotation naming something not importable here: judged by the flag
            hint = None
        if hint is not None:
            members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            return any(m is not type(None) and typing.get_origin(m) not in (list, tuple) for m in members)
    return False

"""The `vlm-grpo` command's defaults that depend on other flags, used only where you set none.

The demo's defaults (`vlm_grpo.cli.demo.DEMO`) suit a one-word answer: 4 completion tokens, a record every 10 steps. Other
flags need other budgets: `--tools` needs room for a call, the tool's image and the answer, and a run shorter than
`--logging_steps` would log once. A flag you give (on the command line or in `--config` YAML) is never changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["TOOL_COMPLETION", "TOOL_TURNS", "fit_defaults", "given_flags"]

#: Completion tokens with `--tools` where none are set: a call, a zoomed image's tokens and the answer fit in it
#: (the tiny model's tool tests use 160).
TOOL_COMPLETION = 256
#: Tool turns per rollout with `--tools` where none are set: one call, then the answer (the zoom task needs no more).
TOOL_TURNS = 2


def given_flags(argv: Iterable[str], recipe_keys: Iterable[str] = ()) -> set[str]:
    """The flags set by hand: `--x` / `--x=v` / `--no_x` on the command line (as `x`) and the `--config` YAML's keys."""
    given = {str(key) for key in recipe_keys}
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            given.update({name, name[3:]} if name.startswith("no_") else {name})
    return given


def fit_defaults(script: Any, config: Any, given: set[str]) -> list[str]:
    """Set the defaults that fit the flags given, where you set none; return a line saying each change (nothing set by
    hand is changed)."""
    said = []
    if script.tools:
        fitted = []
        if "max_completion_length" not in given and config.max_completion_length < TOOL_COMPLETION:
            config.max_completion_length = TOOL_COMPLETION
            fitted.append(f"--max_completion_length {TOOL_COMPLETION}")
        if "max_tool_calling_iterations" not in given and config.max_tool_calling_iterations is None:
            config.max_tool_calling_iterations = TOOL_TURNS
            fitted.append(f"--max_tool_calling_iterations {TOOL_TURNS}")
        if fitted:
            said.append(f"--tools: {' and '.join(fitted)} (room for a call, the tool's image and the answer; set "
                        "them to change it)")  # fmt: skip
    if "logging_steps" not in given and 0 < config.max_steps < config.logging_steps:
        # One record at the end would make a reward curve of one point: a record every step instead.
        config.logging_steps = 1
    return said

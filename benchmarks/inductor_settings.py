"""`grpo_step.py --inductor`: Inductor settings for a benchmark run, to weigh what they cost or save in compile time
(a fresh first step, `cold_start.py`) against step time. For example `triton.autotune_pointwise=False` compiles one
configuration of each pointwise kernel instead of two to six (torch's comment: "only disable for debugging")."""

from __future__ import annotations

import ast
import functools


def apply_inductor_settings(text: str) -> dict:
    """Set `text`'s "key=value,..." on torch._inductor.config and return them. Dotted keys reach sub-configs
    (`triton.autotune_pointwise`); values are Python literals, else strings (no lists: items split on commas). An item
    without "=" or a key torch's config does not have stops the run with one line."""
    import torch._inductor.config

    settings: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = (part.strip() for part in item.partition("="))
        *parents, leaf = key.split(".")
        try:
            owner = functools.reduce(getattr, parents, torch._inductor.config)
        except AttributeError:
            owner = None
        if not sep or owner is None or not hasattr(owner, leaf):
            raise SystemExit(f"--inductor: {item!r} is not key=value with a key of torch._inductor.config "
                             "(e.g. triton.autotune_pointwise=False)")  # fmt: skip
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word: a string setting (max_autotune_gemm_backends=ATEN)
        setattr(owner, leaf, value)
        settings[key] = value
    return settings

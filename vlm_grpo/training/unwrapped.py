"""accelerate's `unwrap_model`, asked once per wrapper object.

`Accelerator.unwrap_model` walks every module of the model at each call: accelerate's `has_compiled_regions` looks
for a compiled submodule and, in a model whose layers are compiled in place (`engine.compiled_layers`), finds none
and walks to the end. That is 4-5 ms of host time for a 3B VLM with LoRA (~5 000 modules; the tiny model at the 3B's
depth, `benchmarks/grpo_step.py --model tiny-deep`), and the scoring and generation routes asked it seven times a step.
The wrappers (DDP, FSDP, DeepSpeed, a whole-model `torch.compile`) are objects made once, by `Trainer.train`'s
`prepare`; what one of them wraps does not change, so the answer is kept per wrapper object, and a new wrapper (a new
object) is asked afresh.
"""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap_once"]


def unwrap_once(trainer: Any, model: Any) -> Any:
    """`trainer.accelerator.unwrap_model(model)`, computed once per `model` object (kept on the trainer, keyed by the
    object itself, so a wrapper made later is unwrapped afresh)."""
    known = trainer.__dict__.setdefault("_unwrapped_models", [])
    for wrapper, inner in known:
        if wrapper is model:
            return inner
    inner = trainer.accelerator.unwrap_model(model)
    known.append((model, inner))
    del known[:-4]  # the policy, its DDP / FSDP / DeepSpeed wrapper, a reference model: a few at most
    return inner

"""Python's garbage collector kept off the objects that live all run (the model, TRL's trainer, compiled code).

Why: a full (oldest-generation) collection walks every object the collector tracks. After a first step that compiled
the training layers there are ~0.7 million on the tiny 36-layer model (`benchmarks/gc_pauses.py`, CPU): one full
collection took 351 ms in step 5 of 8, a step of 0.78 s otherwise, and CPython starts one whenever the long-lived
objects have grown by a quarter, at a step nobody chose. `gc.freeze()` moves every tracked object into a permanent
generation that collections skip: the same collection then took 3 ms. vLLM freezes the same way after capturing its
CUDA graphs.

Frozen objects are still freed by reference counting; only reference cycles among them would never be collected, so a
collection runs first. The freeze follows the first step and every later step that compiled something (new long-lived
objects), and `gc.unfreeze()` as `train()` ends (also on an error) hands everything back to the collector: a notebook or a test
session that goes on after training keeps its usual collections. On by default for a model on a GPU; on CPU (tiny
models, runs of seconds) only when asked for.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback

from ..engine.compile_cache import compiled_count

__all__ = ["FreezeLongLived"]

logger = logging.getLogger(__name__)


class FreezeLongLived(TrainerCallback):
    """Collects and freezes what is alive at the end of the first step of `train()` and of each step that compiled
    graphs; `release` unfreezes. `enabled` False: does nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._compiled: int | None = None  # the compiled-graph count at the last freeze; None: not frozen this run

    @classmethod
    def as_configured(cls, setting: bool | None, model: nn.Module) -> FreezeLongLived:
        """The callback `VLMGRPOConfig.gc_freeze` asks for: None is on for a model on a GPU, off on CPU (tiny runs of
        a few seconds, where the one collection costs more than it saves)."""
        if setting is None:
            setting = next(model.parameters()).device.type == "cuda"
        return cls(bool(setting))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        count = compiled_count()
        if self._compiled is None or count > self._compiled:
            self._compiled = count
            gc.collect()
            gc.freeze()
            logger.debug("Froze %d long-lived objects after step %d.", gc.get_freeze_count(), state.global_step)

    def release(self) -> None:
        """Hand what this run froze back to the collector (`VLMGRPOTrainer.train` calls it as it ends, also on an
        error); a no-op when nothing is frozen."""
        if self._compiled is not None:
            self._compiled = None
            gc.unfreeze()

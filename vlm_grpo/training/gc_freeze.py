"""Python's garbage collector kept off the objects that live all run (the model, TRL's trainer, compiled code).

Why: a full (oldest-generation) collection walks every object the collector tracks. After a first step that compiled
the training layers there are ~0.7 million on the tiny 36-layer model (`benchmarks/gc_pauses.py`, CPU): one full
collection took 363 ms in step 5 of 8 (steps of 0.76-0.82 s otherwise), and CPython (3.10-3.13) starts one whenever
the long-lived objects have grown by a quarter, at a step nobody chose. `gc.freeze()` moves every tracked object into a
permanent generation that collections skip. vLLM freezes the same way after capturing its CUDA graphs.

Frozen objects are still freed by reference counting; only reference cycles among them would never be collected, so a
collection runs first. The freeze follows the first step and every later step that compiled something (new long-lived
objects), and `gc.unfreeze()` as `train()` ends (also on an error) hands everything back to the collector: a notebook
or a test session that goes on after training keeps its usual collections. Python cannot unfreeze only some objects,
so what was frozen before training (by the user, or by vLLM's engine, which freezes as it starts) is unfrozen too, and
said once.

Off by default until a GPU run measures it: on CPU (`benchmarks/gc_pauses.py`, 8 steps) the freeze's own collection
(357 ms, after step 1) cost what the full collection it spared (363 ms, in step 5) did, and the steps between were
within noise. `gc_freeze=None` turns it on where training runs on a GPU.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

import torch
from transformers import TrainerCallback

from ..engine.compile_cache import compiled_count

__all__ = ["FreezeLongLived", "graphs_made"]

logger = logging.getLogger(__name__)


def graphs_made() -> int:
    """Graphs Dynamo made and Inductor compiled or fetched so far in this process: grows in a step that compiled
    (Dynamo's own count too, so a run with Inductor's caches off is seen as well)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return compiled_count() + counters["stats"].get("unique_graphs", 0)


class FreezeLongLived(TrainerCallback):
    """Collects and freezes what is alive at the end of the first step of `train()` and of each step that compiled
    graphs; `release` unfreezes. `enabled` False: does nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._graphs: int | None = None  # `graphs_made()` at the last freeze; None: nothing frozen by this run

    @classmethod
    def as_configured(cls, setting: bool | None, device: torch.device) -> FreezeLongLived:
        """The callback `VLMGRPOConfig.gc_freeze` asks for; None is on where training runs on a GPU (`device`, the
        accelerator's), off on CPU (tiny runs of seconds, where the one collection costs about what it saves)."""
        return cls(device.type == "cuda" if setting is None else bool(setting))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        graphs = graphs_made()
        if self._graphs is None or graphs > self._graphs:
            if self._graphs is None and gc.get_freeze_count():
                logger.info("%d objects frozen before training (gc.freeze()) are unfrozen when train() ends: Python "
                            "cannot unfreeze only the run's own.", gc.get_freeze_count())  # fmt: skip
            self._graphs = graphs
            gc.collect()
            gc.freeze()
            logger.debug("Froze %d long-lived objects after step %d.", gc.get_freeze_count(), state.global_step)

    def release(self) -> None:
        """Hand what this run froze back to the collector (`VLMGRPOTrainer.train` calls it as it ends, also on an
        error); a no-op when nothing is frozen."""
        if self._graphs is not None:
            self._graphs = None
            gc.unfreeze()

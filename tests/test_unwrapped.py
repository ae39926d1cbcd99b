"""`vlm_grpo.training.unwrapped`: accelerate's `unwrap_model` asked once per wrapper object, the same answer as
accelerate's, and a wrapper made later (a new object) unwrapped afresh."""

from __future__ import annotations

import types

import torch
from accelerate import Accelerator
from accelerate.utils import other
from torch import nn

from vlm_grpo.training.unwrapped import unwrap_once


class _Wrapper(nn.Module):
    """A module that holds the model as `module`, as DDP does (accelerate unwraps DataParallel the same way)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_each_wrapper_is_unwrapped_once_and_as_accelerate_does(monkeypatch):
    walks = []
    real = other.has_compiled_regions
    monkeypatch.setattr(other, "has_compiled_regions", lambda module: walks.append(module) or real(module))
    trainer = types.SimpleNamespace(accelerator=Accelerator(cpu=True))
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    wrapped = torch.nn.DataParallel(model)  # on CPU it only holds the module, as DDP does for accelerate

    assert unwrap_once(trainer, model) is model and unwrap_once(trainer, model) is model
    assert unwrap_once(trainer, wrapped) is trainer.accelerator.unwrap_model(wrapped) is model
    assert unwrap_once(trainer, wrapped) is model
    assert len(walks) == 3  # model once, the wrapper once, and the reference call above: the cache asked no more
    later = torch.nn.DataParallel(model)  # a new wrapper object: asked afresh, never another wrapper's answer
    assert unwrap_once(trainer, later) is model and len(walks) == 4
    other_model = nn.Linear(2, 2)
    assert unwrap_once(trainer, other_model) is other_model
    assert unwrap_once(trainer, _Wrapper(other_model)).module is other_model  # not a wrapper accelerate knows

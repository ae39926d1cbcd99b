"""`vlm_grpo.models.modes`: the inference mode around generation, and each module's own mode after it."""

import torch
from torch import nn

from vlm_grpo import FastVisionModel
from vlm_grpo.models.modes import generating


class _OwnTrain(nn.Module):
    """A module whose `train` does more than set flags (as PEFT's DoRA layer's does)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Dropout(0.5)
        self.calls = []

    def train(self, mode=True):
        self.calls.append(mode)
        return super().train(mode)


def test_generation_runs_every_module_in_eval_mode_and_gives_each_its_own_mode_back(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True)
    model.train()
    tower = model.get_base_model().model.visual
    tower.eval()  # the user's choice: a frozen tower kept in eval mode while the rest trains
    extra = _OwnTrain()
    model.add_module("extra", extra)
    before = {name: m.training for name, m in model.named_modules()}
    assert any(before.values()) and not all(before.values())
    with generating(model):
        assert not any(m.training for m in model.modules())
        assert extra.calls == [False]
    assert {name: m.training for name, m in model.named_modules()} == before
    assert extra.calls == [False, True] and not tower.training and extra.inner.training
    # What generation reads is unchanged: inference mode gives the eval-mode logits.
    ids = torch.tensor([[1, 2, 3]])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.train()
    with generating(model), torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected)


def test_modules_whose_flag_lives_elsewhere_get_their_train_called(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    mirrored = _Mirrored(0.5)  # its own __setattr__ (as a TorchScript module's keeps a C++ flag)
    model.add_module("mirrored", mirrored)
    custom = nn.Dropout(0.5)
    calls = []
    custom.train = lambda mode=True: calls.append(mode) or nn.Module.train(custom, mode)  # set on the object
    model.add_module("custom", custom)
    model.train()
    calls.clear()
    with generating(model):
        assert mirrored.mirror is False and not mirrored.training
        assert calls == [False] and not custom.training
    assert mirrored.mirror is True and calls == [False, True] and custom.training


class _Mirrored(nn.Dropout):
    """A module that keeps a second copy of its flag, set through its own `__setattr__`."""

    def __setattr__(self, name, value):
        if name == "training":
            object.__setattr__(self, "mirror", value)
        super().__setattr__(name, value)

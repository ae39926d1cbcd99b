"""The unsharded generation copy (`engine.generation_copy`) on one process; under FSDP2 (two processes) it is
tested in tests/test_sharded.py (refreshed every step, equal to the gathered model, the same completions)."""

from __future__ import annotations

import pytest
import torch

from vlm_grpo.engine.generation_copy import GenerationCopy, copy_unfit_reason
from vlm_grpo.models.loader import FastVisionModel


@pytest.fixture
def lora(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    return FastVisionModel.get_peft_model(model, r=4)


def test_the_copy_owns_its_weights_in_the_generation_dtype_and_keeps_buffers_as_they_are(lora):
    lora.forward = lambda *a, **k: "the original's"  # an instance forward wrapping the original (TRL's fused head)
    copy = GenerationCopy()
    copy.prepare(lora, torch.device("cpu"), torch.bfloat16)
    own = dict(copy.model.named_parameters())
    for name, param in lora.named_parameters():
        assert own[name].dtype == torch.bfloat16 and not own[name].requires_grad
        assert own[name].data_ptr() != param.data_ptr()  # a copy, not the model's storage
        assert torch.equal(own[name], param.detach().to(torch.bfloat16))
    buffers = dict(lora.named_buffers())
    assert all(b.dtype == buffers[n].dtype for n, b in copy.model.named_buffers())  # rotary frequencies stay fp32
    assert "forward" not in vars(copy.model)  # the class's forward, not a closure over the original
    assert not copy.model.training


def test_a_refresh_copies_the_trainable_weights_once_per_step_in_place(lora):
    copy = GenerationCopy()
    copy.prepare(lora, torch.device("cpu"), share_frozen=False)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    addresses = {n: p.data_ptr() for n, p in copy.model.named_parameters()}
    with torch.no_grad():
        for param in lora.parameters():
            param.add_(1.0)  # every weight moves; only the trainable ones (the adapters) may reach the copy
    model = copy.refreshed(lora, step=1)
    assert copy.refreshes == 1 and copy.refreshed(lora, step=1) is model and copy.refreshes == 1  # once a step
    original = dict(lora.named_parameters())
    for name, param in model.named_parameters():
        assert param.data_ptr() == addresses[name]  # in place: recorded CUDA graphs keep reading them
        assert torch.equal(param, original[name]) == (name in trainable)


def test_a_parameter_the_copy_lacks_is_named(lora, tiny_dir):
    other, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    copy = GenerationCopy()
    copy.prepare(other, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="has no parameter .*lora_A"):
        copy.refreshed(lora, step=0)


def test_the_frozen_base_is_shared_not_copied_and_its_modules_are_named_for_fsdp2_to_leave_whole(lora):
    """A LoRA model's frozen weights on the device in the generation dtype are the model's own tensors in the copy
    (one base per GPU under FSDP2, as under DDP); the adapters are copies; only modules made of shared weights are
    listed for FSDP2's `ignored_params`."""
    copy = GenerationCopy()
    copy.prepare(lora, torch.device("cpu:0"))  # accelerate's spelling of the CPU device
    own = dict(copy.model.named_parameters())
    for name, param in lora.named_parameters():
        assert (own[name] is param) == (not param.requires_grad)  # the base shared, the adapters copied
    assert copy.stats()["shared_weights"] == sum(not p.requires_grad for p in lora.parameters()) > 0
    modules = copy.shared_modules(lora)
    assert modules and all(not p.requires_grad for m in modules for p in m.parameters())
    names = {id(m): n for n, m in lora.named_modules()}
    assert any(names[id(m)].endswith("base_layer") for m in modules)  # LoRA layers' bases, not the layers

    other = GenerationCopy()  # in another dtype nothing can be shared: the copy owns every weight
    other.prepare(lora, torch.device("cpu"), torch.bfloat16)
    assert other.stats()["shared_weights"] == 0 and other.shared_modules(lora) == []


def test_a_copy_that_would_not_fit_is_declined_with_the_fix_named(lora):
    """`own_bytes` counts only what the copy cannot share (with a shared base: the adapters); a copy that would take
    more than 80 % of the free GPU memory is declined, naming vLLM's tensor parallelism for models that large."""
    shared = GenerationCopy.own_bytes(lora, torch.device("cpu"))
    adapters = sum(p.numel() * p.element_size() for p in lora.parameters() if p.requires_grad)
    assert shared == adapters > 0
    whole = GenerationCopy.own_bytes(lora, torch.device("cpu"), torch.bfloat16)  # nothing shareable in bf16
    assert whole == sum(p.numel() * 2 for p in lora.parameters())
    assert copy_unfit_reason(8 * 2**30, 20 * 2**30) is None
    reason = copy_unfit_reason(64 * 2**30, 50 * 2**30)
    assert "64.0 GiB" in reason and "50.0 GiB" in reason and "vllm_tensor_parallel_size" in reason


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5", "llava_onevision", "internvl"])
def test_fsdp2_is_never_told_to_leave_a_trainable_weight_alone(tiny_dir, family):
    """accelerate turns each ignored module into all its weights, children's included: a module that owns a frozen
    weight beside LoRA layers (Qwen3.5's linear attention with its `A_log`, LLaVA-OneVision's root with
    `image_newline`, InternVL's layers with `lambda_1`) must not be listed, or its adapters would train unsynchronised
    on each rank. Its frozen weights are copied instead."""
    from accelerate.utils.fsdp_utils import get_parameters_from_modules

    model, _ = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4, random_state=0)
    copy = GenerationCopy()
    copy.prepare(model, torch.device("cpu"))
    ignored = get_parameters_from_modules(copy.shared_modules(model), model, torch.device("cpu"))
    assert ignored and not any(p.requires_grad for p in ignored)
    assert {id(p) for p in ignored} == copy.shared  # everything shared is left whole, nothing else
    own = dict(copy.model.named_parameters())
    for name, param in model.named_parameters():
        assert (own[name] is param) == (id(param) in copy.shared)
    assert GenerationCopy.own_bytes(model, torch.device("cpu")) == sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in copy.shared
    )

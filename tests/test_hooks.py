import pytest
import torch
from conftest import image_batch, lora_b_grads
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from vlm_grpo.models.hooks import (
    disable_requires_grad_hooks,
    enable_requires_grad_hooks,
    replace_stale_input_grads_hooks,
    requires_grad_post_hook,
    requires_grad_pre_hook,
)
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tiny import TINY_FAMILIES


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("layers", ["vision", "language", "both"])
def test_every_lora_b_gets_gradient_under_checkpointing(tiny_dir, family, mode, layers):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(
        model,
        r=4,
        finetune_vision_layers=layers in ("vision", "both"),
        finetune_language_layers=layers in ("language", "both"),
        use_gradient_checkpointing=mode,
    )
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    grads = lora_b_grads(model, image_batch(processor))
    assert grads, "no LoRA layers were added"
    zero = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not zero, f"lora_B without gradient: {zero}"
    assert any(".visual." in n or "vision" in n for n in grads) == (layers != "language")


def test_without_hooks_reentrant_vision_lora_gets_no_gradient(tiny_dir):
    """The failure the hooks exist for: frozen inputs + reentrant checkpointing starve vision LoRA."""
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(
        model, r=4, finetune_language_layers=False, use_gradient_checkpointing="reentrant"
    )
    assert disable_requires_grad_hooks(model) == 3
    # transformers >= 5.x adds its own input-grad hooks (embeddings, patch embedding) under reentrant
    # checkpointing; remove them too to recreate the frozen-input setup of Unsloth and older stacks.
    model.disable_input_require_grads()
    starved = lora_b_grads(model, image_batch(processor))
    in_blocks = {n: g for n, g in starved.items() if ".visual.blocks." in n}  # the checkpointed vision blocks
    assert in_blocks and all(g is None or not g.abs().sum() > 0 for g in in_blocks.values())
    enable_requires_grad_hooks(model)
    grads = lora_b_grads(model, image_batch(processor))
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_post_hook_prefers_loss_then_logits_then_hidden_states():
    logits = torch.zeros(2, 3)
    requires_grad_post_hook(None, (), CausalLMOutputWithPast(loss=None, logits=logits))
    assert logits.requires_grad
    loss, logits = torch.zeros(()), torch.zeros(2, 3)
    requires_grad_post_hook(None, (), CausalLMOutputWithPast(loss=loss, logits=logits))
    assert loss.requires_grad and not logits.requires_grad
    hidden = torch.zeros(1, 2, 4)
    requires_grad_post_hook(None, (), BaseModelOutput(last_hidden_state=hidden))
    assert hidden.requires_grad
    tensor = torch.zeros(3)
    assert requires_grad_post_hook(None, (), tensor) is tensor and tensor.requires_grad


def test_post_hook_leaves_integer_and_no_grad_alone_and_rejects_unknown_output():
    ids = torch.zeros(3, dtype=torch.long)
    requires_grad_post_hook(None, (), ids)
    assert not ids.requires_grad
    with torch.no_grad():
        x = torch.zeros(3)
        requires_grad_post_hook(None, (), x)
    assert not x.requires_grad
    with pytest.raises(TypeError, match="logits"):
        requires_grad_post_hook(torch.nn.Identity(), (), ("not", "an", "output"))


def test_pre_hook_marks_pixel_input():
    pixels = torch.zeros(4, 8)
    requires_grad_pre_hook(None, (pixels, torch.tensor([[1, 2, 2]])), {})
    assert pixels.requires_grad
    kw = torch.zeros(1, 3, 4, 4)
    requires_grad_pre_hook(None, (), {"pixel_values": kw})
    assert kw.requires_grad


def test_enable_is_idempotent_and_removable(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("gemma3"))
    first = enable_requires_grad_hooks(model)
    n_hooks = len(model._forward_hooks) + len(model.get_input_embeddings()._forward_hooks)
    second = enable_requires_grad_hooks(model)
    assert first is second
    assert len(model._forward_hooks) + len(model.get_input_embeddings()._forward_hooks) == n_hooks
    assert disable_requires_grad_hooks(model) == 3
    assert len(model._forward_hooks) == 0 and len(model.get_input_embeddings()._forward_hooks) == 0
    assert disable_requires_grad_hooks(model) == 0


def test_transformers_input_grads_hooks_are_replaced_not_piled_up(tiny_dir):
    # TRL switches checkpointing on after every scoring pass, which calls this: one call per training step.
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), full_finetuning=True)
    embedding = model.get_input_embeddings()
    before = len(embedding._forward_hooks)
    model.enable_input_require_grads()
    once = len(embedding._forward_hooks)
    model.enable_input_require_grads()
    twice = len(embedding._forward_hooks)
    assert once > before and twice == once + (once - before)  # transformers adds a hook per call, never replaces
    replace_stale_input_grads_hooks(model)
    for _ in range(5):
        model.enable_input_require_grads()
    assert len(embedding._forward_hooks) == twice  # each call replaced the hooks of the call before
    assert embedding(torch.tensor([[1, 2]])).requires_grad  # and they still work
    model.disable_input_require_grads()
    assert len(embedding._forward_hooks) == twice - (once - before)

import inspect

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.overrides import TorchFunctionMode

from vlm_grpo import FastVisionModel
from vlm_grpo.engine.vision_attention import (
    PACKED_VISION_ATTENTIONS,
    pack_vision_attention,
    packed_attention,
    uses_packed_attention,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


class CountAttention(TorchFunctionMode):
    """Counts `scaled_dot_product_attention` calls (the kernel launches the packing saves)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


def _vision_pass(model, processor):
    # Two image sizes: chunks of several lengths (and Qwen2.5-VL's windows cut at the image edge), and two images of
    # one size, whose chunks share a call.
    sizes_and_colours = [((224, 160), (200, 30, 30)), ((112, 112), (30, 200, 30)), ((112, 112), (30, 30, 200))]
    images = [Image.new("RGB", size, colour) for size, colour in sizes_and_colours]
    batch = processor.image_processor(images=images, return_tensors="pt")
    pixels = batch["pixel_values"].to(model.dtype).requires_grad_(True)
    tower = model.get_base_model().model.visual if hasattr(model, "get_base_model") else model.model.visual
    counter = CountAttention()
    with counter:
        out = tower(pixels, grid_thw=batch["image_grid_thw"])
    out = getattr(out, "pooler_output", out)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), pixels.grad, grads, counter.calls


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_vision_attention_gives_the_per_chunk_outputs_and_gradients_in_fewer_calls(tiny_dir, family):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # a trained-looking adapter, so its gradients are non-trivial
    out, pixel_grad, grads, loop_calls = _vision_pass(model, processor)
    assert pack_vision_attention(model) > 0 and uses_packed_attention(model)
    # Only the vision attention layers' copy of the config names it: the model's own config (what an export or a
    # sharded copy is built from) and the language model keep sdpa.
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    packed_out, packed_pixel_grad, packed_grads, packed_calls = _vision_pass(model, processor)
    torch.testing.assert_close(packed_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_pixel_grad, pixel_grad, rtol=1e-5, atol=1e-6)
    assert grads.keys() == packed_grads.keys() and any("visual" in n and "lora" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6)
    assert packed_calls < loop_calls  # the chunks of a length go in one call


def test_the_vision_attention_classes_still_hand_a_flash_named_implementation_the_packed_sequence():
    # The packing rides on transformers' vision attention passing `cu_seq_lens_q` to a "flash"-named function; a
    # release that changes that protocol must fail here, not silently fall back to the per-chunk loop.
    import transformers

    found = 0
    for module_name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        module = getattr(transformers.models, module_name)
        modeling = getattr(module, f"modeling_{module_name}")
        for cls_name in PACKED_VISION_ATTENTIONS:
            cls = getattr(modeling, cls_name, None)
            if cls is None or cls.__module__ != modeling.__name__:
                continue
            source = inspect.getsource(cls.forward)
            assert "is_flash_attention_requested" in source and "cu_seq_lens_q=cu_seqlens" in source, cls_name
            found += 1
    assert found >= 6


def test_packed_attention_refuses_calls_it_does_not_serve():
    q = torch.zeros(1, 2, 8, 4)
    module = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        packed_attention(module, q, q, q, attention_mask=None)  # no chunks given
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        packed_attention(module, q, q, q, attention_mask=torch.ones(1, 1, 8, 8), cu_seq_lens_q=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="self-attention"):
        packed_attention(
            module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 8]), cu_seq_lens_k=torch.tensor([0, 4, 8])
        )


def test_families_without_the_packed_protocol_and_eager_towers_are_left_alone(tiny_dir):
    gemma, _ = FastVisionModel.from_pretrained(tiny_dir("gemma3"))
    assert pack_vision_attention(gemma) == 0
    eager, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), attn_implementation="eager")
    assert pack_vision_attention(eager) == 0 and not uses_packed_attention(eager)


@pytest.mark.parametrize("packed", [True, False])
def test_the_trainer_packs_the_vision_attention_unless_switched_off(tiny_dir, tmp_path, packed):
    from vlm_grpo import VLMGRPOConfig, VLMGRPOTrainer
    from vlm_grpo.data import make_visual_reasoning_dataset

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        report_to="none", use_cpu=True, packed_vision_attention=packed,
    )  # fmt: skip
    dataset = make_visual_reasoning_dataset("color", 4, seed=0)
    trainer = VLMGRPOTrainer(model, [lambda completions, **kw: [0.0] * len(completions)], args=args,
                             train_dataset=dataset, processing_class=processor)  # fmt: skip
    base = trainer.accelerator.unwrap_model(trainer.model).get_base_model()
    assert uses_packed_attention(base) == packed
    type(base)._from_config(base.config)  # what an export builds: the config names no unknown implementation


class _CountedBounds(torch.Tensor):
    """A `cu_seqlens` tensor that counts its reads to the host (each one waits for the GPU)."""

    reads = 0

    def tolist(self):
        type(self).reads += 1
        return super().tolist()


def test_the_chunk_bounds_are_read_once_per_tensor_not_once_per_layer():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    bounds = torch.tensor([0, 4, 8, 12], dtype=torch.int32).as_subclass(_CountedBounds)
    first, _ = packed_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=bounds)
    again, _ = packed_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=bounds)  # the next layer
    assert _CountedBounds.reads == 1
    torch.testing.assert_close(again, first)
    # A new pass builds a new tensor, read afresh: bounds never carry over between images.
    other = torch.tensor([0, 6, 12], dtype=torch.int32).as_subclass(_CountedBounds)
    out, _ = packed_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=other)
    assert _CountedBounds.reads == 2
    other[1] = 4  # changed in place: read again, never the old bounds
    changed, _ = packed_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=other)
    assert _CountedBounds.reads == 3
    expected_changed = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in
                                  ((0, 4), (4, 12))], dim=2).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(changed, expected_changed)
    other[1] = 6
    expected = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in
                          ((0, 6), (6, 12))], dim=2).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(out, expected)

"""Fast generation for bitsandbytes 4-bit / 8-bit models: the stand-ins give the plain path's completions.

bitsandbytes (>= 0.46) runs on the CPU, so these are real quantised tiny models, their real PEFT adapters and TRL's
real plain path (`model.generate` through the bitsandbytes layers), compared with `trainer.fast_generator`.
"""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from test_fast_generation import ROWS, _batch, _fast, _plain, _zero_reward

from vlm_grpo.engine.fast_generation import FastGenerator, FastPathUnavailable
from vlm_grpo.engine.quantized_generation import QuantizedLayers, choose_mode, has_quantized_layers, is_quantized_linear
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

bnb = pytest.importorskip("bitsandbytes", reason="the quantised fast path needs bitsandbytes (`pip install .[quant]`)")


def _bnb_runs_on_cpu() -> bool:
    from vlm_grpo.models.loader import _bitsandbytes_runs_on_cpu

    return torch.cuda.is_available() or _bitsandbytes_runs_on_cpu()


pytestmark = pytest.mark.skipif(not _bnb_runs_on_cpu(), reason="this bitsandbytes has no CPU backend (< 0.46)")


def _quantized_trainer(tiny_dir, tmp_path, bits=4, lora_b=0.5, mode="auto", use_dora=False, **config):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), **{f"load_in_{bits}bit": True})
    # On a CPU with AVX512-BF16, bitsandbytes repacks 4-bit weights into a CPU-only layout at the first inference
    # forward (the plain path's). CUDA never does, and the fast path refuses that layout (tested below); switched
    # off here so both paths read the stored weights, as on a GPU.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = FastVisionModel.get_peft_model(model, r=4, use_dora=use_dora)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter, so applying it changes the completions
            param.data.normal_(0, lora_b)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=9, num_generations=3, max_completion_length=8,
        report_to="none", use_cpu=True, fast_generation_quantized=mode,
        generation_kwargs={"do_sample": False, "min_new_tokens": 6}, **{"max_steps": 1, **config},
    )  # fmt: skip
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(ROWS),
                          processing_class=processor)  # fmt: skip


def _quantized_state(model) -> dict[str, torch.Tensor]:
    """Every tensor the bitsandbytes layers store (packed weights, absmax, double-quantisation state, SCB)."""
    state = {}
    for name, module in model.named_modules():
        if is_quantized_linear(module):
            for key, value in module.state_dict().items():
                state[f"{name}.{key}"] = value.detach().clone()
    return state


@pytest.mark.parametrize("bits", [4, 8])
def test_light_mode_gives_the_plain_paths_greedy_tokens_and_leaves_the_quantised_weights_untouched(
    tiny_dir, tmp_path, bits
):
    # TRL casts a quantised model's adapters to bf16 (the QLoRA paper's recipe), so merging the 16-bit vision tower's
    # LoRA into its fp32 weights would round differently from applying it; unmerged, every layer computes as PEFT's.
    trainer = _quantized_trainer(tiny_dir, tmp_path, bits=bits, mode="light", fast_generation_merge_lora=False)
    model = trainer.model
    assert has_quantized_layers(model)
    before = _quantized_state(model)
    batch = _batch(trainer, ROWS, 3)
    plain = _plain(trainer, batch, 3)
    with model.disable_adapter():
        assert _plain(trainer, batch, 3) != plain  # the adapter changes the completions: applying it is visible
    assert _fast(trainer, batch) == plain
    assert trainer.fast_generator.describe_quantized()["mode"] == "light"
    assert trainer.fast_generator.stats["prefill_rows"] == 3  # one prefill per prompt group, as for 16-bit models
    after = _quantized_state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # The bitsandbytes layers (and their LoRA wrappers) are back in place after generation.
    assert sum(is_quantized_linear(m) for m in model.modules()) == len(trainer.fast_generator._quantized_layers.sites)


def test_copy_mode_matches_the_plain_path_up_to_the_rounding_of_a_merged_adapter(tiny_dir, tmp_path):
    trainer = _quantized_trainer(tiny_dir, tmp_path, mode="copy")
    model = trainer.model
    before = _quantized_state(model)
    batch = _batch(trainer, ROWS, 3)
    layers = QuantizedLayers(model, "copy")
    inputs = trainer.processing_class(text=["what colour is it?"], return_tensors="pt")
    with torch.no_grad():
        plain = model(**inputs).logits
        with layers.swapped():
            merged = model(**inputs).logits
    # PEFT applies the adapter unmerged in its own dtype (bf16: TRL casts QLoRA adapters to it); "copy" adds its
    # delta to the dequantised weight. The two round differently, by far less than the adapter's own effect.
    with torch.no_grad(), model.disable_adapter():
        base = model(**inputs).logits
    gap, effect = (merged - plain).abs().max().item(), (base - plain).abs().max().item()
    assert gap < 0.05 * effect, (gap, effect)
    assert torch.equal(merged.argmax(-1), plain.argmax(-1))
    # Completions come from the compiled-path code with the copy in place, and the stored weights are untouched.
    completions = _fast(trainer, batch)
    assert len(completions) == 9 and min(len(c) for c in completions) >= 6
    assert trainer.fast_generator.describe_quantized()["mode"] == "copy"
    assert trainer.fast_generator.describe_quantized()["copy_gib"] > 0
    after = _quantized_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_copy_mode_follows_the_adapter_as_it_trains(tiny_dir, tmp_path):
    # The copy buffers are allocated once and refreshed at every generation: an optimizer step between two
    # generations must reach the second one, or rollouts would come from a stale policy.
    trainer = _quantized_trainer(tiny_dir, tmp_path, mode="copy", lora_b=0.0, fast_generation_merge_lora=False)
    batch = _batch(trainer, ROWS, 2)
    first = _fast(trainer, batch)
    buffers = [s.replacement.weight.data_ptr() for s in trainer.fast_generator._quantized_layers.sites]
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    second = _fast(trainer, batch)
    assert [s.replacement.weight.data_ptr() for s in trainer.fast_generator._quantized_layers.sites] == buffers
    # A generator built after the update (fresh copies) gives the same completions; the stale copy would not.
    trainer.fast_generator = FastGenerator(quantized="copy", merge_lora=False)
    assert second != first and second == _fast(trainer, batch)


def test_dora_on_a_quantised_base_takes_the_plain_path_and_says_why(tiny_dir, tmp_path):
    trainer = _quantized_trainer(tiny_dir, tmp_path, use_dora=True, lora_b=0.0)
    batch = _batch(trainer, ROWS, 3)
    with pytest.raises(FastPathUnavailable, match="DoRA"):
        _fast(trainer, batch)
    # Nothing was swapped: the model's layers are the bitsandbytes ones and generate as before.
    assert has_quantized_layers(trainer.model)
    assert len(_plain(trainer, batch, 3)) == 9


def test_weights_repacked_for_the_cpu_kernel_are_refused_not_misread(tiny_dir, tmp_path):
    trainer = _quantized_trainer(tiny_dir, tmp_path, mode="light")
    batch = _batch(trainer, ROWS, 3)
    _fast(trainer, batch)  # stand-ins built from the stored layout
    for module in trainer.model.modules():
        if is_quantized_linear(module) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = True
    try:
        _plain(trainer, batch, 3)  # bitsandbytes repacks here, on CPUs with AVX512-BF16
    finally:
        repacked = any(getattr(getattr(m, "weight", None), "quant_state", None) is not None
                       and getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                       for m in trainer.model.modules())  # fmt: skip
    if not repacked:
        pytest.skip("this CPU has no AVX512-BF16, so bitsandbytes keeps the stored layout")
    with pytest.raises(FastPathUnavailable, match="repacked"):
        _fast(trainer, batch)


@pytest.mark.trains
def test_training_a_4bit_model_generates_on_the_fast_path(tiny_dir, tmp_path, caplog):
    trainer = _quantized_trainer(tiny_dir, tmp_path, lora_b=0.0, max_steps=2, learning_rate=1e-2)
    before = _quantized_state(trainer.model)
    with caplog.at_level(logging.INFO, logger="vlm_grpo"):
        trainer.train()
    assert trainer.fast_generator.stats["calls"] == 2
    assert not any("Fast generation is off" in r.getMessage() for r in caplog.records)
    # "auto" chose, and said which: on the CPU there is no memory question, so "copy".
    assert any("quantised layers: copy mode" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(before[k], v) for k, v in _quantized_state(trainer.model).items())


def test_auto_keeps_a_quarter_of_the_memory_for_training():
    gib = 2**30
    assert choose_mode(6 * gib, 70 * gib, 80 * gib)[0] == "copy"  # a 3B copy on an 80 GB card
    assert choose_mode(14 * gib, 18 * gib, 24 * gib)[0] == "light"  # a 7B copy under a 24 GiB cap
    mode, why = choose_mode(10 * gib, 15 * gib, 24 * gib)  # fits, but would leave training under 6 GiB
    assert mode == "light" and "10.0 GiB" in why and "6.0 GiB kept for training" in why


def test_the_config_refuses_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="fast_generation_quantized must be one of auto, copy, light"):
        VLMGRPOConfig(output_dir=str(tmp_path), fast_generation_quantized="fast", use_cpu=True, report_to="none")

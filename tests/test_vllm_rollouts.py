"""TRL's vLLM generation given vLLM's placeholder form and checked (`engine.vllm_rollouts`), and the trainer's
`use_vllm=True` set-up as far as it runs without a GPU.

vLLM cannot run here (no GPU): what it does with the prompts is measured on the H100 (`benchmarks/vllm_gap.py`,
`tests/gpu/test_gpu_vllm.py`). Here: the collapse and the check, the refusals before vLLM would load, the pixel
budget handed to TRL's `LLM(...)`, and the names TRL's weight sync gives vLLM for our models.
"""

from __future__ import annotations

import pytest
import torch
from conftest import colour_rows
from datasets import Dataset

from vlm_grpo.compat import checkpointing_settings
from vlm_grpo.engine.vllm_rollouts import check_expansion, collapse_placeholders, engine_settings
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


def _reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def test_placeholder_runs_collapse_to_one_and_other_tokens_stay():
    assert collapse_placeholders([5, 9, 9, 9, 6, 9, 9, 7, 7], {9}) == [5, 9, 6, 9, 7, 7]
    assert collapse_placeholders([9, 8, 8, 9], {8, 9}) == [9, 8, 9]
    assert collapse_placeholders([], {9}) == []


def test_a_prompt_vllm_expanded_otherwise_stops_the_run_naming_both_lengths():
    ours = [[1, 9, 9, 2], [1, 2]]
    check_expansion(ours, [[1, 9, 9, 2], [1, 2]], {9})
    with pytest.raises(ValueError, match=r"row 0 from a prompt of 6 tokens \(4 image / video placeholders\) where "
                       r"the trainer scores 4 \(2\)"):  # fmt: skip
        check_expansion(ours, [[1, 9, 9, 9, 9, 2], [1, 2]], {9})
    with pytest.raises(ValueError, match="returned 1 prompts for 2"):
        check_expansion(ours, [[1, 2]], {9})


def test_the_pixel_budget_reaches_trls_llm_and_is_taken_back(tiny_dir, monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), min_pixels=56 * 56, max_pixels=112 * 112)
    seen = {}

    def llm(**kwargs):  # TRL's `LLM` as the colocate path calls it (vLLM itself cannot load without a GPU)
        seen.update(kwargs)

    monkeypatch.setattr(trl_vllm, "LLM", llm, raising=False)
    with engine_settings(processor):
        trl_vllm.LLM(model="m")
    assert seen == {"model": "m", "mm_processor_kwargs": {"min_pixels": 56 * 56, "max_pixels": 112 * 112}}
    assert trl_vllm.LLM is llm


def _config(tmp_path, **kwargs):
    return VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        report_to="none", use_cpu=True, **checkpointing_settings(False, {}), **kwargs,
    )  # fmt: skip


def _rows(**extra):
    row = colour_rows("qwen2_5_vl")["one"]
    return Dataset.from_list([{**row, **extra}] * 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "no vLLM equivalent"), ({}, "install vLLM")],
)
def test_use_vllm_refuses_before_vllm_loads(tiny_dir, tmp_path, kwargs, message):
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed: TRL would load it")
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    with pytest.raises((ValueError, ImportError), match=message):
        VLMGRPOTrainer(model, [_reward], args=_config(tmp_path, use_vllm=True, **kwargs), train_dataset=_rows(),
                       processing_class=processor)  # fmt: skip


def _sync(model, cls):
    """The weight sync of `cls` (TRL's `VLLMGeneration` or ours) alone, with no LLM behind it."""
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend

    sync = cls.__new__(cls)
    sync.model, sync.accelerator = model, Accelerator(cpu=True)
    sync._dist = DistributedBackend(sync.accelerator)
    return {name: value.clone() for name, value in sync._iter_named_params()}


def _lora_model(path, dtype=torch.float32):
    model, processor = FastVisionModel.from_pretrained(path, dtype=dtype)
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True)
    for name, param in model.named_parameters():  # non-zero adapters, so the merge shows in the synced values
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model, processor


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_weight_sync_gives_vllm_the_checkpoints_names_and_merged_weights(tiny_dir, tmp_path, family):
    """Each weight named as transformers names the model it loads from the checkpoint (the names vLLM's loader maps:
    it loaded the checkpoint under them), with the adapters merged as TRL's own sync merges them; our trainer's
    changes to the model (LoRA on the vision tower, packed vision attention, requires-grad hooks, a deleted reference
    adapter) rename or drop none."""
    from transformers import AutoModelForImageTextToText
    from trl.generation.vllm_generation import VLLMGeneration

    from vlm_grpo.engine.vllm_rollouts import CheckedVLLMGeneration

    path = tiny_dir(family)
    model, processor = _lora_model(path)
    trainer = VLMGRPOTrainer(model, [_reward], args=_config(tmp_path), train_dataset=_rows(),
                             processing_class=processor)  # fmt: skip
    ours, trls = _sync(trainer.model, CheckedVLLMGeneration), _sync(trainer.model, VLLMGeneration)
    expected = dict(AutoModelForImageTextToText.from_pretrained(path).named_parameters())
    assert set(ours) == set(trls) == set(expected)
    for name in ours:
        torch.testing.assert_close(ours[name], trls[name], rtol=1e-5, atol=1e-6)
    changed = [n for n in ours if not torch.equal(ours[n], expected[n])]
    assert any("visual" in n for n in changed) and any("language_model" in n for n in changed)


def test_the_weight_sync_leaves_bf16_base_weights_bit_identical(tiny_dir):
    """TRL merges the adapters into the base weights and unmerges them; in bf16 that round trip rounds, so the frozen
    weights (and the KL reference, the model with its adapters off) move at every sync. Ours merges out of place."""
    from trl.generation.vllm_generation import VLLMGeneration

    from vlm_grpo.engine.vllm_rollouts import CheckedVLLMGeneration

    model, _ = _lora_model(tiny_dir("qwen2_5_vl"), dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    _sync(model, CheckedVLLMGeneration)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    _sync(model, VLLMGeneration)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)

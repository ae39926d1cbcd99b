"""The sampler's log-probs beside the loss's (`sampler_logprobs`): a batch TRL's importance-sampling mask zeroes whole
trains on nothing, and is said."""

from __future__ import annotations

import logging

import pytest
from conftest import colour_rows
from datasets import Dataset

from vlm_grpo.compat import checkpointing_settings
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.sampler_logprobs import MASKED_METRIC
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


def _varied(prompts, completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


@pytest.mark.trains
@pytest.mark.parametrize(("clip_max", "masked"), [(0.5, 1.0), (3.0, 0.0)])
def test_a_batch_the_mask_zeroes_whole_is_logged_and_said(tiny_dir, tmp_path, caplog, clip_max, masked):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    rows = [colour_rows("qwen2_5_vl")["one"]] * 4
    args = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
        max_steps=1, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        fast_generation_importance_sampling=True, vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=clip_max, **checkpointing_settings(False, {}),
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_varied], args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=processor)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.training.sampler_logprobs"):
        trainer.train()
    logged = [h[MASKED_METRIC] for h in trainer.state.log_history if MASKED_METRIC in h]
    assert logged == [masked]  # ratios ~1 (the fast path scores what it sampled): all above 0.5, none above 3
    said = [r for r in caplog.records if "masked every sequence" in r.getMessage()]
    assert len(said) == (1 if masked else 0)

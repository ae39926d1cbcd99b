"""`benchmarks/forced_tools.py`: `grpo_step.py --tools N` rollouts, run on CPU with the tiny Qwen2.5-VL.

Every rollout calls `crop` N times whatever the random model samples, on the fast generator and on TRL's `generate`
alike; a random model also samples special tokens, and a video pad sampled in one turn used to crash the next turn's
prompt (its mm_token_type_ids named a video with no clip behind it): with tools the trainer blocks it.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import forced_tools
from grpo_step import _dataset, _reward

from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tools import image_tools
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")


@pytest.mark.trains
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "trl-generate"])
def test_every_rollout_calls_crop_n_times_and_trains(tiny_dir, tmp_path, fast):
    args = argparse.Namespace(tools=2, completion_length=6, image_size=64, prompts=2, steps=2, video_frames=0)
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=8, lora_alpha=8)
    config = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True, bf16=False,
        max_steps=2, report_to="none", save_strategy="no", logging_steps=1, fast_generation=fast,
        **forced_tools.tool_settings(args),
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_reward], args=config, train_dataset=_dataset(args), processing_class=processor,
                             environment_factory=image_tools("crop"))  # fmt: skip
    forced_tools.force_calls(trainer, args.image_size)
    trainer.train()
    assert model.config.video_token_id in trainer.generation_config.suppress_tokens
    history = trainer.state.log_history
    assert [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h] == [2.0, 2.0]
    assert [h["completions/mean_length"] for h in history if "completions/mean_length" in h] == [18.0, 18.0]
    stats = forced_tools.tool_stats(history)
    assert stats == {"calls_per_rollout": 2.0, "failure_share": 0.0}
    assert "| vlm-grpo | 3.00 | 2.00 | 0.00 |" in forced_tools.markdown({"vlm-grpo": [{"tools": stats}]}, args)
    if fast:  # three turns per step on the fast generator, the later two continuing the first's KV cache
        assert trainer.fast_generator.stats["calls"] == 6 and trainer.fast_generator.stats["appended_rows"] > 0
        assert not trainer._fast_generation_fallbacks

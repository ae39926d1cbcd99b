"""Rollouts through vLLM (`use_vllm=True`, colocate) on a real architecture (Qwen2.5-VL-3B, random weights).

Skipped without CUDA or vLLM. Run on a GPU machine with vLLM installed (pip install 'vlm-grpo[vllm]'):
    python -m pytest tests/gpu/test_gpu_vllm.py -q -s
"""

import importlib.util
import math
import os
import sys

import pytest
import torch
from conftest import changed_weights, lora_b_weights

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs a CUDA GPU and vLLM"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _dataset(n=4, size=448):
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": "Describe the image ."}],
         "image": Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))} for _ in range(n)
    ])  # fmt: skip


def _varied(prompts, completions, **kwargs):
    return [float(len(str(c)) % 5) for c in completions]


def test_vllm_rollouts_train_with_the_samplers_log_probs_scored(tmp_path):
    from real_arch import build_checkpoint

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer

    checkpoint = build_checkpoint("qwen2.5-vl-3b", "/tmp/vlm-grpo-bench/qwen2.5-vl-3b")
    model, processor = FastVisionModel.from_pretrained(checkpoint)
    model = FastVisionModel.get_peft_model(model, r=16)
    before = lora_b_weights(model)
    bases = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    config = VLMGRPOConfig(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=16, num_generations=8, max_completion_length=64,
        generation_kwargs={"min_new_tokens": 64}, learning_rate=1e-3, max_steps=3, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=4096,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_varied], args=config, train_dataset=_dataset(), processing_class=processor)
    trainer.train()
    logs = trainer.state.log_history
    gaps = [h["sampling/sampling_logp_difference/mean"] for h in logs if "sampling/sampling_logp_difference/mean" in h]
    ratios = [
        h["sampling/importance_sampling_ratio/mean"] for h in logs if "sampling/importance_sampling_ratio/mean" in h
    ]
    losses = [h["loss"] for h in logs if "loss" in h]
    print("gaps", gaps, "ratios", ratios, "losses", losses)
    assert len(gaps) == 3 and max(gaps) < 0.1  # was ~1 nat with the prompt vLLM expanded twice
    assert min(ratios) > 0.5  # the importance-sampling mask keeps the sequences
    assert losses and all(math.isfinite(x) for x in losses)
    assert changed_weights(trainer.model, before) == set(before)  # every adapter moved
    assert not changed_weights(trainer.model, bases)  # the frozen weights did not (out-of-place merge for the sync)

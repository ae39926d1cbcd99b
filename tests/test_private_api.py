"""The private TRL / transformers APIs listed in `vlm_grpo.private_api` are what the installed libraries have.

A release that renames or re-signs one fails here, naming it, rather than in a user's training run.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from datasets import Dataset

from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.private_api import (
    FUSED_LM_HEAD_KEYWORDS,
    OVERRIDDEN,
    TRAINER_ATTRIBUTES,
    PrivateMethod,
    signature_drift,
)
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


def test_every_private_method_has_the_signature_it_was_tested_with():
    assert signature_drift() == []


def test_a_changed_signature_is_named():
    changed = PrivateMethod("trl:GRPOTrainer", "_generate", ("prompts", "new_parameter"), "a test")
    gone = PrivateMethod("trl:GRPOTrainer", "_no_such_method", (), "a test")
    drift = signature_drift((changed, gone))
    assert len(drift) == 2
    assert drift[0].startswith("trl:GRPOTrainer._generate: tested with ('prompts', 'new_parameter')")
    assert drift[1] == "trl:GRPOTrainer._no_such_method: gone (used by a test)"


def test_our_overrides_take_what_trl_passes():
    from vlm_grpo.engine.vllm_rollouts import CheckedVLLMGeneration

    for method in OVERRIDDEN:
        owner = CheckedVLLMGeneration if method.owner.endswith(":VLLMGeneration") else VLMGRPOTrainer
        ours = inspect.signature(getattr(owner, method.name))
        ours.bind(None, **dict.fromkeys(method.parameters))  # raises TypeError naming the parameter it cannot take


@pytest.fixture(scope="module")
def trainer(tiny_dir, tmp_path_factory):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(output_dir=str(tmp_path_factory.mktemp("private-api")), per_device_train_batch_size=2,
                         num_generations=2, max_completion_length=4, report_to="none", use_cpu=True)  # fmt: skip
    rows = Dataset.from_list([{"prompt": "hello", "images": []}] * 2)
    return VLMGRPOTrainer(model, [lambda prompts, completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=rows, processing_class=processor)  # fmt: skip


def test_the_trl_attributes_the_trainer_reads_exist(trainer):
    missing = [name for name in TRAINER_ATTRIBUTES if name not in vars(trainer)]
    assert missing == []


@pytest.mark.trains  # TRL 1.15's fused LM head is a Triton kernel: CUDA only
def test_trls_fused_lm_head_takes_the_keywords_shared_prefix_passes(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    input_ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[2, 3, 4, -100]])
    out = model(input_ids=input_ids, **dict(zip(FUSED_LM_HEAD_KEYWORDS, (True, labels))))
    assert out.log_probs.shape == (1, 4) and torch.isfinite(out.log_probs[0, :3]).all()

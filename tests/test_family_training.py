"""Every supported family trains by default: loaded (here without torchvision, which CI does not install), LoRA on the vision and the language side, two
GRPO steps with `VLMGRPOConfig`'s default settings on CPU, both sides' adapters moved, and the fast paths used where the
family's record says they serve (no fallback logged).

`TRAINED_FAMILIES` is the list of issue #37's table (gemma3n aside: no tiny model without timm); add a family by
appending its model type (it must have a tiny builder: `vlm_grpo.tiny`).
"""

import logging
import random

import pytest
from datasets import Dataset
from PIL import Image

from vlm_grpo.families import FAMILIES
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.evaluation import evaluate
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

TRAINED_FAMILIES = [
    "qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "llava_onevision", "paligemma", "glm4v", "glm46v", "internvl",
    "smolvlm", "mistral3", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "lfm2_vl",
]  # fmt: skip
# Families whose fast generation falls back to TRL's `generate`, with the reason (none today).
FAST_GENERATION_FALLBACKS: dict[str, str] = {}
# Families whose shared-prefix scoring falls back, with the reason: TRL adds the MoE router's load-balancing loss
# (`router_aux_loss_coef` non-zero, as in the real checkpoints), which needs its unpacked rows.
SHARED_PREFIX_FALLBACKS = {"qwen3_vl_moe": "load-balancing loss", "qwen3_5_moe": "load-balancing loss"}


def _rows() -> list[dict]:
    """Two prompts of different lengths: one with a square image, one with two images of different shapes."""
    red, blue = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 255))
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "which ?"}]}]
    return [{"prompt": one, "images": [red]}, {"prompt": two, "images": [red, blue]}] * 2


def _random_reward(prompts, completions, **kwargs):
    return [random.random() for _ in completions]  # varied rewards: non-zero advantages, so the adapters move


def _lora_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _is_vision(name: str, family) -> bool:
    return f".{family.vision_tower}." in name or f".{family.projector}." in name


@pytest.mark.trains
@pytest.mark.parametrize("family", TRAINED_FAMILIES)
def test_family_trains_with_default_settings(tiny_dir, tmp_path, family, caplog):
    record = FAMILIES[family]
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True, finetune_language_layers=True)
    before = _lora_weights(model)
    assert any(_is_vision(n, record) for n in before) and any(not _is_vision(n, record) for n in before)
    random.seed(0)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_random_reward], args=args, train_dataset=Dataset.from_list(_rows()),
                             processing_class=processor)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2
    changed = {n for n, p in model.named_parameters() if n in before and not p.detach().equal(before[n])}
    assert any(_is_vision(n, record) for n in changed), "no vision-side LoRA weight moved"
    assert any(not _is_vision(n, record) for n in changed), "no language-side LoRA weight moved"
    fallbacks = trainer._fast_generation_fallbacks
    if family in FAST_GENERATION_FALLBACKS:
        assert any(FAST_GENERATION_FALLBACKS[family] in reason for reason in fallbacks)
    else:
        assert not fallbacks, fallbacks
    shared = getattr(trainer, "shared_prefix_fallbacks", {})
    if family in SHARED_PREFIX_FALLBACKS:
        assert any(SHARED_PREFIX_FALLBACKS[family] in reason for reason in shared), shared
    else:
        assert (trainer.shared_prefix_calls > 0 and not shared) == record.shared_prefix, shared
    # The accuracy before / after training the command reports: evaluation generates with the same processor.
    metrics = evaluate(model, processor, Dataset.from_list(_rows()[:2]), [_random_reward], max_new_tokens=3)
    assert 0.0 <= metrics["mean_reward"] <= 1.0

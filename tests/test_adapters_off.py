"""`vlm_grpo.engine.adapters_off`: a fresh adapter's KL reference by the LoRA layers' own flags gives PEFT's
`disable_adapter()` log-probs, puts every flag back, leaves frozen adapters frozen, and is not used where it cannot
give the reference (other PEFT settings keep TRL's path)."""

from __future__ import annotations

import pytest
import torch
from conftest import trl_logps
from datasets import Dataset
from test_shared_prefix import COLORS, MULTIMODAL, _rows, _zero_reward
from trl.trainer.utils import use_adapter

from vlm_grpo.engine.adapters_off import AdaptersOff, layers_to_switch
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


def _trainer(tiny_dir, tmp_path, **lora):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4, **lora)  # fresh: every B zero, so TRL keeps no "ref" copy
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2, max_completion_length=6,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, beta=0.04,
    )  # fmt: skip
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(_rows("qwen2_5_vl")),
                          processing_class=processor)  # fmt: skip


def _inputs(trainer):
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(_rows("qwen2_5_vl"))
    return {
        "input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
        "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
        "logits_to_keep": batch["completion_ids"].size(1),
        **{k: batch[k] for k in MULTIMODAL if k in batch},
    }


@pytest.mark.trains
def test_reference_log_probs_are_peft_disable_adapters(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    assert isinstance(trainer.ref_model, AdaptersOff)  # handed to TRL as its reference
    model = trainer.model
    inputs = _inputs(trainer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # a trained adapter: the reference must differ from the policy
                param.normal_(0, 0.5)
    frozen = next(p for n, p in model.named_parameters() if "lora_A" in n)
    frozen.requires_grad_(False)  # a user's frozen adapter stays frozen (PEFT's exit would unfreeze it)
    layers = trainer.ref_model.layers
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, **inputs)
        assert layers and not any(layer.disable_adapters for layer in layers)  # every flag put back
        with use_adapter(model, None):  # TRL's own reference for a fresh adapter
            peft_reference, _, _ = trl_logps(trainer, model, **inputs)
        frozen.requires_grad_(False)
        policy, _, _ = trainer._get_per_token_logps_and_entropies(model, **inputs)
    mask = inputs["attention_mask"][:, -inputs["logits_to_keep"] :].bool()
    assert (ours - peft_reference)[mask].abs().max() < 1e-5
    assert (policy - peft_reference)[mask].abs().max() > 1e-2  # the adapter matters: the comparison can fail
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.ref_model, **inputs)
    assert not frozen.requires_grad


def test_flags_come_back_when_the_block_raises(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    layers = trainer.ref_model.layers
    layers[0]._disable_adapters = True  # switched off by its owner before: found so, given back so
    with pytest.raises(RuntimeError, match="inside"), trainer.ref_model.switched_off() as policy:
        assert policy is trainer.model and all(layer.disable_adapters for layer in layers)
        raise RuntimeError("inside")
    assert layers[0].disable_adapters and not any(layer.disable_adapters for layer in layers[1:])


def test_other_peft_settings_keep_trls_reference(tiny_dir, tmp_path):
    # PEFT swaps modules_to_save back to the originals when it disables the adapters: its path, not the flags.
    trainer = _trainer(tiny_dir, tmp_path, modules_to_save=["lm_head"])
    assert layers_to_switch(trainer.model) is None
    assert trainer.ref_model is None  # TRL's `use_adapter` path
    # A LoRA bias stays on when PEFT disables the adapters.
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    assert layers_to_switch(FastVisionModel.get_peft_model(model, r=4, bias="lora_only")) is None


def test_a_ref_adapter_is_activated_not_switched_off(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4)
    assert layers_to_switch(model)
    model.add_adapter("ref", model.peft_config["default"])
    assert layers_to_switch(model) is None

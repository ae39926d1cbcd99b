"""A saved LoRA adapter folder loads with `FastVisionModel.from_pretrained`: its base, then the adapter, trainable."""

import json

import pytest
import torch
from peft import PeftModel

from vlm_grpo.models.loader import FastVisionModel


def _logits(model, processor) -> torch.Tensor:
    ids = processor.tokenizer("what colour is it", return_tensors="pt").input_ids
    FastVisionModel.for_inference(model)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_an_adapter_folder_loads_as_its_base_with_the_adapter_trainable(tiny_dir, tmp_path):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter: it changes the outputs
            param.data.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "final")
    assert not (tmp_path / "final" / "config.json").exists()  # only the adapter, as `vlm-grpo --use_peft` writes it

    loaded, loaded_processor = FastVisionModel.from_pretrained(str(tmp_path / "final"))
    assert isinstance(loaded, PeftModel) and type(loaded_processor) is type(processor)
    assert any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" not in n)
    assert torch.allclose(_logits(loaded, loaded_processor), _logits(model, processor), atol=1e-5)


def test_an_adapter_without_a_base_or_asked_to_full_tune_is_refused(tiny_dir, tmp_path):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    FastVisionModel.get_peft_model(model, r=4).save_pretrained(tmp_path / "final")
    with pytest.raises(ValueError, match="is a LoRA adapter: merge it"):
        FastVisionModel.from_pretrained(str(tmp_path / "final"), full_finetuning=True)
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    (tmp_path / "final" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="names no base model"):
        FastVisionModel.from_pretrained(str(tmp_path / "final"))

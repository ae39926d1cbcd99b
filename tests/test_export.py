import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlm_grpo.models.export import atomic_directory
from vlm_grpo.models.loader import FastVisionModel


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_directory_output_follows_the_umask(tmp_path, umask_022):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))  # safetensors writes 0600
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # mkdtemp's 0700 must not leak
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((target / "config.json").stat().st_mode) == 0o644


def test_atomic_directory_replaces_the_old_version_and_keeps_it_on_failure(tmp_path):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        open(os.path.join(tmp, "b"), "w").close()
        raise RuntimeError("crash mid-write")
    assert sorted(os.listdir(target)) == ["a"] and sorted(os.listdir(tmp_path)) == ["final"]


def _keys(directory) -> list[str]:
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_merged_export_is_what_save_pretrained_writes(tiny_dir, tmp_path, family):
    path = tiny_dir(family)
    model, processor = FastVisionModel.from_pretrained(path)
    model = FastVisionModel.get_peft_model(model, r=4)
    base_config = model.get_base_model().config
    base_config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # as on a 4-bit base
    out = FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged")
    # The checkpoint's own key names (transformers' save format, as in the checkpoint it was loaded from; Gemma 3's
    # tied lm_head left out), not the in-memory module names.
    assert _keys(out) == _keys(path)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config  # the merged weights are plain 16-bit
    assert config["dtype"] == config["text_config"]["dtype"] == config["vision_config"]["dtype"] == "float16"
    assert base_config.quantization_config and base_config.dtype == torch.float32  # the live model is untouched
    assert os.path.exists(os.path.join(out, "generation_config.json"))
    assert os.path.exists(os.path.join(out, "processor_config.json"))


def test_merged_export_keeps_a_trained_modules_to_save_copy(tiny_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False, modules_to_save=["lm_head"])
    FastVisionModel.for_inference(model)
    with torch.no_grad():
        trained_head = model.get_base_model().lm_head.modules_to_save["default"]
        trained_head.weight.add_(torch.randn_like(trained_head.weight))  # as if training had changed the copy
    inputs = processor(text=["<|im_start|>user\nhi<|im_end|>\n"], return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).logits
    out = FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()(**inputs).logits
    torch.testing.assert_close(reloaded, expected, atol=1e-4, rtol=1e-4)


def test_dora_adapters_are_refused_not_merged_wrong(tiny_dir, tmp_path):
    # Adding DoRA's delta without its magnitude rescaling would write a model that is not the trained one.
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, use_dora=True)
    with pytest.raises(NotImplementedError, match=r"DoRA.*merge_and_unload"):
        FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()  # nothing half-written

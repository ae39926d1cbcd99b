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


def _trained_like(model) -> None:
    """Every LoRA tensor (A, B, DoRA magnitudes, trained biases) moved off its initial value, as training moves it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05 * torch.randn_like(param))


def _logits(model, processor) -> torch.Tensor:
    inputs = processor(text=["<|im_start|>user\nhi there<|im_end|>\n"], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


QKV = {"target_modules": ["q_proj", "k_proj", "v_proj"]}  # Qwen2's attention projections with a bias


EMBEDDING = {"target_modules": ["embed_tokens", "q_proj"]}  # an Embedding's LoRA: its own lora_embedding_A / B


@pytest.mark.parametrize("kwargs", [{"use_dora": True}, {"lora_bias": True, **QKV}, EMBEDDING])  # DoRA + bias: refused
def test_dora_and_trained_biases_merge_as_peft_merges_them(tiny_dir, tmp_path, kwargs):
    # DoRA rescales each merged row by its magnitude vector, and `lora_bias` trains a bias: adding the delta alone
    # (what the export did for every adapter) writes a model that is not the trained one.
    import copy

    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, **kwargs)
    FastVisionModel.for_inference(model)
    _trained_like(model)
    expected = _logits(model, processor)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    out = FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged", dtype=torch.float32)
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    for name, tensor in reloaded.state_dict().items():  # PEFT's own merge, tensor by tensor
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(_logits(reloaded, processor), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_logits(model, processor), expected)  # the live model is untouched


def test_an_adapter_variant_the_export_cannot_merge_is_refused_not_merged_wrong(tiny_dir, tmp_path):
    # DoRA on an embedding: a variant `merged_state_dict` does not merge; nothing half-written.
    from peft import LoraConfig, get_peft_model

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens"], use_dora=True))
    with pytest.raises(
        NotImplementedError, match=r"embed_tokens is a DoraEmbedding adapter \(default\).*merge_and_unload"
    ):
        FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged")
    # A bias trained on a layer without one: no place for it in the checkpoint.
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, lora_bias=True, target_modules=["o_proj"])
    with pytest.raises(NotImplementedError, match=r"o_proj trained a bias \(lora_bias=True.*model.save_pretrained"):
        FastVisionModel.save_pretrained_merged(model, processor, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()

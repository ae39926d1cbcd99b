import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlm_grpo.model import FastVisionModel
from vlm_grpo.tiny import TINY_FAMILIES, build_tiny_vlm

EXPECTED_TYPES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}


# The five families and any family tiny.py adds: each must build, and as its expected architecture.
FAMILIES = sorted(set(EXPECTED_TYPES) | set(TINY_FAMILIES))


@pytest.mark.parametrize("family", FAMILIES)
def test_build_writes_small_complete_checkpoint(tiny_dir, family):
    path = tiny_dir(family)
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert "chat_template.jinja" in files or "chat_template.json" in files
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    assert size < 5 * 1024 * 1024
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == [EXPECTED_TYPES[family]]


@pytest.mark.parametrize("family", FAMILIES)
def test_load_and_generate_from_image_prompt(tiny_dir, family):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    assert type(model).__name__ == EXPECTED_TYPES[family]
    assert processor.tokenizer.padding_side == "left"
    FastVisionModel.for_inference(model)
    messages = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[[Image.new("RGB", (56, 56), (255, 0, 0))]], return_tensors="pt")
    image_token_id = model.config.image_token_id if hasattr(model.config, "image_token_id") else None
    image_token_id = image_token_id or model.config.image_token_index
    assert (inputs["input_ids"] == image_token_id).sum() == 4  # every tiny family: 4 image tokens per image
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=True)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_same_seed_same_weights_and_words_are_single_tokens(tmp_path):
    a = build_tiny_vlm("qwen2_5_vl", tmp_path / "a", seed=3, words=["magenta", "heptagon"])
    b = build_tiny_vlm("qwen2_5_vl", tmp_path / "b", seed=3, words=["magenta", "heptagon"])
    c = build_tiny_vlm("qwen2_5_vl", tmp_path / "c", seed=4)
    ma, mb, mc = (AutoModelForImageTextToText.from_pretrained(p) for p in (a, b, c))
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(ma.lm_head.weight, mc.lm_head.weight)
    _, processor = FastVisionModel.from_pretrained(a)
    assert len(processor.tokenizer("magenta")["input_ids"]) == 1
    assert processor.tokenizer.decode(processor.tokenizer("heptagon magenta")["input_ids"]) == "heptagon magenta"


def test_unknown_family_names_the_choices():
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        build_tiny_vlm("llava_next")


def test_bad_image_size_and_words(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4"):
        build_tiny_vlm("gemma3", tmp_path / "g", image_size=30)
    with pytest.raises(ValueError, match="single words"):
        build_tiny_vlm("gemma3", tmp_path / "g", words=["two words"])

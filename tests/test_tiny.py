import json
import os
import stat

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tiny import MAX_LEARNABLE_WORDS, TINY_FAMILIES, build_tiny_vlm, offline_learning_note, split_words

EXPECTED_TYPES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "lfm2_vl": "Lfm2VlForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "paligemma": "PaliGemmaForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "glm46v": "Glm46VForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}
# Image tokens of one 56x56 image: 4 in every tiny family but LLaVA-OneVision (a base view, a tile, their newlines).
IMAGE_TOKENS = {"llava_onevision": 10}


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
    inputs.pop("labels", None)  # PaliGemma's processor returns them (all -100): not a generation input
    image_token_id = model.config.image_token_id if hasattr(model.config, "image_token_id") else None
    image_token_id = image_token_id or model.config.image_token_index
    assert (inputs["input_ids"] == image_token_id).sum() == IMAGE_TOKENS.get(family, 4)
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


def test_without_a_directory_it_writes_to_a_named_cache_folder_that_follows_the_umask(tmp_path, monkeypatch):
    # The README's quickstart used to leave a 0700 temporary directory behind, its weights 0600.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        path = build_tiny_vlm("qwen2_5_vl", words=["magenta"])
        assert build_tiny_vlm("qwen2_5_vl", words=["magenta"]) == path  # the same settings, the same folder
    finally:
        os.umask(old)
    assert os.path.dirname(path) == str(tmp_path / "cache" / "vlm_grpo" / "tiny-models")
    assert os.path.basename(path).startswith("qwen2_5_vl-") and path != build_tiny_vlm("qwen2_5_vl", seed=1)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    assert {stat.S_IMODE(os.stat(os.path.join(path, f)).st_mode) for f in os.listdir(path)} == {0o644}


def test_split_words_is_how_the_tiny_tokenizer_splits(tmp_path):
    text = "What colour is the square? Answer: 3.5 (New-York)"
    path = build_tiny_vlm("qwen2_5_vl", tmp_path / "m", words=split_words(text))
    _, processor = FastVisionModel.from_pretrained(path)
    tokens = processor.tokenizer.tokenize(text)
    assert tokens == split_words(text) and "<unk>" not in tokens


def test_offline_learning_note_says_why_a_tiny_model_will_not_learn():
    colours = ["red", "green", "blue"]
    assert offline_learning_note(["What", "colour", "square", *colours], colours * 10) is None
    several = offline_learning_note(["dark", "red"], ["dark red", "red", ["light blue", "blue"]])
    assert several.startswith("1 of 3 gold answers are several tokens to the offline tiny model (e.g. 'dark red'")
    assert offline_learning_note(["3", ".", "5"], ["3.5"]).startswith("1 of 1 gold answers")  # 3 . 5: three tokens
    many = offline_learning_note([f"word{i}" for i in range(MAX_LEARNABLE_WORDS)], colours)
    assert f"over {MAX_LEARNABLE_WORDS}" in many and "--model" in many


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_completions_of_one_prompt_differ(tiny_dir, family):
    # A GRPO group learns only from completions that differ; a tiny random model must not repeat one answer.
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    FastVisionModel.for_inference(model)
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[[Image.new("RGB", (56, 56), (0, 0, 255))]], return_tensors="pt")
    inputs.pop("labels", None)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=True, num_return_sequences=4)
    completions = {tuple(row) for row in out[:, inputs["input_ids"].shape[1] :].tolist()}
    assert len(completions) >= 3


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_a_tool_build_reads_its_tools_schemas_in_few_tokens(tiny_dir, family):
    """`tools=True` learns the pieces of a tool conversation (Qwen's tool boilerplate, the image tools' schemas, a
    call's JSON) as tokens: a zoom prompt is under 400 tokens instead of about 700 bytes-as-tokens, decoded exactly."""
    import doctest

    from vlm_grpo.tiny import tokenizer
    from vlm_grpo.tools import image_tools
    from vlm_grpo.tools.templates import prepare_tool_template

    assert doctest.testmod(tokenizer).failed == 0
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, tools=True))
    environment = image_tools("zoom")
    prepare_tool_template(processor, model, {"environment_factory": environment})
    question = [{"role": "user", "content": [{"type": "text", "text": "What shape is the small mark?"}]}]
    text = processor.apply_chat_template(question, tools=[environment().zoom], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids = processor.tokenizer(text)["input_ids"]
    assert len(ids) < 400 and processor.tokenizer.decode(ids) == text
    call = (
        '<tool_call>\n{"name": "zoom", "arguments": {"x1": 16, "y1": 0, "x2": 48, "y2": 32, "factor": 4}}\n</tool_call>'
    )
    assert len(processor.tokenizer(call)["input_ids"]) < 55  # 74 without the pieces


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_taught_call_is_one_token_as_the_template_writes_it(tmp_path, family):
    """`tool_calls`: each call, as the chat template writes it inside `<tool_call>` (Qwen's JSON, Qwen3.5's XML), is
    one token, so a sampled rollout writes it whole or not at all; other calls still tokenize and decode exactly."""
    from vlm_grpo.tools import image_tools

    taught = {"name": "zoom", "arguments": {"x1": 56, "y1": 56, "x2": 72, "y2": 72, "factor": 8}}
    other = {"name": "zoom", "arguments": {"x1": 8, "y1": 56, "x2": 24, "y2": 72, "factor": 8}}
    _, processor = FastVisionModel.from_pretrained(build_tiny_vlm(family, tmp_path, tools=True, tool_calls=[taught]))
    tok, tools = processor.tokenizer, [image_tools("zoom")().zoom]

    def completion(call: dict) -> str:
        question = [{"role": "user", "content": "Zoom in."}]
        turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        before = processor.apply_chat_template(question, tools=tools, add_generation_prompt=True, tokenize=False)
        after = processor.apply_chat_template(question + [turn], tools=tools, tokenize=False)
        return after[len(before) : after.rindex("</tool_call>") + len("</tool_call>")]

    text = completion(taught)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 5 and tok.decode(ids) == text, [tok.decode([i]) for i in ids]  # tags, newlines, the call
    ids = tok(completion(other), add_special_tokens=False)["input_ids"]
    assert len(ids) > 20 and tok.decode(ids) == completion(other)
    with pytest.raises(ValueError, match="build it with tools=True"):
        build_tiny_vlm(family, tmp_path / "plain", tool_calls=[taught])

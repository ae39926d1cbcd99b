"""Tool-calling rollouts with image observations (`vlm_grpo.tools`): the image tools, the tool templates, and real
`VLMGRPOTrainer` runs through TRL's tool loop with tiny Qwen models.

A random tiny model never writes a tool call by itself, so the runs force what it writes with a generation setting TRL
passes through unchanged: a `sequence_bias` (`generation_kwargs`) on every prefix of each scripted reply
(`_forced_replies`). Everything else (parsing the calls, running the tools, the tool images, masks, scoring and the
update) is TRL's and the trainer's own code.
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers.utils import get_json_schema

from vlm_grpo.cli.command import main
from vlm_grpo.data.rows import prepare_row, source_images
from vlm_grpo.media.pixel_budget import PixelBudget
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tools import MAX_PIXELS, ImageTools, crop_image, image_tools, rotate_image, zoom_image
from vlm_grpo.tools.rollouts import MALFORMED_METRIC
from vlm_grpo.tools.templates import QWEN2_5_VL_TOOL_TEMPLATE, prepare_tool_template
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

# TRL's notice that `environment_factory` is experimental, once per trainer.
pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")

RED, BLUE = (255, 0, 0), (0, 0, 255)
# Words of the scripts, one token each in the tiny tool tokenizer (shorter sequences, faster steps).
WORDS = ["crop", "zoom", "rotate", "blur", "factor", "degrees", "red", "blue", "add", "a", "b"]


def _half_red(side: int) -> Image.Image:
    """A `side` x `side` image, red on the left half, blue on the right."""
    image = Image.new("RGB", (side, side), BLUE)
    image.paste(Image.new("RGB", (side // 2, side), RED), (0, 0))
    return image


def _colours(image: Image.Image) -> set:
    return {colour for _, colour in image.getcolors()}


# ----- the tools themselves -----


def test_crop_zoom_rotate_act_in_the_image_pixels():
    image = _half_red(64)
    left = crop_image(image, 0, 0, 32, 64)
    assert left.size == (32, 64) and _colours(left) == {RED}
    zoomed = zoom_image(image, 32, 0, 64, 16, factor=3)
    assert zoomed.size == (96, 48) and _colours(zoomed) == {BLUE}
    turned = rotate_image(image, 90)  # counter-clockwise: the red left half goes to the bottom
    assert turned.getpixel((10, 60)) == RED and turned.getpixel((10, 3)) == BLUE
    assert rotate_image(image, 45).size == (92, 92)  # the canvas grown to hold the corners
    # Arguments as Qwen3.5's template writes them without a schema: text.
    assert crop_image(image, "0", "0", "16", "8").size == (16, 8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda im: crop_image(im, 10, 0, 10, 8), "is empty"),
        (lambda im: crop_image(im, 0, 0, 65, 8), r"reaches outside the 64x64 image: coordinates are pixels"),
        (lambda im: crop_image(im, -1, 0, 8, 8), "reaches outside"),
        (lambda im: crop_image(im, "left", 0, 8, 8), "x1 must be a number, got 'left'"),
        (lambda im: zoom_image(im, 0, 0, 8, 8, factor=0.5), "factor must be between 1 and 8"),
        (lambda im: zoom_image(im, 0, 0, 64, 64, factor=8, max_pixels=100_000),
         r"zoom would return a 512x512 image \(262144 pixels\), over the tools' limit of 100000 pixels"),
        (lambda im: rotate_image(im, 30, max_pixels=64 * 64), "rotate would return"),
    ],
)  # fmt: skip
def test_a_bad_call_raises_a_value_error_that_says_why(call, message):
    with pytest.raises(ValueError, match=message):
        call(_half_red(64))


def test_image_tools_schema_is_what_get_json_schema_reads():
    env = ImageTools()
    schemas = {s["function"]["name"]: s["function"] for s in map(get_json_schema, (env.crop, env.zoom, env.rotate))}
    assert list(schemas) == ["crop", "zoom", "rotate"]
    crop = schemas["crop"]["parameters"]
    assert crop["required"] == ["x1", "y1", "x2", "y2"]
    assert crop["properties"]["x2"] == {
        "type": "integer", "description": "right edge of the box (exclusive), in pixels from the image's left side.",
    }  # fmt: skip
    assert schemas["zoom"]["parameters"]["properties"]["factor"]["type"] == "number"
    assert "factor" not in schemas["zoom"]["parameters"]["required"]  # it has a default
    assert schemas["rotate"]["parameters"]["required"] == ["degrees"]


def test_reset_takes_the_rows_first_image_and_tools_answer_as_trl_reads_them():
    env = ImageTools()
    env.reset(prompt="p", images=[_half_red(64), Image.new("RGB", (8, 8))])
    image, text = env.crop(0, 0, 32, 32)
    assert image["type"] == "image" and _colours(image["image"]) == {RED}
    assert text == {"type": "text", "text": "Crop (0, 0, 32, 32) of the 64x64 image: 32x32 pixels."}
    env.reset(image=_half_red(56))  # plain TRL's single-image column
    assert env.zoom(28, 0, 56, 28)[0]["image"].size == (56, 56)
    with pytest.raises(ValueError, match="ImageTools needs an image in every row"):
        env.reset(prompt="text only", images=[])
    with pytest.raises(ValueError, match="needs an image"):
        env.reset(prompt="text only")


def test_image_tools_picks_tools_by_name():
    env_class = image_tools("crop, zoom", max_pixels=1000)
    env = env_class()
    assert hasattr(env, "crop") and hasattr(env, "zoom") and not hasattr(env, "rotate")
    env.reset(image=_half_red(64))
    with pytest.raises(ValueError, match="limit of 1000 pixels"):
        env.crop(0, 0, 64, 64)
    assert image_tools().max_pixels == MAX_PIXELS and hasattr(image_tools()(), "rotate")
    with pytest.raises(ValueError, match="Unknown image tool.*'blur'.*choose from crop, zoom, rotate"):
        image_tools(["crop", "blur"])


@pytest.mark.parametrize("module", ["limits", "crop", "zoom", "rotate", "environment", "rollouts"])
def test_the_docstring_examples_hold(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(f"vlm_grpo.tools.{module}")).failed == 0


# ----- templates: the tiny tool builds, and the one installed for Qwen2.5-VL -----


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_5_vl"])
def test_tiny_tool_builds_decode_text_exactly_and_ship_the_real_template(tiny_dir, family):
    from trl import chat_template_utils as ctu

    _, processor = FastVisionModel.from_pretrained(tiny_dir(family, tools=True, words=WORDS))
    text = '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y2": 32}}\n</tool_call> héllo'
    tokenizer = processor.tokenizer
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # Qwen3.5 reloads as Qwen3_5Tokenizer: same
    assert tokenizer.convert_tokens_to_ids("<tool_call>") != tokenizer.unk_token_id
    shipped = {"qwen3_vl": ctu.qwen3_vl_chat_template, "qwen3_5": ctu.qwen3_5_nothink_chat_template,
               "qwen2_5_vl": ctu.qwen2_5_vl_chat_template}[family]  # fmt: skip
    assert processor.chat_template == shipped
    assert ctu.supports_tool_calling(processor) is (family != "qwen2_5_vl")  # as on the Hub


def test_tiny_tool_build_refuses_a_family_without_tool_support(tmp_path):
    from vlm_grpo.tiny import build_tiny_vlm

    with pytest.raises(ValueError, match="tools=True builds qwen2_vl, qwen2_5_vl, qwen3_vl.*not 'gemma3'"):
        build_tiny_vlm("gemma3", tmp_path, tools=True)


def test_qwen2_5_vl_gets_a_tool_template_only_when_given_tools(tiny_dir, caplog):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", tools=True, words=WORDS))
    chats = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "red"}],
    ]  # fmt: skip
    before = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prepare_tool_template(processor, model, {})
    assert processor.chat_template != QWEN2_5_VL_TOOL_TEMPLATE
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.tools.templates"):
        prepare_tool_template(processor, model, {"environment_factory": ImageTools})
    assert "installed vlm_grpo's Qwen2.5-VL tool template" in caplog.text
    assert processor.chat_template == QWEN2_5_VL_TOOL_TEMPLATE
    assert [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats] == before
    assert supports_tool_calling(processor) and is_chat_template_prefix_preserving(processor)
    # Qwen2.5's format, read back by the parser installed with it.
    env = ImageTools()
    user = chats[0]
    call = {"role": "assistant", "content": "", "tool_calls": [_call("crop", {"x1": 0, "y1": 0, "x2": 28, "y2": 28})]}
    prompt = processor.apply_chat_template(user, tools=[env.crop], add_generation_prompt=True, tokenize=False)
    full = processor.apply_chat_template(user + [call], tools=[env.crop], tokenize=False)
    assert "<tools>\n" in prompt and '"name": "crop"' in prompt and full.startswith(prompt)
    reply, call_json = full[len(prompt) :], '{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 28, "y2": 28}}'
    assert reply == f"<tool_call>\n{call_json}\n</tool_call><|im_end|>\n"
    tok = processor.tokenizer
    # TRL 1.16 types the arguments by the tools' schemas; 1.15 (Unsloth's pin) takes no tools and reads the JSON as is.
    typed = {"tools": [env.crop]} if "tools" in inspect.signature(parse_response).parameters else {}
    parsed = parse_response(tok, tok(reply)["input_ids"], prefix=tok(prompt)["input_ids"], **typed)
    assert parsed["tool_calls"] == [call["tool_calls"][0]]


def test_a_family_whose_template_cannot_render_tools_is_refused_with_the_fix(tiny_dir):
    from vlm_grpo.media.processor import load_processor

    processor = load_processor(tiny_dir("idefics3"), "idefics3")
    with pytest.raises(ValueError, match="idefics3 processor's chat template cannot render tools.*Set `processor.chat"):
        prepare_tool_template(processor, "idefics3", {"tools": [print]})


def test_crop_and_zoom_cut_from_the_original_where_the_budget_shrank_it():
    """The trainer keeps a row's image as loaded (`prepare_row(keep_sources=True)`); the tools take boxes in the
    prompt's (fitted) image and cut the same region from the original: detail the prompt's image lost comes back."""
    original = Image.new("RGB", (448, 448), (128, 128, 128))
    for x in range(200, 216):  # 1-px red and blue stripes: grey mush at a quarter of the size
        original.paste(RED if x % 2 else BLUE, (x, 200, x + 1, 216))
    row = prepare_row({"prompt": "what?", "image": original}, PixelBudget(max_pixels=112 * 112), keep_sources=True)
    assert row["images"][0].size == (112, 112) and source_images(row)[0].size == (448, 448)
    env = ImageTools()
    env.reset(**row)
    image, text = env.zoom(48, 48, 56, 56, factor=4)  # frame pixels: (192, 192)-(224, 224) of the original
    assert image["image"].size == (32, 32)
    assert (
        text["text"]
        == "Zoom x4 of (48, 48, 56, 56) of the 112x112 image (cut from the 448x448 original): 32x32 pixels."
    )
    assert image["image"].getpixel((8 + 1, 16)) == RED and image["image"].getpixel((8 + 2, 16)) == BLUE  # stripes back
    crop, text = env.crop(48, 48, 56, 56)
    assert crop["image"].size == (32, 32) and "cut from the 448x448 original" in text["text"]  # original resolution
    assert crop["image"].tobytes() == original.crop((192, 192, 224, 224)).tobytes()
    # Without the original (plain TRL, or an image within the budget) the tools cut from the image they were given.
    plain = ImageTools()
    plain.reset(prompt="what?", images=row["images"])
    blurred, text = plain.zoom(48, 48, 56, 56, factor=4)
    assert "original" not in text["text"] and RED not in _colours(blurred["image"])


# ----- real runs through TRL's tool loop -----


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _generation_prompt(family: str) -> str:
    return "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if family == "qwen3_5" else "")


def _call_text(processor, family: str, name: str, arguments: dict) -> str:
    """The assistant turn calling `name`, as the family's chat template writes it."""
    template = QWEN2_5_VL_TOOL_TEMPLATE if family == "qwen2_5_vl" else None
    user = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    call = [{"role": "assistant", "content": "", "tool_calls": [_call(name, arguments)]}]
    prompt = processor.apply_chat_template(user, add_generation_prompt=True, tokenize=False, chat_template=template)
    full = processor.apply_chat_template(user + call, tokenize=False, chat_template=template)
    return full[len(prompt) :].rstrip("\n")


def _forced_replies(tokenizer, family: str, first: str, answer: bool = True) -> dict:
    """`generation_kwargs` making `generate` write `first` after the generation prompt and "red" after a tool
    response: a `sequence_bias` on each prefix of context + reply, doubling with its length so the longest match wins
    (the post-tool context ends with the first one's). Without `answer`, `first` only after the user's question
    (`_row`): after the tool the model writes what it will."""
    bias, prompt = [], _generation_prompt(family)
    if not answer:
        # "?<|im_end|>": the same tokens alone as after the question (a word's first token differs after a space).
        return {"sequence_bias": _bias(tokenizer, "?<|im_end|>\n" + prompt, first)}
    replies = [(prompt, first), ("</tool_response><|im_end|>\n" + prompt, "red<|im_end|>")]
    for context, reply in replies:
        bias += _bias(tokenizer, context, reply)
    return {"sequence_bias": bias}


def _bias(tokenizer, context: str, reply: str) -> list:
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    assert len(context_ids) + len(reply_ids) < 120  # 2 ** 128 overflows float32
    return [[context_ids + reply_ids[: i + 1], 2.0 ** (len(context_ids) + i + 1)] for i in range(len(reply_ids))]


class _Recorder:
    """A reward function that keeps what it is given: the rollouts' messages and their environments."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.completions: list = []
        self.environments: list = []

        self.completion_ids: list = []

    def __call__(self, prompts, completions, environments=None, **kwargs) -> list[float]:
        self.completions += completions
        self.completion_ids += kwargs.get("completion_ids") or []
        self.environments += environments or []
        return [float(i % 2) for i in range(len(completions))]  # unequal: a real update


def _side(family: str) -> int:
    return 56 if family == "qwen2_5_vl" else 64


def _config(config_class, tmp_path, generation_kwargs, **kwargs):
    """One step of 2 rollouts of one prompt, one tool call each at most, generation forced by `generation_kwargs`."""
    settings = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, max_completion_length=256,
        max_steps=1, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        max_tool_calling_iterations=1, generation_kwargs=generation_kwargs,
    )  # fmt: skip
    return config_class(**{**settings, **kwargs})


def _row(family: str) -> dict:
    return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}],
            "image": _half_red(_side(family))}  # fmt: skip


def _trainer(tiny_dir, tmp_path, family, first, env=ImageTools, **kwargs):
    """A trainer for one step whose rollouts write `first` (text, or a `(tool, arguments)` call in the family's
    format), then "red" after a tool response; `(trainer, recorder)`."""
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, tools=True, words=WORDS), full_finetuning=True)
    first = _call_text(processor, family, *first) if isinstance(first, tuple) else first
    args = _config(VLMGRPOConfig, tmp_path, _forced_replies(processor.tokenizer, family, first))
    recorder = _Recorder()
    tool_kwargs = {"environment_factory": env} if env is not None else {}
    trainer = VLMGRPOTrainer(model, recorder, args=args, train_dataset=Dataset.from_list([_row(family)] * 2),
                             processing_class=processor, **tool_kwargs, **kwargs)  # fmt: skip
    return trainer, recorder


def _run(tiny_dir, tmp_path, family, name, arguments, **kwargs):
    """One training step whose rollouts call `name(**arguments)` once, then answer; `(trainer, recorder, logs)`."""
    trainer, recorder = _trainer(tiny_dir, tmp_path, family, (name, arguments), **kwargs)
    trainer.train()
    return trainer, recorder, trainer.state.log_history[0]


@pytest.mark.trains
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_5_vl"])
def test_image_tool_rollout_trains_with_the_tool_image_in_the_conversation(tiny_dir, tmp_path, family, caplog):
    half = _side(family) // 2
    box = {"x1": 0, "y1": 0, "x2": half, "y2": half}
    with caplog.at_level(logging.WARNING):
        trainer, recorder, logs = _run(tiny_dir, tmp_path, family, "crop", box)
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0
    assert logs[MALFORMED_METRIC] == 0.0 and logs["grad_norm"] > 0
    call, tool, answer = recorder.completions[0]
    assert call["tool_calls"] == [_call("crop", box)]  # ints for Qwen3.5 too: typed by the tool's schema
    text = f"Crop (0, 0, {half}, {half}) of the {2 * half}x{2 * half} image: {half}x{half} pixels."
    assert tool["role"] == "tool" and tool["content"][1] == {"type": "text", "text": text}
    assert _colours(tool["content"][0]["image"]) == {RED}  # the left half: the row's own image, cropped
    assert answer["content"] == "red"
    assert all(type(e).__name__ == "ImageTools" for e in recorder.environments)
    # The fast generator served both turns (the tool turn with its image); shared-prefix scoring says why it cannot
    # serve tool images in completions.
    assert trainer.fast_generator.stats["calls"] == 2 and not trainer._fast_generation_fallbacks
    assert any("image tokens in completions" in reason for reason in trainer.shared_prefix_fallbacks)


@pytest.mark.trains
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_5_vl"])
def test_fast_generation_gives_the_plain_paths_tool_turns(tiny_dir, tmp_path, family):
    """Only the call is forced: after the zoomed image the model answers greedily on its own, so the tokens depend on
    the tool turn as each path built it (its text, its image through the vision tower, the positions after it)."""
    half = _side(family) // 2
    runs = {}
    for fast in (True, False):
        model, processor = FastVisionModel.from_pretrained(tiny_dir(family, tools=True, words=WORDS),
                                                           full_finetuning=True)  # fmt: skip
        first = _call_text(processor, family, "zoom", {"x1": 0, "y1": 0, "x2": half, "y2": half})
        kwargs = {**_forced_replies(processor.tokenizer, family, first, answer=False), "do_sample": False}
        args = _config(VLMGRPOConfig, tmp_path / str(fast), kwargs, fast_generation=fast, max_completion_length=160)
        recorder = _Recorder()
        trainer = VLMGRPOTrainer(model, recorder, args=args, train_dataset=Dataset.from_list([_row(family)] * 2),
                                 processing_class=processor, environment_factory=ImageTools)  # fmt: skip
        trainer.train()
        runs[fast] = (recorder, trainer.state.log_history[0], trainer.fast_generator.stats["calls"])
    (fast, fast_logs, fast_calls), (plain, plain_logs, plain_calls) = runs[True], runs[False]
    assert fast_calls == 2 and plain_calls == 0  # both turns on the fast path; none on the plain one
    assert fast.completion_ids == plain.completion_ids and fast.completions == plain.completions
    call, tool = fast.completions[0][:2]
    assert call["tool_calls"][0]["function"]["name"] == "zoom" and tool["content"][0]["type"] == "image"
    assert len(fast.completion_ids[0]) > len(processor.tokenizer(first)["input_ids"]) + 8  # it went on after the tool
    assert fast_logs["loss"] == pytest.approx(plain_logs["loss"], abs=1e-6)


@pytest.mark.trains
def test_tool_results_have_zero_loss_weight_and_scoring_sees_the_tool_image(tiny_dir, tmp_path):
    trainer, _ = _trainer(tiny_dir, tmp_path, "qwen3_vl", ("crop", {"x1": 0, "y1": 0, "x2": 32, "y2": 32}))
    processor = trainer.processing_class
    first = _call_text(processor, "qwen3_vl", "crop", {"x1": 0, "y1": 0, "x2": 32, "y2": 32})
    trainer.model.train()
    row = trainer.train_dataset[0]
    out = trainer._generate_and_score_completions([row, row])
    tok = processor.tokenizer
    ids, tool_mask = out["completion_ids"][0].tolist(), out["tool_mask"][0].tolist()
    masked = [i for i, m in enumerate(tool_mask) if m == 0]
    assert masked == list(range(masked[0], masked[-1] + 1))  # one span: the tool's turn
    assert tok.decode(ids[: masked[0]]) == first  # the call is trained ...
    tool_turn = tok.decode(ids[masked[0] : masked[-1] + 1])
    assert tool_turn.startswith("\n<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|>")
    assert tool_turn.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([i for i, m in zip(ids, tool_mask) if m][len(tok(first)["input_ids"]) :]) == "red<|im_end|>"

    # Zero weight in TRL's loss: the reference log-probs of tool tokens change nothing, a model token's do. (Scored in
    # eval mode: in train mode TRL's loss reads the accumulation state `train()` sets.)
    trainer.model.eval()

    def loss(shift_at: int | None) -> float:
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        if shift_at is not None:
            inputs["ref_per_token_logps"][:, shift_at] += 5.0
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, inputs).item()

    assert loss(masked[3]) == loss(None) != loss(2)

    # The scoring forward sees the tool image: another crop there changes the log-probs after it, and only those.
    prompt_completion = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    fields = {k: out[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
    assert out["num_images"] == [2, 2]  # the row's image and the crop
    other = processor.image_processor(images=[_half_red(64), Image.new("RGB", (32, 32), BLUE)] * 2, return_tensors="pt")
    width = out["completion_ids"].size(1)
    with torch.no_grad():
        same = trainer._get_per_token_logps_and_entropies(trainer.model, prompt_completion, mask, width, **fields)[0]
        swapped = trainer._get_per_token_logps_and_entropies(
            trainer.model, prompt_completion, mask, width, **{**fields, "pixel_values": other["pixel_values"]}
        )[0]
    # Log-prob j is read at token j - 1: up to the tool image's first token nothing has seen it.
    seen = ids.index(tok.convert_tokens_to_ids("<|image_pad|>")) + 1
    assert torch.equal(same[:, :seen], swapped[:, :seen])
    assert not torch.allclose(same[:, seen:], swapped[:, seen:])


@pytest.mark.trains
@pytest.mark.parametrize(
    "name, arguments, error",
    [
        ("crop", {"x1": 0, "y1": 0, "x2": 500, "y2": 32}, "The box (0, 0, 500, 32) reaches outside the 64x64 image"),
        ("blur", {"x1": 0}, "Tool blur not found."),
        ("zoom", {"x1": 0, "y1": 0, "x2": 64, "y2": 64, "factor": 8}, "over the tools' limit of 100000 pixels"),
        ("crop", {"x1": 0, "y1": 0}, "missing 2 required positional arguments: 'x2' and 'y2'"),
    ],
    ids=["tool-raises", "unknown-tool", "over-pixel-limit", "missing-arguments"],
)
def test_a_failed_call_goes_back_to_the_model_counted_and_the_run_finishes(tiny_dir, tmp_path, name, arguments, error):
    env = image_tools("crop,zoom", max_pixels=100_000)
    trainer, recorder, logs = _run(tiny_dir, tmp_path, "qwen3_vl", name, arguments, env=env)
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 1.0
    call, tool, answer = recorder.completions[0]
    assert call["tool_calls"][0]["function"]["name"] == name
    assert tool["role"] == "tool" and tool["name"] == name and tool["content"].startswith("{'error': ")
    assert error in tool["content"]
    assert answer["content"] == "red" and trainer.state.global_step == 1


@pytest.mark.trains
def test_a_malformed_call_is_text_to_trl_and_counted_here(tiny_dir, tmp_path):
    broken = '<tool_call>\n{"name": "crop", "arguments": {"x1": 0,,}}\n</tool_call><|im_end|>'
    trainer, recorder = _trainer(tiny_dir, tmp_path, "qwen3_vl", broken)
    trainer.train()
    logs = trainer.state.log_history[0]
    # TRL parses it as plain text: no call, no tool response, nothing counted by TRL.
    assert logs["tools/call_frequency"] == 0.0 and logs["tools/failure_frequency"] == 0.0
    assert recorder.completions[0] == [{"role": "assistant", "content": broken.removesuffix("<|im_end|>")}]
    assert logs[MALFORMED_METRIC] == 1.0


class _Calculator:
    """A text tool in an environment: the issue's crash (TRL's tool loop with image prompts)."""

    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number.
            b: the second number.
        """
        return a + b


@pytest.mark.trains
@pytest.mark.parametrize("as_environment", [True, False], ids=["environment", "tools"])
def test_text_tools_with_image_prompts_train(tiny_dir, tmp_path, as_environment):
    tools = {"env": _Calculator} if as_environment else {"env": None, "tools": [_Calculator().add]}
    trainer, recorder = _trainer(tiny_dir, tmp_path, "qwen3_vl", ("add", {"a": 2, "b": 3}), **tools)
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0
    assert recorder.completions[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert recorder.completions[0][2] == {"role": "assistant", "content": "red"}
    assert trainer.shared_prefix_calls > 0  # no image in the completions: each group's prompt computed once


@pytest.mark.trains
def test_plain_trl_still_crashes_on_text_tools_with_image_prompts(tiny_dir, tmp_path):
    """The upstream bug `tools.rollouts.fields_as_tensors` works around. When this fails, TRL has fixed it: the
    workaround (and this test) can go."""
    from trl import GRPOConfig, GRPOTrainer

    from vlm_grpo.compat import checkpointing_settings

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_vl", tools=True, words=WORDS))
    model.requires_grad_(True)
    first = _call_text(processor, "qwen3_vl", "add", {"a": 2, "b": 3})
    # Checkpointing set in this transformers' names: TRL's default sets the deprecated alias.
    args = _config(GRPOConfig, tmp_path, _forced_replies(processor.tokenizer, "qwen3_vl", first),
                   **checkpointing_settings(False))  # fmt: skip
    trainer = GRPOTrainer(model, _Recorder(), args=args, train_dataset=Dataset.from_list([_row("qwen3_vl")] * 2),
                          processing_class=processor, tools=[_Calculator().add])  # fmt: skip
    with pytest.raises(TypeError, match="'int' object is not callable"):
        trainer.train()


@pytest.mark.trains
def test_a_tool_turn_the_fast_path_cannot_serve_falls_back_without_a_sampler_log_prob(tiny_dir, tmp_path, caplog):
    """The first turn fast, the tool turn on TRL's path (the generator refusing it, as it refuses what it cannot
    serve): TRL's loop appends that turn's log-probs to the first turn's, NaN here; the gap leaves them out and
    importance sampling is skipped for such rollouts, said once."""
    import math

    from vlm_grpo.engine.fast_generation import FastPathUnavailable

    trainer, recorder = _trainer(tiny_dir, tmp_path, "qwen3_vl", ("crop", {"x1": 0, "y1": 0, "x2": 32, "y2": 32}),
                                 )  # fmt: skip
    trainer.args.fast_generation_importance_sampling = True
    generate = trainer.fast_generator.generate

    def first_turn_only(model, prompt_ids, *args, **kwargs):
        if trainer.fast_generator.stats["calls"] >= 1:
            raise FastPathUnavailable("a later turn this test's generator refuses")
        return generate(model, prompt_ids, *args, **kwargs)

    trainer.fast_generator.generate = first_turn_only
    with caplog.at_level(logging.WARNING):
        trainer.train()
    logs = trainer.state.log_history[0]
    assert recorder.completions[0][2] == {"role": "assistant", "content": "red"}  # TRL's path wrote the answer
    assert "a later turn this test's generator refuses" in caplog.text and "no importance sampling" in caplog.text
    assert math.isfinite(logs["loss"]) and math.isfinite(logs["sampling/sampling_logp_difference/mean"])


@pytest.mark.trains
def test_the_zoom_task_with_image_tools_runs_from_the_command_line(tmp_path, capsys):
    """`vlm-grpo --task zoom --tools zoom`: the tiny model built with a tool tokenizer, one ImageTools per rollout, the
    tool counts logged, accuracy measured in one turn without tools and multi-turn with them, both in eval.json. (A
    random tiny model writes no calls; the tool loop itself is exercised by the forced-call runs above.)"""
    out = tmp_path / "run"
    args = ["--task", "zoom", "--tools", "zoom", "--max_completion_length", "160", "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--num_generations", "2", "--train_size", "8", "--test_size", "2",
            "--logging_steps", "1", "--output_dir", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "(one turn, without tools)" in printed.out and "environment_factory" not in printed.err
    assert "held-out accuracy after training, with tools:" in printed.out  # multi-turn, as the rollouts run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "tools/call_frequency" in r)
    assert {"tools/failure_frequency", MALFORMED_METRIC} <= set(step)
    assert "<tool_call>" in (out / "final" / "chat_template.jinja").read_text()  # the tool template, saved
    results = json.loads((out / "eval.json").read_text())
    assert {"before/accuracy", "after/with_tools/accuracy", "after/with_tools/tools/call_frequency"} <= set(results)

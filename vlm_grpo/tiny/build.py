"""`build_tiny_vlm`: a tiny model of any family with a `tiny` record, written as a checkpoint directory.

Each family's module (`qwen`, `gemma3`, `idefics3`) gives its tokenizer's special tokens and chat template
(`TOKENIZER`), its default image size (`IMAGE_SIZES`) and `parts(name, tokenizer, vocab_size, image_size) -> (config,
processor)`; this module builds the tokenizer, the seeded random weights and the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from ..families import model_types
from . import gemma3, glm4v, idefics3, internvl, lfm2_vl, llava_onevision, mistral3, paligemma, qwen, smolvlm
from .tokenizer import build_text_tokenizer, build_tokenizer

__all__ = ["TINY_FAMILIES", "build_tiny_vlm", "tiny_image_processor", "tool_families"]

# Families whose tokenizer transformers rebuilds on load as a byte-level BPE (`Qwen3_5Tokenizer`).
_BYTE_LEVEL_ON_LOAD = frozenset({"qwen3_5", "qwen3_5_moe"})

# The module building each family's parts, for every family marked `tiny` in `vlm_grpo.families`.
_MODULES = (qwen, gemma3, idefics3, llava_onevision, paligemma, glm4v, internvl, smolvlm, mistral3, lfm2_vl)
_BUILDERS: dict[str, ModuleType] = {name: module for module in _MODULES for name in module.IMAGE_SIZES}
TINY_FAMILIES: tuple[str, ...] = model_types(lambda f: f.tiny)


def _round_up(n: int, multiple: int = 8) -> int:
    return (n + multiple - 1) // multiple * multiple


def _init_zero_projections(model: torch.nn.Module) -> None:
    # Gemma3's `_init_weights` zeroes the image projection (the real checkpoint overwrites it), so a random
    # tiny Gemma3 would ignore its images entirely and vision LoRA would get no gradient. Give such
    # all-zero projection matrices a random init scaled like a Linear layer.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "projector" in name and param.dim() == 2 and not param.any():
                param.normal_(0.0, param.shape[0] ** -0.5)


def tiny_image_processor(family: str) -> Any:
    """The image processor a tiny `family` model is built with (its pixel budget: the size of the prompt's image),
    without building the model; Qwen families (those that call tools)."""
    if family not in tool_families():
        raise ValueError(f"tiny_image_processor builds {', '.join(tool_families())}, not {family!r}.")
    return _BUILDERS[family].build_image_processor(family)


def tool_families() -> list[str]:
    """The tiny families `build_tiny_vlm(..., tools=True)` builds: those whose chat template writes tool calls."""
    return [name for name, builder in _BUILDERS.items() if hasattr(builder, "tool_tokenizer")]


def build_tiny_vlm(
    family: str,
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    words: Iterable[str] | None = None,
    image_size: int | None = None,
    tools: bool = False,
    tool_calls: Iterable[dict[str, Any]] = (),
) -> str:
    """Write a complete, offline tiny VLM checkpoint directory and return its path.

    Args:
        family: one of `TINY_FAMILIES` (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `gemma3`, `idefics3`).
        out_dir: where to write (created if needed; files already there are overwritten, others left alone). None:
            `~/.cache/vlm_grpo/tiny-models/<family>-<hash of the settings>` (under `$XDG_CACHE_HOME` if set).
        seed: seeds the random weights, so the same seed gives the same model.
        words: extra vocabulary (e.g. `vlm_grpo.data.answer_words(task)`) so each answer is a single token.
        image_size: the image side the model is built for. Qwen families accept any size (it sets the pixel
            budget's unit); Gemma3 and Idefics3 resize every image to this square. Must be a multiple of 4
            (of 28 for Qwen2/2.5-VL, of 32 for Qwen3-VL).
        tools: built for tool calling (Qwen families): the family's shipped chat template (Qwen3-VL's and Qwen3.5's
            render tools; Qwen2/2.5-VL's do not, as on the Hub), Qwen's tool tokens, and a tokenizer that decodes
            text back exactly (`tiny.tokenizer.build_text_tokenizer`), so TRL parses the tool calls it generates.
        tool_calls: with `tools`, calls the model will be taught to write (`{"name": ..., "arguments": {...}}`, e.g.
            `vlm_grpo.tools.warm_start.shared_call`): each, as the chat template writes it between
            `<tool_call>` and `</tool_call>`, becomes one token, so sampling writes it whole or not at all.

    Returns:
        The checkpoint directory: config, seeded weights (safetensors), generation config and processor
        (image processor, tokenizer, chat template), loadable with `FastBaseVisionModel.from_pretrained`.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"Unknown tiny VLM family {family!r}; choose one of {', '.join(TINY_FAMILIES)}.")
    builder = _BUILDERS[family]
    image_size = image_size or builder.IMAGE_SIZES[family]
    if image_size <= 0 or image_size % 4:
        raise ValueError(f"image_size must be a positive multiple of 4, got {image_size}.")
    spec = builder.TOKENIZER
    extra = [w for w in (words or []) if w and w.strip()]
    if any(len(w.split()) != 1 for w in extra):
        raise ValueError("`words` must be single words without spaces (each becomes one token).")
    if tools:
        if family not in tool_families():
            raise ValueError(f"tools=True builds {', '.join(tool_families())}, not {family!r}.")
        spec = builder.tool_tokenizer(family)
    # transformers loads every Qwen3.5 tokenizer as its own byte-level BPE class, whatever the folder says: a
    # word-level one would come back garbled ("red blue" -> no ids). Those families get the byte-level build.
    text = tools or family in _BYTE_LEVEL_ON_LOAD
    calls = [dict(call) for call in tool_calls]
    if calls and not tools:
        raise ValueError("tool_calls are calls a tool-calling model writes: build it with tools=True.")
    pieces, phrases = _tool_pieces(family, spec.chat_template, calls) if tools else ([], [])
    tok = build_text_tokenizer(spec, extra, pieces, phrases) if text else build_tokenizer(spec, extra)

    from transformers import AutoModelForImageTextToText, GenerationConfig

    config, processor = builder.parts(family, tok, _round_up(len(tok)), image_size)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _init_zero_projections(model)
    eos_ids = [tok.convert_tokens_to_ids(t) for t in spec.eos]
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, do_sample=True
    )
    from ..files import follow_umask
    from ..third_party_logs import library_bars_off

    out_dir = str(out_dir) if out_dir is not None else _cache_dir(family, seed, extra, image_size, tools, calls)
    os.makedirs(out_dir, exist_ok=True)
    with library_bars_off():  # a "Writing model shards" bar for a file written in no time
        model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # safetensors writes weights 0600; the rest follows the umask already
        if name.endswith(".safetensors"):
            follow_umask(os.path.join(out_dir, name))
    return out_dir


def _tool_pieces(family: str, template: str, calls: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The pieces of a tool conversation as `family`'s template renders it (with the template the trainer installs
    where the shipped one renders no tools): the tool boilerplate, `vlm_grpo.tools.ImageTools`' schemas and a call.
    Each becomes one token, so a tool prompt is a few hundred tokens rather than a thousand bytes. Also the phrases:
    each of `calls` as the template writes it inside `<tool_call>` tags, whole."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from ..tools import ImageTools
    from ..tools.templates import QWEN2_5_VL_TOOL_TEMPLATE
    from .tokenizer import text_pieces

    if family in ("qwen2_vl", "qwen2_5_vl"):
        template = QWEN2_5_VL_TOOL_TEMPLATE
    environment = ImageTools()
    sample = {"name": "zoom", "arguments": {"x1": 0, "y1": 0, "x2": 8, "y2": 8, "factor": 4}}

    def conversation(call: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {
                "role": "tool",
                "name": call["name"],
                "content": [{"type": "image"}, {"type": "text", "text": "Zoom x4."}],
            },
            {"role": "assistant", "content": "it"},
        ]

    tools = [environment.crop, environment.zoom, environment.rotate]
    rendered = render_jinja_template([conversation(sample)], tools=tools, chat_template=template)[0][0]
    phrases = []
    for call in calls:
        text = render_jinja_template([conversation(call)], tools=tools, chat_template=template)[0][0]
        # The conversation's last tags: the system prompt's instructions name them too.
        start, end = text.rindex("<tool_call>") + len("<tool_call>"), text.rindex("</tool_call>")
        phrases.append(text[start:end].strip("\n"))  # the newlines around it are tokens of the template's own
    return text_pieces(rendered), list(dict.fromkeys(phrases))


def _cache_dir(family: str, seed: int, words: list[str], image_size: int, tools: bool, calls: list[dict]) -> str:
    """Where `build_tiny_vlm` writes when given no directory: one folder per model under the user's cache
    (`$XDG_CACHE_HOME` or ~/.cache), `vlm_grpo/tiny-models/<family>-<hash of the settings>`, rewritten by each build."""
    # Tool builds hash differently; plain builds (and tool builds without calls) keep the folder names they had.
    key = json.dumps([family, seed, words, image_size, *(["tools"] if tools else []), *([calls] if calls else [])])
    key = key.encode()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vlm_grpo", "tiny-models", f"{family}-{hashlib.sha256(key).hexdigest()[:12]}")

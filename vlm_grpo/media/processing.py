"""Chat prompts holding images and clips -> the processor's token ids and vision tensors, in one call.

TRL's GRPO has no video path: it collects only the images of a prompt and processes them without the clips, and
transformers' `apply_chat_template` would let a Qwen-VL video processor sample the frames again (Qwen3-VL's default)
without knowing the rate they were taken at. Rows with clips are therefore processed here, by the trainer's rollouts
and `vlm_grpo.evaluate` alike: the template rendered as text, then one processor call with the images, the clips'
frames as the video budget kept them (`do_sample_frames=False`) and each clip's `video_metadata` (the source's rate
and the kept frames' indices), which Qwen2.5-VL turns into `second_per_grid_ts` and Qwen3-VL into frame timestamps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..families import find_family, model_types
from .batch_layout import PER_IMAGE_KEYS, VIDEO_KEYS, LayoutUnknown, distinct_prompts, select_rows
from .clips import Clip
from .forward_inputs import drop_outputs, prompt_fields

__all__ = [
    "ROW_VISION_KEYS",
    "VISION_ROWS",
    "check_video_support",
    "holds_clips",
    "merge_fields",
    "process_prompts",
    "prompt_media",
    "refuse_clip_settings",
    "row_vision_inputs",
    "tokenize_clip_prompts",
    "tokenize_distinct",
]

#: The processor outputs kept per row of a batch with clips (what the model needs besides the token ids).
ROW_VISION_KEYS = ("pixel_values", "image_grid_thw", *VIDEO_KEYS)
#: The key under which a trainer's batch with clips carries each row's vision inputs (a list, one dict per row, so
#: TRL's shuffle and split of a generation batch keep them with their rows).
VISION_ROWS = "vlm_grpo_vision_rows"


def prompt_media(prompt: Any) -> tuple[list[Any], list[Clip]]:
    """`(images, clips)` placed in a chat prompt's content blocks, in order (empty for a string prompt)."""
    images: list[Any] = []
    clips: list[Clip] = []
    if not isinstance(prompt, list):
        return images, clips
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and "image" in part:
                images.append(part["image"])
            elif kind == "video":
                if not isinstance(part.get("video"), Clip):
                    raise ValueError(
                        "a video block without its clip reached the processor; rows with clips must go through "
                        "vlm_grpo.data.rows.prepare_row (the trainer and evaluate do this)"
                    )
                clips.append(part["video"])
    return images, clips


def holds_clips(prompts: Sequence[Any]) -> bool:
    """Whether any of the chat prompts has a video block (so TRL's image-only processing cannot serve the batch)."""
    return any(
        isinstance(part, dict) and part.get("type") == "video"
        for prompt in prompts
        if isinstance(prompt, list)
        for message in prompt
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def process_prompts(
    processor: Any,
    prompts: Sequence[list[dict[str, Any]]],
    *,
    chat_template: str | None = None,
    tools: Any = None,
    template_kwargs: dict[str, Any] | None = None,
    **processor_kwargs: Any,
) -> Any:
    """The processor's outputs for chat prompts with their images and clips placed in their content blocks
    (`vlm_grpo.data.rows.prepare_row` places them): the generation prompt rendered with the chat template (`chat_template`,
    `tools` and `template_kwargs` as TRL passes them), then one processor call. `processor_kwargs` go to that call
    (`padding`, `return_tensors`). Also returns `num_images` and `num_videos`: each row's image and clip counts.
    """
    text = processor.apply_chat_template(
        list(prompts), tools=tools or None, chat_template=chat_template, add_generation_prompt=True, tokenize=False,
        **(template_kwargs or {}),
    )  # fmt: skip
    media = [prompt_media(prompt) for prompt in prompts]
    images = [row_images for row_images, _ in media]
    clips = [clip for _, row_clips in media for clip in row_clips]
    videos = {}
    if clips:
        check_video_support(processor)
        videos = {"videos": [list(c.frames) for c in clips], "video_metadata": [c.metadata() for c in clips],
                  "do_sample_frames": False}  # fmt: skip
    out = processor(text=text, images=images if any(images) else None, **videos, **processor_kwargs)
    out["num_images"] = [len(row) for row in images]
    out["num_videos"] = [len(row_clips) for _, row_clips in media]
    return out


def check_video_support(processor: Any, model: Any = None) -> None:
    """Raise ValueError, naming the families that take clips, when `model`'s family or `processor` takes none."""
    family = find_family(model) if model is not None else None
    video = getattr(processor, "video_processor", None)
    # Clips are served where the video budget has a rule (Qwen-VL).
    if (family is not None and not family.trains_on_clips) or video is None:
        which = f"{family.model_type} models" if family is not None else type(processor).__name__
        raise ValueError(
            f"The rows have clips (a `video` / `videos` column or `<video>` placeholders), but {which} take no video "
            f"here. Use a family that does ({', '.join(model_types(lambda f: f.trains_on_clips))}), or drop "
            "the clips."
        )


def refuse_clip_settings(args: Any, kwargs: dict[str, Any]) -> None:
    """Refuse trainer settings whose code paths would drop a batch's clips (TRL's own paths know only images);
    `kwargs` are the trainer's keyword arguments for TRL."""
    blockers = {
        "use_vllm=True: vLLM generation": getattr(args, "use_vllm", False),
        "use_liger_kernel=True: Liger's GRPO loss": getattr(args, "use_liger_kernel", False),
        "tool-calling rollouts (tools / environment_factory)": kwargs.get("tools") or kwargs.get("environment_factory"),
        "a custom rollout_func": kwargs.get("rollout_func"),
    }
    found = [name for name, on in blockers.items() if on]
    if found:
        raise ValueError(
            f"The rows have clips, but {found[0]} takes images only and would train without them. Turn it off for "
            "video training (the in-process fast generation and shared-prefix paths serve clips)."
        )


def tokenize_distinct(
    tokenize: Any, prompts: Sequence[Any], family: Any = None
) -> tuple[list[list[int]], Any, dict[str, Any]]:
    """TRL's `_tokenize_prompts` (`tokenize`) run once per distinct prompt of `prompts` and its outputs repeated for
    each row: the same ids and tensors as running it on every row, which TRL does (every prompt repeated
    `num_generations` times), with the tokenizer and the image processor on the CPU.

    `family` (the model's record, None for an unrecorded model) says what its processor cannot do: a family whose
    processor cannot take prompts of different lengths in one call (`Family.batched_prompts`) has them processed one by
    one, and the outputs are made what the rest of the package takes (`forward_inputs.prompt_fields`). A vision layout the row slicing does not
    know (e.g. InternVL's tiles) has every row processed, as TRL does.
    """
    distinct = distinct_prompts(prompts)
    if distinct is None or len(distinct[0]) == len(prompts):
        return _tokenize(tokenize, list(prompts), family)
    unique, inverse = distinct
    prompt_ids, images, fields = _tokenize(tokenize, [prompts[row] for row in unique], family)
    images_per_row = [len(row or []) for row in images] if images is not None else [0] * len(unique)
    try:
        fields = select_rows(fields, images_per_row, inverse)
    except LayoutUnknown:  # a layout this module cannot repeat per row: every row processed, as TRL does
        return _tokenize(tokenize, list(prompts), family)
    images = [images[i] for i in inverse] if images is not None else None
    return [prompt_ids[i] for i in inverse], images, fields


def _tokenize(tokenize: Any, prompts: list[Any], family: Any) -> tuple[list[list[int]], Any, dict[str, Any]]:
    """`tokenize(prompts)`, one prompt at a time where the family's processor cannot batch them, its outputs that no
    forward takes dropped."""
    if family is None or family.batched_prompts or len(prompts) < 2:
        prompt_ids, images, fields = tokenize(prompts)
        return _id_lists(prompt_ids), images, prompt_fields(fields, family, images)
    results = [tokenize([prompt]) for prompt in prompts]
    prompt_ids = _id_lists([ids for result in results for ids in result[0]])
    per_row = [result[1][0] if result[1] is not None else None for result in results]
    images = per_row if any(row is not None for row in per_row) else None
    fields = merge_fields([drop_outputs(result[2], family) for result in results])
    return prompt_ids, images, prompt_fields(fields, family, images)


def _id_lists(prompt_ids: Any) -> list[list[int]]:
    """Token ids as lists (Pixtral's processor returns a tensor even unasked)."""
    return [ids.tolist() if isinstance(ids, torch.Tensor) else ids for ids in prompt_ids]


def merge_fields(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The processor outputs of several calls as one call's: per-token lists joined row by row, tensors concatenated
    along dim 0, their other dims zero-padded at the end to the largest (as a batched call pads Pixtral's images and
    LLaVA-OneVision's views). Tensors with one entry per row must then come from every call."""
    keys = list(dict.fromkeys(key for part in parts for key in part))
    merged: dict[str, Any] = {}
    for key in keys:
        values = [part[key] for part in parts if key in part]
        if not isinstance(values[0], torch.Tensor):
            merged[key] = [row for value in values for row in value]
            continue
        if len(values) != len(parts) and key not in PER_IMAGE_KEYS:
            raise LayoutUnknown(f"{key!r} came from {len(values)} of {len(parts)} processor calls")
        shape = [max(v.shape[d] for v in values) for d in range(values[0].dim())]
        padded = []
        for value in values:
            pad = [p for d in reversed(range(1, value.dim())) for p in (0, shape[d] - value.shape[d])]
            padded.append(torch.nn.functional.pad(value, pad) if any(pad) else value)
        merged[key] = torch.cat(padded)
    return merged


def tokenize_clip_prompts(
    processor: Any, prompts: Sequence[list[dict[str, Any]]], **template: Any
) -> tuple[list[list[int]], list[list[Any]], dict[str, Any], list[dict[str, Any]]]:
    """TRL's `_tokenize_prompts` for a batch with clips, each distinct prompt processed once (`process_prompts`,
    `template`: its chat-template arguments).

    Returns `(prompt_ids, media, fields, vision_rows)`: each row's token ids; its images and clips (in TRL's images
    slot, which TRL reads only for vLLM and tools, both refused with clips); the batch's multimodal fields, repeated
    per row as TRL's are; and each row's own vision inputs (`ROW_VISION_KEYS` tensors, `num_images`, `num_videos`)
    for the forward passes (`row_vision_inputs`).
    """
    unique, inverse = distinct_prompts(prompts) or (list(range(len(prompts))), list(range(len(prompts))))
    processed = process_prompts(processor, [prompts[row] for row in unique], **template)
    ids = processed.pop("input_ids")
    processed.pop("attention_mask", None)
    num_images, num_videos = processed.pop("num_images"), processed.pop("num_videos")
    fields = select_rows(processed, num_images, inverse, num_videos)
    distinct_rows = []
    for position in range(len(unique)):
        row = select_rows(processed, num_images, [position], num_videos)
        row = {k: v for k, v in row.items() if k in ROW_VISION_KEYS}
        distinct_rows.append({**row, "num_images": num_images[position], "num_videos": num_videos[position]})
    vision_rows = [distinct_rows[position] for position in inverse]
    media = [prompt_media(prompt) for prompt in prompts]
    return [ids[position] for position in inverse], [images + clips for images, clips in media], fields, vision_rows


def row_vision_inputs(
    rows: Sequence[dict[str, Any]], input_ids: torch.Tensor, logits_to_keep: int, processor: Any
) -> dict[str, Any]:
    """The model's vision inputs for `rows` of a batch with clips (`tokenize_clip_prompts`' `vision_rows`): their
    tensors concatenated, image / clip counts, and `mm_token_type_ids` (1 image, 2 video tokens) over the prompt
    columns of `input_ids`, 0 over the completion's, as TRL extends the processor's."""
    device = input_ids.device
    out: dict[str, Any] = {"num_images": [r["num_images"] for r in rows], "num_videos": [r["num_videos"] for r in rows]}
    for key in ROW_VISION_KEYS:
        parts = [r[key] for r in rows if key in r]
        if parts:
            out[key] = torch.cat(parts).to(device)
    types = torch.zeros_like(input_ids)
    prompt = input_ids[:, : input_ids.size(1) - logits_to_keep]
    types[:, : prompt.size(1)] = torch.where(prompt == processor.image_token_id, 1, 0) + torch.where(
        prompt == processor.video_token_id, 2, 0
    )
    out["mm_token_type_ids"] = types
    return out

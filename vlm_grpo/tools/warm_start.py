"""A warm start for tool calling: a short supervised pass on synthetic traces, so GRPO starts from a model that calls.

A model that never writes a tool call gives GRPO nothing to compare: every rollout of a group answers without the tool,
and the group's rewards say nothing about calling it. `tool_warm_start` teaches the call format first, on traces of the
rows' own task: the row's question and image, a `zoom` call on a box around the mark (the row's `bbox`, in the pixels
of the image the prompt shows), the tool's real answer (its image and text, from the same environment the trainer
runs), and the row's answer. Without tools (`environment_factory=None`) the traces answer at once: the control.

Each trace is tokenized as a rollout of `VLMGRPOTrainer` would be: the prompt rendered with the environment's tools and
the generation prompt, the call up to its end-of-turn token, the tool's turn, the answer; the loss is on the model's
own tokens only (TRL's `tool_mask`). TRL's `SFTTrainer` is not used: its vision collator either trains on every token
(tool responses and system prompt too: its assistant-only mask needs `{% generation %}` markers that Qwen's templates
lack) or processes the completion without its images (the tool's image in the middle of it).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.rows import prepare_row, source_image_sizes
from ..media.pixel_budget import pixel_budget_for_call
from ..private_api import tool_suffix_ids
from .templates import prepare_tool_template

__all__ = [
    "ZOOM",
    "WarmStart",
    "demonstration_box",
    "demonstration_call",
    "fold_adapters",
    "shared_call",
    "tool_trace",
    "tool_warm_start",
]

# The zoom a trace asks for: a box a quarter of the image's side, enlarged 4 times, comes back at the prompt image's
# size (the largest the processor's budget lets through unshrunk) showing that quarter at 4 times the detail.
ZOOM = 4
# Traces kept in memory for the next epoch (decoding a large image, fitting it and rendering the conversation cost
# about as much as the step that trains on it); past this, a trace is made again each time its row comes round.
_KEEP_BYTES = 1 << 30


def demonstration_box(bbox: Sequence[float], source_size: tuple[int, int], frame_size: tuple[int, int],
                      zoom: int = ZOOM) -> tuple[int, int, int, int]:  # fmt: skip
    """The box a trace zooms on, in pixels of the image the prompt shows (`frame_size`): `1 / zoom` of its side, on a
    grid of half that stride, the one whose centre is nearest the centre of `bbox` (the mark, in pixels of the image
    as the dataset holds it, `source_size`). A grid, not a box fitted to the mark: a few coordinates to write rather
    than any pixel. The mark's centre is within a quarter of the box's side of the box's centre (at an image edge,
    the box stops at the edge), so a mark up to half the box's side is inside it whole.

    >>> demonstration_box((200, 300, 210, 310), (448, 448), (128, 128))
    (48, 64, 80, 96)
    """
    box = []
    for axis in (0, 1):
        scale = frame_size[axis] / source_size[axis]
        centre = (bbox[axis] + bbox[axis + 2]) / 2 * scale
        side = frame_size[axis] // zoom
        step = max(1, side // 2)
        start = round((centre - side / 2) / step) * step
        box.append(min(max(0, start), frame_size[axis] - side))
    side_x, side_y = frame_size[0] // zoom, frame_size[1] // zoom
    return box[0], box[1], box[0] + side_x, box[1] + side_y


def demonstration_call(bbox: Sequence[float], source_size: tuple[int, int], frame_size: tuple[int, int],
                       zoom: int = ZOOM) -> dict[str, Any]:  # fmt: skip
    """The `zoom` call a trace writes, `{"name": "zoom", "arguments": {"x1": ..., "y1": ..., "x2": ..., "y2": ...,
    "factor": zoom}}`: `zoom` times on `demonstration_box(bbox, source_size, frame_size, zoom)`.

    >>> demonstration_call((509, 509, 515, 515), (1024, 1024), (128, 128), zoom=8)["arguments"]
    {'x1': 56, 'y1': 56, 'x2': 72, 'y2': 72, 'factor': 8}
    """
    box = demonstration_box(bbox, source_size, frame_size, zoom)
    return {"name": "zoom", "arguments": dict(zip(("x1", "y1", "x2", "y2"), box, strict=True)) | {"factor": zoom}}


def shared_call(bboxes: Sequence[Sequence[float]], source_size: tuple[int, int], frame_size: tuple[int, int],
                zoom: int = ZOOM) -> dict[str, Any] | None:  # fmt: skip
    """The call (`demonstration_call`) that more than half of the traces of marks at `bboxes` write, or None: a mark
    in a known place (`zoom_color`: every trace writes the same call), for a tiny model's tokenizer to make it one
    token (`build_tiny_vlm(tool_calls=...)`). Marks anywhere (`zoom`) share none."""
    counts = Counter(json.dumps(demonstration_call(b, source_size, frame_size, zoom)) for b in bboxes)
    text, count = counts.most_common(1)[0] if counts else ("", 0)
    return json.loads(text) if count * 2 > len(bboxes) else None


def environment_tools(environment: Any) -> list[Any]:
    """The tools TRL shows the model for `environment`: its public methods but `reset` and `get_reward`, in TRL's
    order (`inspect.getmembers` on the class)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name,
            "arguments": arguments}}]}  # fmt: skip


def tool_trace(row: dict[str, Any], processor: Any, environment_factory: Any = None, *, budget: Any = None,
               zoom: int = ZOOM, chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One row's trace, tokenized as `VLMGRPOTrainer`'s rollout of it is: `input_ids`, `labels` (-100 but on the
    model's own tokens: the call and the answer, each up to its end-of-turn token) and the image fields.

    As TRL's tool loop builds a rollout: the prompt rendered with the environment's tools and the generation prompt,
    then the model's turn (the call as the chat template writes it, to its end-of-turn token), then TRL's own tokens
    for the tool's turn and the next generation prompt (`private_api.tool_suffix_ids`), then the answer.

    Args:
        row: a dataset row: `prompt`, `image` (or `images`), `answer`, and with an environment `bbox` (the mark's box in
            the image's pixels, as `make_visual_reasoning_dataset("zoom", ...)` gives it).
        processor: the model's processor; its chat template renders tools (`prepare_tool_template`).
        environment_factory: the trainer's environment class (`image_tools("zoom")`): the trace calls its `zoom` and
            shows what it returns. None: the trace answers at once.
        budget: the trainer's `PixelBudget` (`pixel_budget_for_call`), which fits the prompt's image.
        zoom: the box is `1 / zoom` of the image's side, enlarged `zoom` times (`demonstration_box`).
        chat_template_kwargs: the trainer's (`VLMGRPOConfig.chat_template_kwargs`, e.g. `enable_thinking`), so the
            trace's prompt is rendered as the rollouts' are.
    """
    from trl.data_utils import prepare_multimodal_messages

    tokenizer = getattr(processor, "tokenizer", processor)
    prepared = prepare_row(row, budget, keep_sources=True)
    if "images" not in prepared:  # clips are placed in the prompt instead
        raise ValueError("The warm start makes traces of image rows; this row holds a clip (or no image column).")
    images = prepared["images"]
    prompt = prepare_multimodal_messages(prepared["prompt"], images=images)
    tools, turns = None, []
    if environment_factory is not None:
        if row.get("bbox") is None:
            raise ValueError("A tool trace needs the mark's box in a `bbox` column (x1, y1, x2, y2 in the image's "
                             "pixels), as make_visual_reasoning_dataset('zoom', ...) gives it.")  # fmt: skip
        environment = environment_factory()
        if not hasattr(environment, "zoom"):
            raise ValueError("A tool warm start calls `zoom`: give an environment with it, e.g. image_tools('zoom').")
        environment.reset(**prepared)
        tools = environment_tools(environment)
        frame = images[0].size
        arguments = demonstration_call(row["bbox"], (source_image_sizes(prepared) or [frame])[0], frame, zoom)
        arguments = arguments["arguments"]
        turns = [_call("zoom", arguments), {"role": "tool", "name": "zoom", "content": environment.zoom(**arguments)}]

    def render(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return processor.apply_chat_template(messages, tools=tools, **(chat_template_kwargs or {}), **kwargs)

    prompt_inputs = render(prompt, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    pieces, trained = [prompt_inputs["input_ids"][0].tolist()], [False]
    end = tokenizer.eos_token
    if turns:  # the call as the template writes it after the generation prompt, to its end-of-turn token
        before = render(prompt, add_generation_prompt=True, tokenize=False)
        after = render(prompt + turns[:1], tokenize=False)
        if not after.startswith(before) or end not in after[len(before) :]:
            raise ValueError("The chat template does not write an assistant turn after its generation prompt ending "
                             f"with {end}, as TRL's tool loop reads a rollout; a trace cannot be made for it.")  # fmt: skip
        call = after[len(before) :]
        pieces += [tokenizer(call[: call.index(end) + len(end)], add_special_tokens=False)["input_ids"],
                   tool_suffix_ids(processor, turns[1:], chat_template_kwargs)]  # fmt: skip
        trained += [True, False]
    answer = row["answer"][0] if isinstance(row["answer"], (list, tuple)) else row["answer"]
    pieces.append(tokenizer(f"{answer}{end}", add_special_tokens=False)["input_ids"])
    trained.append(True)
    ids = torch.tensor([t for piece in pieces for t in piece])
    labels = torch.cat(
        [torch.tensor(p) if t else torch.full((len(p),), -100) for p, t in zip(pieces, trained, strict=True)]
    )
    trace = {"input_ids": ids, "labels": labels}
    tool_images = [block["image"] for block in turns[1]["content"] if block.get("type") == "image"] if turns else []
    if images:
        vision = processor.image_processor(images=images + tool_images, return_tensors="pt")
        trace.update({k: v for k, v in vision.items() if k in prompt_inputs})
    if "mm_token_type_ids" in prompt_inputs:  # every image's tokens marked, as TRL marks a rollout's for its forward
        trace["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids(processor.image_token)).long()
    return trace


def _collate(traces: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Traces padded on the right into one batch; image fields concatenated in order, per-token fields padded."""
    width = max(len(t["input_ids"]) for t in traces)
    batch: dict[str, Any] = {}

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(t[key].reshape(-1), (0, width - t[key].numel()), value=value)
                            for t in traces])  # fmt: skip

    batch["input_ids"] = padded("input_ids", pad_id)
    batch["labels"] = padded("labels", -100)
    batch["attention_mask"] = torch.stack([torch.arange(width) < len(t["input_ids"]) for t in traces]).long()
    for key in traces[0]:
        if key in batch:
            continue
        if key in ("mm_token_type_ids", "token_type_ids"):
            batch[key] = padded(key, 0)
        else:
            batch[key] = torch.cat([t[key] for t in traces])
    return batch


@dataclass
class WarmStart:
    """What `tool_warm_start` did: its steps, traces and the loss on the model's tokens at the start and the end."""

    steps: int
    traces: int
    first_loss: float
    last_loss: float


def tool_warm_start(
    model: Any,
    processor: Any,
    dataset: Any,
    steps: int,
    environment_factory: Any = None,
    *,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    zoom: int = ZOOM,
    seed: int = 0,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> WarmStart:
    """Train `model` for `steps` supervised steps on traces of `dataset`'s rows (`tool_trace`), so that GRPO with
    tools starts from a model that writes calls in its chat template's format and reads the tool's answer.

    Args:
        model, processor: the model (full or with LoRA: the trainable parameters are trained) and its processor, as
            given to `VLMGRPOTrainer` next. A Qwen2-VL / Qwen2.5-VL processor gets the tool template the trainer
            would install (`prepare_tool_template`).
        dataset: rows with `prompt`, `image`, `answer` and `bbox` (the `zoom` task: `synthetic_task("zoom")`).
        steps: optimizer steps (0: nothing is trained).
        environment_factory: the environment the trainer will get (`image_tools("zoom")`); None trains answers without
            a call (the control for a run without tools).
        batch_size, learning_rate: AdamW on the model's trainable parameters, a constant rate.
        min_pixels, max_pixels: the trainer's pixel budget (`VLMGRPOConfig`'s), so the prompt's image is the one its
            rollouts show.
        zoom: the traces zoom `zoom` times on a box `1 / zoom` of the image's side (`demonstration_box`).
        seed: which rows, in which order.
        chat_template_kwargs: the trainer's template arguments (`VLMGRPOConfig.chat_template_kwargs`), so the traces'
            prompts are the ones its rollouts see.

    Returns:
        A `WarmStart`: steps, traces seen, and the mean loss of the first and last steps.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"tool_warm_start needs steps >= 0 and batch_size >= 1, got {steps} and {batch_size}.")
    if steps == 0:
        return WarmStart(0, 0, math.nan, math.nan)
    if len(dataset) == 0:
        raise ValueError("tool_warm_start needs rows to make traces of; the dataset is empty.")
    if environment_factory is not None:
        prepare_tool_template(processor, model, {"environment_factory": environment_factory})
    tokenizer = getattr(processor, "tokenizer", processor)
    device = next(model.parameters()).device
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    order = random.Random(seed)
    indices: list[int] = []
    losses: list[float] = []
    traces: dict[int, dict[str, Any]] = {}  # each row's trace, the same every epoch: made once, up to _KEEP_BYTES
    kept = 0
    was_training = model.training
    model.train()
    try:
        with pixel_budget_for_call(processor, min_pixels, max_pixels) as budget:
            for _ in range(steps):
                batch = []
                for _ in range(batch_size):
                    if not indices:
                        indices = list(range(len(dataset)))
                        order.shuffle(indices)
                    index = indices.pop()
                    trace = traces.get(index)
                    if trace is None:
                        trace = tool_trace(dict(dataset[index]), processor, environment_factory, budget=budget,
                                           zoom=zoom, chat_template_kwargs=chat_template_kwargs)  # fmt: skip
                        size = sum(v.numel() * v.element_size() for v in trace.values())
                        if kept + size <= _KEEP_BYTES:
                            traces[index], kept = trace, kept + size
                    batch.append(trace)
                batch = {k: v.to(device) for k, v in _collate(batch, tokenizer.pad_token_id).items()}
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
    finally:
        model.train(was_training)
    return WarmStart(steps, steps * batch_size, losses[0], losses[-1])


def fold_adapters(model: Any) -> int:
    """After a warm start of a LoRA model: each adapter's update added to its base weight and the adapter started
    afresh (B = 0), so the model computes what it did and its adapter-off form, GRPO's KL reference, is now the
    warm-started model rather than the one before it. Returns the layers folded; 0, with nothing changed, where a
    base cannot take the update exactly (a quantised or non-Linear base, DoRA or another variant)."""
    from ..engine.fused_projections import merges_as_a_delta

    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    if not layers or not all(merges_as_a_delta(layer) for layer in layers):
        return 0
    with torch.no_grad():
        for layer in layers:
            weight = layer.get_base_layer().weight
            for adapter in [a for a in layer.active_adapters if a in layer.lora_A]:
                weight += layer.get_delta_weight(adapter).to(weight.dtype)
                layer.reset_lora_parameters(adapter, True)  # PEFT's own init: A random, B zero
    return len(layers)

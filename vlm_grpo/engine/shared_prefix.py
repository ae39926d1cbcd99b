"""Shared-prefix scoring: each GRPO group's prompt and images computed once.

In GRPO every prompt (image + text) is repeated `num_generations` (G) times, and TRL's
`_get_per_token_logps_and_entropies` runs the whole model on every row: the vision tower encodes each image G
times and the language model runs the (mostly image-token) prompt G times. Here the rows that share a prompt and
images (a group, found and verified in the batch; shuffled rows are fine) become one packed row

    [ prompt[:-1] | p, c_1[:-1] | p, c_2[:-1] | ... | p, c_G[:-1] ]        p = the prompt's last token

with one copy of the group's images and a 4-D attention mask: the prompt is causal (Gemma3: image tokens also
attend bidirectionally within their image, as the model does), each segment `p, c_k` sees the prompt and its own
past, never another segment. Each segment starts with a copy of `p` because `p`'s hidden state predicts the first
completion token and a position carries one label; the copy, at `p`'s position and seeing the same keys, has the
same hidden state. Every token keeps the position it has in its unpacked row. Gradients through the shared prompt
sum over the group, exactly as the repeated computation gives.

The log-probs (and entropies) come from TRL's own fused LM head (`model(..., fused_lm_head=True)`, which the
trainer adds; its keywords are listed in `vlm_grpo.private_api`): it takes pre-shifted `shift_labels`, so temperature, logit softcapping/scaling and the entropy are
TRL's. Results are mapped back to TRL's `[B, logits_to_keep]` layout, zero where the completion mask is 0 (as
TRL's are).

Positions, per family (transformers 5, read from the modeling code):
- Qwen2-VL / Qwen2.5-VL / Qwen3-VL: multimodal rotary positions `(3, B, L)` (temporal, height, width) from the
  model's `get_rope_index` over the unpadded tokens; a 3-row `position_ids` is used as given (a 4-row one would
  put text positions first, only needed for mask-from-positions packing, which a 4-D mask makes moot). In the
  unpacked row the completion extends the prompt's trailing text run, so completion token j sits at
  `max(prompt positions) + 1 + j` on all three axes. We call `get_rope_index` on the group's prompt only.
- Gemma3: 1-D positions; with `position_ids=None` the model numbers every column, left padding included, which
  RoPE cannot tell from 0-based numbering (a constant shift). The mask arrives as a dict
  `{"full_attention", "sliding_attention"}` (the model builds both itself otherwise): sliding layers also limit
  `query_pos - key_pos < sliding_window`, measured in unpacked positions.
- Idefics3 / SmolVLM, LLaVA-OneVision, InternVL, Mistral 3: 1-D positions as Gemma3; a 4-D mask is used as-is. GLM-4.1V
  / 4.6V: 3-D positions from `get_rope_index`, as Qwen's.
- PaliGemma (prefix-LM): the whole prompt is shared and attends bidirectionally; each segment sees its copy of `p`,
  never the shared one (`hidden`). PaliGemma 2 builds its sliding-window masks from the one mask: rows within the window.

Attention: the mask is built in the format the model's attention implementation expects (boolean for `sdpa`,
additive float for `eager`); FlashAttention cannot take a 4-D mask, so those models fall back to TRL's path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import core_model, family_of, find_family, model_types
from ..media.batch_layout import ImageLayout, LayoutUnknown, group_rows
from ..media.forward_inputs import images_per_row_input

__all__ = ["SUPPORTED_MODEL_TYPES", "SharedPrefixUnsupported", "shared_prefix_logps", "unsupported_reason"]

# The families it serves (`Family.shared_prefix`, each checked against the unpacked forward in tests/test_families.py).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = model_types(lambda family: family.shared_prefix)
_MASK_ATTENTION = ("sdpa", "eager")
_HANDLED_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "token_type_ids",
                   "mm_token_type_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                   "num_videos", "image_sizes", "num_tiles")  # fmt: skip


class SharedPrefixUnsupported(Exception):
    """The shared path cannot serve this model or batch; the message says why (use the plain path)."""


def unsupported_reason(model: torch.nn.Module, compute_aux_loss: bool = False, **model_inputs: Any) -> str | None:
    """Why the shared path cannot score `model` with these inputs (None when it can).

    Checks the model (family, attention implementation, layer types, PEFT type) and which multimodal inputs are
    present; the batch itself (groups, images in completions) is checked by `shared_prefix_logps`.
    """
    core = core_model(model)
    config = core.config
    family = find_family(config)
    if family is None or not family.shared_prefix:
        return f"model type {config.model_type!r} is not one it knows ({', '.join(SUPPORTED_MODEL_TYPES)})"
    text_config = config.get_text_config()
    attn = getattr(text_config, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if attn not in _MASK_ATTENTION:
        return f"attention implementation {attn!r} cannot take a custom 4-D mask (load with attn_implementation='sdpa')"
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)} are not handled"
    if getattr(text_config, "use_bidirectional_attention", False) and not family.prefix_lm:  # PaliGemma's: our mask
        return "bidirectional text attention is not handled"
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning PEFT adapters add virtual tokens the packing does not place"
    if compute_aux_loss:
        return "the MoE load-balancing loss needs TRL's unpacked rows"
    extra = sorted(k for k, v in model_inputs.items() if v is not None and k not in _HANDLED_INPUTS)
    if extra:
        return f"model inputs {extra} are not handled"
    pixel_values = model_inputs.get("pixel_values")
    if pixel_values is not None:
        if model_inputs.get("num_images") is None:
            return "pixel_values came without num_images, so rows cannot be matched to their images"
        if family.rope == "mrope" and (
            model_inputs.get("image_grid_thw") is None or model_inputs.get("mm_token_type_ids") is None
        ):
            return "Qwen pixel_values came without image_grid_thw / mm_token_type_ids (needed for 3-D positions)"
    if model_inputs.get("pixel_values_videos") is not None and (
        model_inputs.get("num_videos") is None
        or model_inputs.get("video_grid_thw") is None
        or model_inputs.get("mm_token_type_ids") is None
    ):
        return "pixel_values_videos came without num_videos / video_grid_thw / mm_token_type_ids"
    return None


@dataclass
class _Group:
    rows: list[int]  # batch rows sharing prompt and images; rows[0] supplies them
    prompt_cols: list[int]  # unpadded prompt columns of rows[0]
    completion_cols: dict[int, list[int]] = field(default_factory=dict)  # row -> unpadded completion columns


def _find_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, model_inputs: dict[str, Any],
    images: ImageLayout | None, image_token_ids: set[int], prefix_lm: bool = False,
) -> list[_Group]:  # fmt: skip
    """Group the rows whose unpadded prompt tokens and images are identical (anywhere in the batch)."""
    batch, length = input_ids.shape
    prompt_len = length - logits_to_keep
    ids = input_ids.tolist()
    mask = attention_mask.tolist()
    type_ids = None
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name == "token_type_ids" and prefix_lm:  # PaliGemma's mark the prompt (0) and completion (1), not images
            continue
        if model_inputs.get(name) is not None:
            type_ids = model_inputs[name].tolist()
            if any(any(row[prompt_len:]) for row in type_ids):
                raise SharedPrefixUnsupported(f"{name} marks image tokens in completions (e.g. tool images)")

    keys, prompt_cols = [], []
    for r in range(batch):
        cols = [c for c in range(prompt_len) if mask[r][c]]
        if not cols:
            raise SharedPrefixUnsupported("a row has an empty prompt")
        prompt = tuple(ids[r][c] for c in cols)
        if prompt[-1] in image_token_ids or (type_ids is not None and type_ids[r][cols[-1]]):
            raise SharedPrefixUnsupported("a prompt ends with an image token")
        keys.append((prompt, tuple(type_ids[r][c] for c in cols) if type_ids else None))
        prompt_cols.append(cols)
    groups = []
    for rows in group_rows(keys, images, model_inputs):
        completion_cols = {r: [prompt_len + c for c in range(logits_to_keep) if mask[r][prompt_len + c]] for r in rows}
        groups.append(_Group(rows, prompt_cols[rows[0]], completion_cols))
    return groups


def _chunks(groups: list[_Group], batch_size: int | None) -> list[list[_Group]]:
    """Consecutive groups covering at most `batch_size` batch rows per forward (at least one group)."""
    if not batch_size:
        return [groups]
    chunks: list[list[_Group]] = [[]]
    rows = 0
    for g in groups:
        if chunks[-1] and rows + len(g.rows) > batch_size:
            chunks.append([])
            rows = 0
        chunks[-1].append(g)
        rows += len(g.rows)
    return chunks


def _pack(chunk: list[_Group], length: int, logits_to_keep: int, prefix_lm: bool = False) -> dict[str, torch.Tensor]:
    """CPU index tensors describing the packed rows of one forward.

    Per packed token: `source` (flat index into the batch's input_ids), `segment` (-1 padding, 0 shared prompt,
    k >= 1 the k-th completion segment), `position` (its position in the unpacked row), `completion_offset`
    (-1 for prompt tokens, j for the j-th completion token: Qwen places it after the prompt's positions),
    `prompt_col` (the prompt column whose rotary position a prompt token takes) and `label_source` (flat index of
    the next token it predicts, -1 for none). Per labelled token in packed order: `label_position` (flat index into
    the packed rows) and `output` (flat index into the `[B, logits_to_keep]` result).

    A prefix-LM (`prefix_lm`: PaliGemma, its prompt bidirectional) keeps the whole prompt shared, as its tokens attend
    to `p` too; that `p` is marked `hidden` (the segments see their own copy of it instead).
    """
    prompt_len = length - logits_to_keep
    rows, outputs = [], []
    for g in chunk:
        ref = g.rows[0]
        cols = g.prompt_cols
        n_prompt = len(cols)
        segments = [(r, g.completion_cols[r]) for r in g.rows if g.completion_cols[r]]
        # With no completion to score, or for a prefix-LM, the whole prompt.
        shared = cols if not segments or prefix_lm else cols[:-1]
        source = [ref * length + c for c in shared]
        segment = [0] * len(shared)
        position = list(range(len(shared)))
        offset = [-1] * len(shared)
        prompt_col = list(shared)
        label = [-1] * len(shared)
        hidden = [0] * (len(shared) - 1) + [int(prefix_lm and bool(segments))]
        for k, (r, comp) in enumerate(segments, start=1):
            n = len(comp)
            source += [ref * length + cols[-1]] + [r * length + c for c in comp[:-1]]
            segment += [k] * n
            position += list(range(n_prompt - 1, n_prompt - 1 + n))
            offset += [-1] + list(range(n - 1))
            prompt_col += [cols[-1]] + [0] * (n - 1)
            label += [r * length + c for c in comp]
            hidden += [0] * n
            outputs += [r * logits_to_keep + (c - prompt_len) for c in comp]
        rows.append((source, segment, position, offset, prompt_col, label, hidden))
    width = max(len(r[0]) for r in rows)
    # Padding copies the first group's last prompt token (never an image token: `_find_groups`), attends to itself.
    first = chunk[0]
    fill = (first.rows[0] * length + first.prompt_cols[-1], -1, 0, -1, 0, -1, 0)
    table = torch.tensor([[col + [f] * (width - len(col)) for col, f in zip(r, fill)] for r in rows], dtype=torch.long)
    names = ("source", "segment", "position", "completion_offset", "prompt_col", "label_source", "hidden")
    packed = {name: table[:, i] for i, name in enumerate(names)}
    packed["label_position"] = (packed["label_source"] >= 0).reshape(-1).nonzero().squeeze(1)
    packed["output"] = torch.tensor(outputs, dtype=torch.long)
    return packed


def _block_ids(token_type_ids: torch.Tensor) -> torch.Tensor:
    """Gemma3's image blocks: an id per run of image tokens (token type 1), -1 elsewhere."""
    is_image = token_type_ids == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(-1) - 1, -1)


def _attention_masks(
    segment: torch.Tensor, position: torch.Tensor, blocks: torch.Tensor | None, layer_types: set[str],
    sliding_window: int | None, hidden: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Boolean (rows, 1, T, T) masks, True where a query may attend a key, per layer type. With `hidden` (a prefix-LM's
    packing), the shared prompt attends bidirectionally within itself, and its last token only to the prompt."""
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    visible = (k_seg == 0) | (k_seg == q_seg)  # the shared prompt, or the query's own segment
    q_pos, k_pos = position[:, :, None], position[:, None, :]
    order = k_pos <= q_pos
    if hidden is not None:  # the segments see their copy of the prompt's last token, the prompt the original
        visible = visible & ~((hidden[:, None, :] == 1) & (q_seg != 0))
        order = order | ((q_seg == 0) & (k_seg == 0))
    if blocks is not None:  # Gemma3: image tokens see their whole image
        order = order | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
    allowed = visible & order & (k_seg >= 0)
    # Padding queries attend to themselves only, so their (unused) outputs stay finite.
    allowed = allowed | torch.eye(segment.size(1), dtype=torch.bool, device=segment.device)
    masks = {"full_attention": allowed[:, None]}
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = (allowed & (q_pos - k_pos < sliding_window))[:, None]
    return masks


def shared_prefix_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    unwrapped_model: torch.nn.Module | None = None,
    **model_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of TRL's GRPO batch, each group's prompt and images computed once.

    Same inputs and results as `GRPOTrainer._get_per_token_logps_and_entropies` (without the MoE aux loss): rows
    `[left-padded prompt | right-padded completion]`, `logits_to_keep` completion columns, the multimodal inputs
    TRL passes. Returns `[B, logits_to_keep]` tensors, zero where `attention_mask` is 0 in the completion.

    Args:
        model: the model as called (may be wrapped by DDP / PEFT); must carry TRL's fused LM head.
        batch_size: rows per forward in TRL's sense; whole groups are packed, up to this many rows per forward.
        compute_aux_loss: TRL's MoE load-balancing loss request; not served (raises).
        unwrapped_model: `model` without distributed wrappers (for its config and rope-index function).

    Raises:
        SharedPrefixUnsupported: the model or batch is one the shared path cannot serve (use TRL's path).
    """
    unwrapped_model = unwrapped_model if unwrapped_model is not None else model
    reason = unsupported_reason(unwrapped_model, compute_aux_loss, **model_inputs)
    if reason is not None:
        raise SharedPrefixUnsupported(reason)
    core = core_model(unwrapped_model)
    family = family_of(core)
    config, text_config = core.config, core.config.get_text_config()
    batch, length = input_ids.shape
    num_images, num_videos = model_inputs.get("num_images"), model_inputs.get("num_videos")
    images_per_row = [int(n) for n in num_images] if num_images is not None else [0] * batch
    videos_per_row = [int(n) for n in num_videos] if num_videos is not None else [0] * batch
    try:
        images = ImageLayout.of(model_inputs, images_per_row, videos_per_row)
    except LayoutUnknown as error:
        raise SharedPrefixUnsupported(str(error)) from error
    groups = _find_groups(
        input_ids,
        attention_mask,
        logits_to_keep,
        model_inputs,
        images,
        family.image_token_ids(config),
        family.prefix_lm,
    )
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    window = getattr(text_config, "sliding_window", None)
    if layer_types != {"full_attention"} and not family.dict_mask and not (window and length <= window):
        # One mask for every layer: exact only while no row is longer than the window (as the plain path sees it).
        raise SharedPrefixUnsupported(
            f"{config.model_type} builds its sliding-window masks from one mask, and rows of {length} tokens exceed "
            f"its sliding window ({window})"
        )
    attn = getattr(text_config, "_attn_implementation", None) or config._attn_implementation
    prompt_len = length - logits_to_keep

    flat_ids = input_ids.reshape(-1)
    logps, entropies, outputs, anchors = [], [], [], []
    for chunk in _chunks(groups, batch_size):
        packed = _pack(chunk, length, logits_to_keep, family.prefix_lm)
        packed = {k: v.to(input_ids.device, non_blocking=True) for k, v in packed.items()}
        refs = [g.rows[0] for g in chunk]
        # One copy of each group's images and clips (its first row's); a forward without any gets no (empty) vision
        # tensors.
        with_images = images is not None and any(images_per_row[r] or videos_per_row[r] for r in refs)
        inputs = images.vision_inputs(model_inputs, refs) if with_images else {}
        if with_images:  # LLaVA-OneVision's image counts of this forward's rows
            inputs.update(images_per_row_input(family, [images_per_row[r] for r in refs], input_ids.device))
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name == "token_type_ids" and family.prefix_lm:  # the 4-D mask says what they would
                continue
            if model_inputs.get(name) is not None:
                inputs[name] = model_inputs[name].reshape(-1)[packed["source"]]
        position_ids = _position_ids(core, packed, inputs, input_ids, attention_mask, prompt_len, refs, model_inputs)
        bidirectional = family.bidirectional_image_attention and family.token_type_key in inputs
        blocks = _block_ids(inputs[family.token_type_key]) if bidirectional else None
        masks = _attention_masks(
            packed["segment"], packed["position"], blocks, layer_types, window,
            packed["hidden"] if family.prefix_lm else None,
        )  # fmt: skip
        if attn == "eager":  # eager attention adds the mask to the scores
            dtype = core.get_input_embeddings().weight.dtype
            masks = {k: torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype) for k, m in masks.items()}
        labels = torch.where(packed["label_source"] >= 0, flat_ids[packed["label_source"].clamp(min=0)], -100)
        out = model(
            input_ids=flat_ids[packed["source"]],
            attention_mask=masks if family.dict_mask and layer_types != {"full_attention"} else masks["full_attention"],
            position_ids=position_ids,
            shift_labels=labels,
            fused_lm_head=True,
            **inputs,
        )
        logps.append(out.log_probs.reshape(-1)[packed["label_position"]])
        if compute_entropy:
            entropies.append(out.entropy.reshape(-1)[packed["label_position"]])
        outputs.append(packed["output"])
        # Keeps the result connected to the model when nothing is labelled (as TRL's all-masked micro-batch is).
        anchors.append(out.log_probs.sum() * 0)

    index = torch.cat(outputs)

    def unpack(values: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(values)
        result = flat.new_zeros(batch * logits_to_keep).index_put((index,), flat)
        if not flat.numel():
            result = result + sum(anchors)
        return result.view(batch, logits_to_keep)

    return unpack(logps), (unpack(entropies) if compute_entropy else None)


def _position_ids(
    core: torch.nn.Module, packed: dict[str, torch.Tensor], inputs: dict[str, Any], input_ids: torch.Tensor,
    attention_mask: torch.Tensor, prompt_len: int, refs: list[int], model_inputs: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """Each packed token's position in its unpacked row: (rows, T), or (3, rows, T) for Qwen's 3-D rotary."""
    position = packed["position"]
    if family_of(core).rope != "mrope":
        return position
    if "image_grid_thw" not in inputs and "video_grid_thw" not in inputs:  # text only: 1-D positions on three axes
        return position[None].expand(3, -1, -1)
    # The model's own 3-D positions for each group's prompt (clips' temporal steps spaced by `second_per_grid_ts` on
    # Qwen2.5-VL); the completion continues after their maximum.
    ref_index = torch.tensor(refs, device=input_ids.device)
    get_rope_index = getattr(getattr(core, "model", None), "get_rope_index", None) or core.get_rope_index
    timing = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
    prompt_positions, _ = get_rope_index(
        input_ids[ref_index, :prompt_len],
        mm_token_type_ids=model_inputs["mm_token_type_ids"][ref_index, :prompt_len],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=attention_mask[ref_index, :prompt_len],
        **timing,
    )
    prompt_positions = prompt_positions.to(input_ids.device)  # (3, groups, prompt_len), 0 at padding
    start = prompt_positions.amax(dim=(0, 2)) + 1
    from_prompt = prompt_positions.gather(2, packed["prompt_col"].expand(3, -1, -1))
    offset = packed["completion_offset"]
    return torch.where(offset >= 0, start[None, :, None] + offset, from_prompt)

"""Qwen-VL vision attention in a few batched calls instead of one call per window.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 vision towers attend within chunks of patches: each image (full-attention layers)
or each 8x8-patch window (Qwen2.5-VL's windowed layers), given as `cu_seqlens`. With `sdpa`, transformers' vision
attention splits the sequence and calls attention once per chunk, from Python: a 448² image is 16 windows, so a
Qwen2.5-VL-3B vision pass over two images makes ~900 attention calls, and every prefill, scoring and training pass
(and its checkpointed recomputation) pays for them in kernel launches. With an attention implementation whose name
contains "flash", the same modules instead hand the function the whole sequence and `cu_seq_lens_q` (the varlen
convention of FlashAttention); nothing else in the vision tower changes.

`packed_attention` takes that call and computes exactly the per-chunk attention, batched: chunks of equal length
are stacked and attended in one `scaled_dot_product_attention` call each (a 448² image has one window length, so
a layer makes one or two calls). No mask is built, so memory stays what the per-chunk loop used. It is registered
with transformers' `AttentionInterface` as `PACKED` and named in a copy of the vision config that only the vision
attention layers hold (`pack_vision_attention`): the model's config, the text model and anything built from the
config (an export, a sharded copy) keep `sdpa`.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PACKED", "PACKED_VISION_ATTENTIONS", "pack_vision_attention", "packed_attention", "uses_packed_attention"]

logger = logging.getLogger(__name__)

# Contains "flash" on purpose: transformers' Qwen vision attention passes `cu_seq_lens_q` to an implementation whose
# name does (`is_flash_attention_requested`), and splits the sequence itself otherwise.
PACKED = "vlm_grpo_packed_flash_varlen"
# The vision attention classes that branch that way (checked against transformers' source by the tests).
PACKED_VISION_ATTENTIONS = (
    "Qwen2VLVisionAttention",
    "VisionAttention",  # Qwen2-VL's name in some releases
    "Qwen2_5_VLVisionAttention",
    "Qwen3VLVisionAttention",
    "Qwen3VLMoeVisionAttention",
    "Qwen3_5VisionAttention",
    "Qwen3_5MoeVisionAttention",
)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each `cu_seq_lens_q` chunk of a packed `[1, heads, tokens, dim]` sequence.

    Returns `([1, tokens, heads, dim], None)`, as transformers' attention functions do. Chunks of one length are
    attended together in one `scaled_dot_product_attention` call.
    """
    if cu_seq_lens_q is None or attention_mask is not None or is_causal or query.shape[0] != 1:
        raise ValueError(
            f"{PACKED} serves the Qwen-VL vision towers' packed, unmasked, bidirectional attention only; "
            f"{type(module).__name__} called it otherwise. Load the model with attn_implementation='sdpa'."
        )
    if (
        cu_seq_lens_k is not None
        and cu_seq_lens_k is not cu_seq_lens_q
        and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    ):
        raise ValueError(f"{PACKED}: key and query chunks differ; it serves self-attention only.")
    bounds = _bounds(cu_seq_lens_q)
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in itertools.pairwise(bounds):
        if end > start:
            starts_by_length[end - start].append(start)
    heads, tokens, dim = query.shape[1:]
    dropout = dropout if module.training else 0.0

    def attend(index: torch.Tensor | None, count: int, length: int) -> torch.Tensor:
        def chunks(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [count, H, length, D]
            x = x[0] if index is None else x[0].index_select(1, index)
            return x.unflatten(1, (count, length)).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            chunks(query), chunks(key), chunks(value), dropout_p=dropout, scale=scaling
        )
        return out.permute(0, 2, 1, 3).reshape(count * length, heads, dim)  # token-major, as the chunks were taken

    if len(starts_by_length) == 1:  # one chunk length (the usual case): the sequence is already the batch
        (length, starts), = starts_by_length.items()  # fmt: skip
        if len(starts) * length == tokens:
            return attend(None, len(starts), length).unsqueeze(0), None
    pieces, order = [], []
    for length, starts in starts_by_length.items():
        index = (
            torch.tensor(starts, device=query.device)[:, None] + torch.arange(length, device=query.device)
        ).flatten()
        pieces.append(attend(index, len(starts), length))
        order.append(index)
    # Back to sequence order: position p of the concatenated pieces holds token order[p].
    inverse = torch.empty(tokens, dtype=torch.long, device=query.device)
    order = torch.cat(order)
    inverse[order] = torch.arange(order.numel(), device=query.device)
    return torch.cat(pieces).index_select(0, inverse).unsqueeze(0), None


def _bounds(cu_seq_lens: torch.Tensor) -> list[int]:
    """The chunk bounds as host integers. Reading them waits for the GPU (transformers' per-chunk loop does the same
    in every layer); the vision tower hands one `cu_seqlens` tensor to all its layers, so the bounds are kept on it
    and read once per tower pass, not once per layer (a Qwen2.5-VL-3B pass: 32 waits -> 2)."""
    version, bounds = getattr(cu_seq_lens, "_vlm_grpo_bounds", (None, None))
    if bounds is None or version != cu_seq_lens._version:  # read afresh after any in-place change
        bounds = cu_seq_lens.tolist()
        if not torch.compiler.is_compiling():
            cu_seq_lens._vlm_grpo_bounds = (cu_seq_lens._version, bounds)
    return bounds


def pack_vision_attention(model: nn.Module) -> int:
    """Give `model`'s Qwen-VL vision attention layers `packed_attention` where they use `sdpa`; returns the layers
    served (0 for other families, and for towers loaded with another implementation: eager for attention outputs,
    FlashAttention, which already takes the packed call).

    The layers get a copy of their config naming `PACKED`; the model's own config keeps `sdpa`, so a model built from
    it (a merged export, a sharded copy) is an ordinary transformers model.
    """
    from transformers import AttentionInterface

    layers = [m for m in model.modules() if _takes_packed_calls(m)]
    if not layers or any(m.config._attn_implementation not in ("sdpa", PACKED) for m in layers):
        return 0
    AttentionInterface.register(PACKED, packed_attention)  # idempotent
    packed_configs: dict[int, Any] = {}
    for layer in layers:
        if layer.config._attn_implementation == PACKED:
            continue
        config = packed_configs.get(id(layer.config))
        if config is None:
            config = packed_configs[id(layer.config)] = copy.copy(layer.config)
            config._attn_implementation = PACKED
        layer.config = config
    logger.info("Vision attention: %d layers attend to their windows in batched calls (%s).", len(layers), PACKED)
    return len(layers)


def _takes_packed_calls(module: nn.Module) -> bool:
    """Whether `module` is one of transformers' Qwen-VL vision attention classes (by name and defining module: a
    remote-code model's own `VisionAttention` need not follow the packed-call protocol)."""
    cls = type(module)
    return (
        cls.__name__ in PACKED_VISION_ATTENTIONS
        and cls.__module__.startswith("transformers.models.qwen")
        and hasattr(module, "config")
    )


def uses_packed_attention(model: nn.Module) -> bool:
    """Whether `pack_vision_attention` serves any of `model`'s vision attention layers."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == PACKED for m in model.modules())

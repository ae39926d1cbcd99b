"""Attention for one decode token with grouped-query heads, without copying the KV cache for every query head.

Qwen2.5-VL-3B has 16 query heads and 2 key/value heads. With a mask (a static cache always needs one: its unwritten
slots must not be attended), transformers' `sdpa` attention repeats the cached keys and values for every query head
before calling `scaled_dot_product_attention` (`repeat_kv`), and under `torch.compile` it always does. That copy is
written and read at every layer of every decode step: on an H100 with 64 rows it took 5.6 of a step's 16 ms, more
than reading the weights (`benchmarks/results/h100-decode-profile-before/`).

With one query token the copy is not needed: the G query heads that share a key/value head are laid out as G query
rows of that head, `[B, H, 1, D] -> [B, H/G, G, D]`, and attend to the cache as it is; the mask `[B, 1, 1, L]` is the
same for all of them. Each query row's attention is computed as transformers' eager attention computes it, on the
same keys, values and mask.
`decode_attention(model)` switches the text model to this function for a block (the decode loop) and back; anything
it does not cover (prefill, no grouping, per-head masks, soft-capping, position biases) goes to transformers' `sdpa`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["DECODE_ATTENTION", "decode_attention", "grouped_decode_sdpa"]

DECODE_ATTENTION = "vlm_grpo_grouped_decode_sdpa"


def grouped_decode_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` [B, H, 1, D], `key` / `value` [B, H/G, L, D], returns
    `([B, 1, H, D], None)`; other shapes and options are passed to transformers' `sdpa_attention_forward`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    plain = (
        q_length != 1
        or groups == 1
        or dropout
        or (attention_mask is not None and attention_mask.shape[1] != 1)  # a mask per head
        or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    grouped = query.reshape(batch, heads // groups, groups, dim)  # query head h = kv head h // G, row h % G
    # transformers' eager attention arithmetic (`eager_attention_forward`): scores in the model's dtype, softmax in
    # float32 (or wider). Under torch.compile this is two small batched GEMMs and one fused masked softmax, 2.5x faster on an
    # H100 than the fused SDPA kernels, whose tiles of 64+ query rows leave all but B x H/G blocks idle with 8 rows
    # (`benchmarks/decode_kernels.py`: 8.2 against 20.2 us per layer for the 3B, 16 rows).
    # The query is scaled before the product (as SDPA's math does), so fp16 scores do not overflow before scaling.
    scores = torch.matmul(grouped * (dim**-0.5 if scaling is None else scaling), key.transpose(-1, -2))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    out = torch.matmul(probs, value)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_sdpa)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the masks `sdpa` gets, built the same way


@contextlib.contextmanager
def decode_attention(model: nn.Module) -> Iterator[bool]:
    """Inside the block the text model's `sdpa` attention is `grouped_decode_sdpa`; yields whether it switched
    (only `sdpa` models with grouped key/value heads are switched)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads, kv_heads = getattr(config, "num_attention_heads", 1), getattr(config, "num_key_value_heads", None)
    if config._attn_implementation != "sdpa" or not kv_heads or kv_heads == heads:
        yield False
        return
    _register()
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"

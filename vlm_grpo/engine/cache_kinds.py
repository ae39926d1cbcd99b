"""The kinds of layer a decode cache holds, and what the fast generator does with each.

transformers' caches hold one layer per entry of the text config's `layer_types`:
- **attention** (`full_attention`, `sliding_attention`): keys and values per token (`DynamicLayer` and its sliding
  variant in the prefill's dynamic cache, `StaticLayer` and its sliding variant in the static decode cache);
- **state** (`linear_attention`: Qwen3.5's gated delta rule, a convolution state and a recurrent state; `conv`:
  LFM2's short convolution, a convolution state): `LinearAttentionLayer` in both caches, fixed-size tensors the
  model's single-token step updates in place (so a recorded CUDA graph keeps their addresses);
- **none** (`moe`, `mlp`): `DummyLayer`, nothing cached.

A prompt group is prefilled once into a dynamic cache and each row of the group gets its prompt's state
(`copy_prefill`): attention layers their keys and values, state layers their convolution and recurrent states (marked
as continuing, so the next forward takes the single-token path). Any other layer (an indexed, quantised or hybrid layer
a new model brings) is refused with `UnservableCache`, which the generator turns into a logged fallback to TRL's
`generate`: never a crash. `state_tensors` lists what a recording reads of a cache, for `engine.decode_graph`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UnservableCache", "copy_prefill", "layer_kind", "state_tensors"]


class UnservableCache(RuntimeError):
    """A cache layer the fast path does not know how to copy or record; the message names it."""


def _classes(*names: str) -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(c for c in (getattr(cache_utils, n, None) for n in names) if isinstance(c, type))


def layer_kind(layer: Any) -> str:
    """`"attention"`, `"state"` or `"none"` for a cache layer (matched by exact class: a subclass, such as a hybrid
    layer holding both kinds, may store more); `UnservableCache` for anything else."""
    kind = type(layer)
    if kind in _classes("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer"):
        return "attention"
    if kind in _classes("LinearAttentionLayer"):
        return "state"
    if kind in _classes("DummyLayer"):
        return "none"
    raise UnservableCache(f"cache layer {kind.__name__} is not one the fast path copies (attention or linear-attention "
                          "state layers)")  # fmt: skip


def copy_prefill(prefill: Any, cache: Any, index: torch.Tensor) -> None:
    """Give row `i` of `cache` the state row `index[i]` of the prefill cache left: keys and values of attention
    layers, convolution and recurrent states of state layers. Every layer is checked before anything is written."""
    pairs = list(zip(prefill.layers, cache.layers, strict=True))
    kinds = [(layer_kind(source), layer_kind(target)) for source, target in pairs]
    if any(a != b for a, b in kinds):
        raise UnservableCache(f"the prefill and decode caches hold different layer kinds ({kinds})")
    for layer_index, ((source, target), (kind, _)) in enumerate(zip(pairs, kinds, strict=True)):
        if kind == "attention":
            cache.update(source.keys.index_select(0, index), source.values.index_select(0, index), layer_index)
        elif kind == "state":
            _copy_states(source, target, index)


def _copy_states(source: Any, target: Any, index: torch.Tensor) -> None:
    for state, conv in source.conv_states.items():
        if conv is None:
            continue
        conv = conv.index_select(0, index)
        recurrent = source.recurrent_states.get(state)
        recurrent = recurrent.index_select(0, index) if recurrent is not None else None
        if not target.is_conv_states_initialized[state]:  # allocated once, then reused (static addresses)
            target.lazy_initialization(conv_states=conv, state_idx=state, conv_kernel_size=conv.shape[-1])
        if recurrent is not None and not target.is_recurrent_states_initialized[state]:
            target.lazy_initialization(recurrent_states=recurrent, state_idx=state)
        target.conv_states[state].copy_(conv)
        if recurrent is not None:
            target.recurrent_states[state].copy_(recurrent)
        target.has_previous_state[state] = True  # the next forward continues from it (the single-token step)


def state_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor of `cache` a decode step reads or writes in place (keys, values, convolution and recurrent
    states), allocated so far."""
    tensors = []
    for layer in getattr(cache, "layers", []):
        kind = layer_kind(layer)
        if kind == "attention":
            tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
        elif kind == "state":
            tensors += [t for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if t is not None]
    return tensors

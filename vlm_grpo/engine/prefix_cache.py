"""Shared-prefix scoring for models with recurrent layers: each group's prompt computed once, continued per completion.

Packing (`engine.shared_prefix`) puts a group's completions behind one copy of its prompt in one row, kept apart by a
4-D attention mask. Linear-attention and short-convolution layers (Qwen3.5's gated delta rule, LFM2's convolutions)
read no 4-D mask: their convolution and recurrence run through the whole row, so a packed completion would see the
others (measured: logits off by 5-6). For them each group's prompt (its images included) runs once into a cache, and
every completion continues from the group's cache: attention layers read the prompt's keys and values, state layers
start from its convolution and recurrent states, in transformers' own multi-token continuation path (its layers and
kernels). The prompt's last token `p` is left out of the prompt's forward and fed first in each continuation: its
hidden state predicts the first completion token. Positions are those of the unpacked row (Qwen's 3-D rotary positions
from the model's `get_rope_index`; 1-D ones counted over the real tokens, as `generate` counts them).

Gradients flow through each completion's copy of the cache into the prompt's forward, summed over the group, as the
repeated computation gives. Two details keep that exact under activation checkpointing, where transformers drops a
layer's cache (a recomputed layer would otherwise write it twice, or start from the state it wrote):
- The continuation's cache is read-only (`_ReadOnlyAttention`, `_ReadOnlyState`: a layer returns the prompt's state
  joined to the new tokens' and stores nothing), so its layers may keep it when checkpointed: the recomputation reads
  the same tensors.
- The prompt's forward is checkpointed too, its cache taken for the continuation and then emptied
  (`_emptied_for_recompute`): a prompt layer recomputed in backward finds the empty cache its forward found, and what
  it writes there is dropped. It ran unchecked before, keeping every layer's activations (the vision tower's and the
  linear-attention scans' included) until backward: on the H100 that put Qwen3.5-4B's training peak 8 GiB over TRL's
  (`tests/test_prefix_cache.py` counts the bytes kept for backward against TRL's path).
Reentrant checkpointing runs a layer's forward without gradients, so the prompt's cache would reach the continuation
detached: training with it is declined here (TRL's path serves it, the reason logged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from ..compat import cache_kwarg
from ..families import core_model, family_of
from ..media.batch_layout import ImageLayout, LayoutUnknown
from ..models.modes import checkpointing_mode
from .shared_prefix import SharedPrefixUnsupported, _chunks, _find_groups

__all__ = ["RECURRENT_LAYER_TYPES", "prefix_cache_logps", "serves"]

#: Text-model layer types whose state runs through the whole row: packing cannot serve them, this module does.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv"})
_ATTENTION_LAYER_TYPES = frozenset({"full_attention"})
_HANDLED_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids", "pixel_values_videos",
                   "video_grid_thw", "num_videos", "second_per_grid_ts", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles")  # fmt: skip


def serves(model: Any) -> bool:
    """Whether `model`'s text layers include recurrent ones (this module's models, not packing's)."""
    layer_types = set(getattr(core_model(model).config.get_text_config(), "layer_types", None) or [])
    return bool(layer_types & RECURRENT_LAYER_TYPES)


def _unsupported_reason(core: Any, compute_aux_loss: bool, model_inputs: dict[str, Any]) -> str | None:
    if torch.is_grad_enabled() and core.training and checkpointing_mode(core) == "reentrant":
        # Reentrant checkpointing runs a layer's forward without gradients: the prompt's cache it writes would reach
        # the continuation detached, and the prompt's layers would get no gradient through it (measured: 70 of the
        # tiny Qwen3.5's LoRA weights wrong), with nothing raised.
        return (
            "reentrant activation checkpointing detaches the prompt's cache from its gradients "
            "(gradient_checkpointing_kwargs={'use_reentrant': False} takes this path)"
        )
    text_config = core.config.get_text_config()
    layer_types = set(text_config.layer_types)
    if not layer_types <= RECURRENT_LAYER_TYPES | _ATTENTION_LAYER_TYPES:
        return f"layer types {sorted(layer_types)} are not handled by prefix continuation"
    if compute_aux_loss:
        return "the MoE load-balancing loss needs TRL's unpacked rows"
    num_tiles, num_images = model_inputs.get("num_tiles"), model_inputs.get("num_images")
    if num_tiles is not None and list(num_tiles) != list(num_images or []):
        return "images split into several tiles are not handled (one tile per image is)"
    extra = sorted(k for k, v in model_inputs.items() if v is not None and k not in _HANDLED_INPUTS)
    if extra:
        return f"model inputs {extra} are not handled"
    return None


class _ReadOnlyAttention(DynamicLayer):
    """The prompt's keys and values; `update` returns them joined to the new tokens' and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class _ReadOnlyState(LinearAttentionLayer):
    """The prompt's convolution and recurrent states; updates return the continuation's and store nothing. Marked as
    recording its past, so even a one-token continuation takes the multi-token path (the single-token one updates the
    convolution state in place)."""

    def __init__(self, conv: dict[int, torch.Tensor], recurrent: dict[int, torch.Tensor]) -> None:
        super().__init__(number_of_states=len(conv))
        for state, tensor in conv.items():
            self.conv_states[state], self.recurrent_states[state] = tensor, recurrent.get(state)
            self.is_conv_states_initialized[state] = True
            self.is_recurrent_states_initialized[state] = recurrent.get(state) is not None
            self.conv_kernel_size[state] = tensor.shape[-1]
            self.has_previous_state[state] = True
        first = next(iter(conv.values()))
        self.dtype, self.device, self.record_past = first.dtype, first.device, True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return torch.cat([self.conv_states[state_idx], conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> Any:
        return recurrent_states


def _continuation_cache(prompt_cache: Any, index: torch.Tensor, config: Any) -> Any:
    """A cache whose row i holds the prompt state row `index[i]` of `prompt_cache` left, read-only."""
    layers: list[Any] = []
    for layer in prompt_cache.layers:
        if hasattr(layer, "conv_states"):
            conv = {s: t.index_select(0, index) for s, t in layer.conv_states.items() if t is not None}
            recurrent = {s: t.index_select(0, index) for s, t in layer.recurrent_states.items() if t is not None}
            layers.append(_ReadOnlyState(conv, recurrent))
        else:
            layers.append(_ReadOnlyAttention(layer.keys.index_select(0, index), layer.values.index_select(0, index)))
    cache = DynamicCache(config=config)
    cache.layers = layers
    return cache


@contextlib.contextmanager
def _layers_keep_cache(core: Any) -> Iterator[None]:
    """Within the block, checkpointed decoder layers keep the cache they are given (transformers drops it: a layer
    recomputed in backward would write it again); each layer's own setting is restored after."""
    layers = [m for m in core.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    saved = [(m, m.__dict__.get("_can_checkpoint_with_cache")) for m in layers]
    for module in layers:
        module._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for module, attribute in saved:
            if attribute is None:
                module.__dict__.pop("_can_checkpoint_with_cache", None)
            else:
                module._can_checkpoint_with_cache = attribute


def _carries_gradients(cache: Any) -> bool:
    """Whether any of the prompt cache's tensors (keys, values, convolution and recurrent states) requires grad."""
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            tensors += list((states or {}).values())
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            return True
    return False


def _emptied_for_recompute(cache: Any, config: Any) -> None:
    """`cache`'s layers replaced by new empty ones, as the prompt's forward found them: a checkpointed prompt layer
    recomputed in backward then reads no state (its forward read none) and writes where nothing reads it. The
    continuation holds the filled layers' tensors (`_continuation_cache`)."""
    cache.layers = DynamicCache(config=config).layers


def _positions(
    core: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: dict[str, Any], type_ids: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(prompt positions, first completion position)` of the prompts `input_ids` [G, prompt_len]: (3, G, prompt_len)
    and (G,) for Qwen's 3-D rotary positions (the model's `get_rope_index`), (G, prompt_len) and (G,) counted over
    the real tokens otherwise (as `generate` counts them)."""
    if family_of(core).rope != "mrope":
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return positions, positions[:, -1] + 1
    get_rope_index = getattr(getattr(core, "model", None), "get_rope_index", None) or core.get_rope_index
    timing = {"second_per_grid_ts": vision["second_per_grid_ts"]} if "second_per_grid_ts" in vision else {}
    positions, _ = get_rope_index(
        input_ids, mm_token_type_ids=type_ids, image_grid_thw=vision.get("image_grid_thw"),
        video_grid_thw=vision.get("video_grid_thw"), attention_mask=attention_mask, **timing,
    )  # fmt: skip
    positions = positions.to(input_ids.device)
    return positions, positions.amax(dim=(0, 2)) + 1


def prefix_cache_logps(
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
    """Per-token log-probs (and entropies) of TRL's GRPO batch, each group's prompt and images computed once and
    continued per completion; the same inputs and results as `shared_prefix.shared_prefix_logps` (TRL's layout, zero
    where the completion mask is 0).

    Raises:
        SharedPrefixUnsupported: the model or batch is one this path cannot serve (use TRL's path).
    """
    core = core_model(unwrapped_model if unwrapped_model is not None else model)
    reason = _unsupported_reason(core, compute_aux_loss, model_inputs)
    if reason is not None:
        raise SharedPrefixUnsupported(reason)
    batch, length = input_ids.shape
    prompt_len = length - logits_to_keep
    num_images, num_videos = model_inputs.get("num_images"), model_inputs.get("num_videos")
    images_per_row = [int(n) for n in num_images] if num_images is not None else [0] * batch
    videos_per_row = [int(n) for n in num_videos] if num_videos is not None else [0] * batch
    try:
        images = ImageLayout.of(model_inputs, images_per_row, videos_per_row)
    except LayoutUnknown as error:
        raise SharedPrefixUnsupported(str(error)) from error
    family = family_of(core)
    groups = _find_groups(
        input_ids, attention_mask, logits_to_keep, model_inputs, images, family.image_token_ids(core.config)
    )
    if prompt_len < 2:
        raise SharedPrefixUnsupported("prompts of one token leave nothing to compute once")
    type_ids = model_inputs.get("mm_token_type_ids")
    cache_name = cache_kwarg(core)
    logps = torch.zeros(batch, logits_to_keep, device=input_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    results = []
    # Checkpointed layers keep the cache they are given, in the prompt's forward and in the continuation.
    with _layers_keep_cache(core):
        for chunk in _chunks(groups, batch_size):
            refs = torch.tensor([g.rows[0] for g in chunk], device=input_ids.device)
            rows = torch.tensor([r for g in chunk for r in g.rows], device=input_ids.device)
            index = torch.tensor([k for k, g in enumerate(chunk) for _ in g.rows], device=input_ids.device)
            with_media = images is not None and any(images_per_row[r] or videos_per_row[r] for r in refs.tolist())
            vision = images.vision_inputs(model_inputs, refs.tolist()) if with_media else {}
            vision = {k: v.to(input_ids.device) for k, v in vision.items()}
            prompt_ids, prompt_mask = input_ids[refs, :prompt_len], attention_mask[refs, :prompt_len]
            prompt_types = type_ids[refs, :prompt_len] if type_ids is not None else None
            positions, start = _positions(core, prompt_ids, prompt_mask, vision, prompt_types)
            # The prompt once per group, into a cache: its last token is fed again by each continuation.
            cache = DynamicCache(config=core.config)
            extra = {"mm_token_type_ids": prompt_types[:, :-1]} if prompt_types is not None else {}
            nothing = torch.full_like(prompt_ids[:, :-1], -100)  # no label: the prompt's log-probs are not needed
            anchor = model(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                           position_ids=positions[..., :-1], shift_labels=nothing, fused_lm_head=True,
                           **{cache_name: cache}, **vision, **extra).log_probs.sum() * 0  # fmt: skip
            if anchor.requires_grad and not _carries_gradients(cache):
                # A checkpoint that runs the layers without gradients (reentrant, however it was applied) detached
                # the prompt's state: the prompt's layers would get no gradient through it, silently.
                raise SharedPrefixUnsupported(
                    "the prompt's cache came out of its layers without gradients (reentrant activation "
                    "checkpointing?): non-reentrant checkpointing takes this path"
                )
            continued = _continuation_cache(cache, index, core.config)
            _emptied_for_recompute(cache, core.config)
            # Each completion: [p, c_1 .. c_{T-1}] after its group's prompt state, predicting [c_1 .. c_T].
            completion_mask = attention_mask[rows, prompt_len:]
            step = torch.arange(logits_to_keep - 1, device=input_ids.device)
            first = positions[..., -1:].index_select(-2, index)
            rest = start.index_select(0, index)[:, None] + step[None]
            positions = torch.cat([first, rest.expand(first.shape[:-1] + rest.shape[-1:])], dim=-1)
            last = input_ids[rows, prompt_len - 1 : prompt_len]
            continuation = torch.cat([last, input_ids[rows, prompt_len:-1]], -1)
            mask = torch.cat([prompt_mask[index, :-1], torch.ones_like(index)[:, None], completion_mask[:, :-1]], -1)
            labels = torch.where(completion_mask > 0, input_ids[rows, prompt_len:], -100)
            out = model(input_ids=continuation, attention_mask=mask, position_ids=positions, shift_labels=labels,
                        fused_lm_head=True, **{cache_name: continued})  # fmt: skip
            results.append((rows, out.log_probs + anchor, out.entropy if compute_entropy else None))
    for rows, chunk_logps, chunk_entropies in results:
        logps = logps.index_put((rows,), chunk_logps)
        if compute_entropy:
            entropies = entropies.index_put((rows,), chunk_entropies)
    return logps, entropies

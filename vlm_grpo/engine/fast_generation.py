"""Fast rollouts: one prefill per prompt group, a static KV cache and a compiled decode step.

TRL repeats every prompt `num_generations` times and hands the whole batch to `model.generate`, with
compilation disabled: each decode step launches hundreds of small kernels from Python (~85 ms per token
for a 3B VLM on an H100, where reading the weights takes ~2.5 ms). `FastGenerator` keeps transformers'
model, its logits processors (temperature, top-k/p, min-p, repetition penalty, suppressed image tokens,
min_new_tokens) and its position rules, and changes four things:

1. Identical prompts (same token ids, same image pixels) are prefilled once: the vision tower and the
   prompt run on the unique rows and the KV cache is copied to every completion of the group.
2. Decoding writes into a `StaticCache` whose length is rounded up to `cache_bucket` tokens, and the
   one-token forward is compiled (Inductor) and recorded as one CUDA graph (`engine.decode_graph`), so a run
   compiles once per (batch size, cache bucket) and a token costs one graph launch. The q/k/v projections run as
   one GEMM over stacked merged weights (`engine.fused_projections`), and grouped-query attention reads the cache
   in place (`engine.decode_attention`).
3. Optionally, LoRA is merged into the base weights while generating (one matmul per projection instead
   of three) and the original weights are copied back afterwards, bit for bit.
4. bitsandbytes 4-bit / 8-bit layers, which cannot be compiled, are replaced for the call by plain stand-ins
   (`vlm_grpo.engine.quantized_generation`), so QLoRA models take this path too.

Everything else (EOS and pad handling, the mask after EOS) is what `generate` does, so the plain path and
this one give the same tokens under greedy decoding and the same per-token distributions when sampling.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..compat import cache_kwarg
from ..families import core_model
from ..integrations.unsloth import uses_unsloth
from ..private_api import (
    can_generate_fast,
    eos_tokens,
    generation_position_ids,
    logits_processors,
    prepare_generation,
)
from ..videos import Clip
from .batch_layout import ImageLayout, LayoutUnknown, as_tensors, group_rows, select_rows
from .decode_attention import decode_attention
from .decode_graph import DecodeGraphs, RecordingFailed
from .fused_projections import FusedQKV, merges_as_a_delta
from .quantized_generation import (
    QuantizedGenerationUnsupported,
    QuantizedLayers,
    describe,
    has_quantized_layers,
    is_quantized_linear,
)

__all__ = [
    "CUDA_GRAPHS",
    "MERGE_BACKUPS",
    "BaseWeightBackup",
    "FastGenerator",
    "FastPathUnavailable",
    "group_prompts",
    "merged_lora",
]

logger = logging.getLogger(__name__)


class FastPathUnavailable(RuntimeError):
    """Raised before any work is done when a batch cannot use the fast path; the caller uses the plain one."""


def group_prompts(
    prompt_ids: Sequence[Sequence[int]],
    images_per_row: Sequence[int],
    fields: dict[str, Any],
    videos_per_row: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Find identical prompts: the same token ids and pixel-identical images and clips (`batch_layout.group_rows`).

    Returns `(unique, inverse)`: the batch index of each distinct prompt's first row, and for every row the
    position of its prompt in `unique`, so `unique[inverse[i]]` is a row identical to row `i`.

    >>> group_prompts([[1, 2], [1, 2], [3]], [0, 0, 0], {})
    ([0, 2], [0, 0, 1])
    """
    fields = as_tensors(fields)
    layout = ImageLayout.of(fields, images_per_row, videos_per_row)
    groups = group_rows([tuple(ids) for ids in prompt_ids], layout, fields)
    inverse = [0] * len(prompt_ids)
    for position, group in enumerate(groups):
        for row in group:
            inverse[row] = position
    return [group[0] for group in groups], inverse


MERGE_BACKUPS = ("auto", "device", "host")
CUDA_GRAPHS = ("recorded", "compiler")  # FastGenerator.cuda_graph
# "auto" keeps the backup in host memory when all local processes' copies take at most this share of the host's
# available memory.
HOST_SHARE = 0.5


def choose_backup(needed_bytes: int, device: torch.device) -> tuple[str, str]:
    """`("device" | "host", why)`: where "auto" keeps the base weights while LoRA is merged into them.

    Host memory when the weights are on a GPU and every local process's copy fits in `HOST_SHARE` of the host's
    available memory (the same speed in `benchmarks/grpo_step.py`, one copy of the adapted weights less on the GPU);
    otherwise on the device.
    """
    if device.type != "cuda":
        return "device", "the weights are not on a GPU"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _host_available_bytes()
    gib = 2**30
    why = (f"{processes} x {needed_bytes / gib:.1f} GiB of base weights; {available / gib:.1f} GiB of host memory "
           "available")  # fmt: skip
    return ("host" if processes * needed_bytes <= HOST_SHARE * available else "device"), why


def _host_available_bytes() -> int:
    """The host memory available to new allocations (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class BaseWeightBackup:
    """Copies of the base weights LoRA is merged into, so `merged_lora` can restore them bit for bit.

    `where="device"`: a fresh copy beside each weight for every merge (one extra copy of the adapted weights in GPU
    memory while generating). `where="host"`: one copy in pinned CPU memory, kept across generations and refreshed
    only when a weight changed since it was restored (its in-place version counter moved, or its storage was
    replaced): LoRA's base weights are frozen, so after the first generation the cost is one host-to-device copy per
    generation and no GPU memory. `where="auto"`: `choose_backup` decides on the first merge (logged).
    """

    def __init__(self, where: str = "auto") -> None:
        if where not in MERGE_BACKUPS:
            raise ValueError(f"merge backup must be one of {', '.join(MERGE_BACKUPS)}, got {where!r}")
        self.setting = where
        self.where = None if where == "auto" else where
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_refreshes = 0  # weights copied to the host (the first generation, then only changed ones)

    def resolve(self, weights: Sequence[torch.Tensor]) -> str:
        """Settle "auto" for these weights (once; later calls keep the choice) and return where they are kept."""
        if self.where is None:
            needed = sum(w.numel() * w.element_size() for w in weights)
            self.where, why = choose_backup(needed, weights[0].device)
            logger.info("LoRA merged for generation: base weights kept on the %s (%s). Set "
                        "fast_generation_merge_backup to force one.", self.where, why)  # fmt: skip
        return self.where

    def save(self, weight: torch.Tensor) -> None:
        """Remember `weight` as it is now (call before merging into it)."""
        if self.where == "device":
            self._saved.append((weight, weight.detach().clone()))
            return
        entry = self._host.get(id(weight))
        if entry is None or entry[0] is not weight or entry[2] != weight._version or entry[3] != weight.data_ptr():
            pin = weight.device.type == "cuda"
            copy = torch.empty(weight.shape, dtype=weight.dtype, device="cpu", pin_memory=pin)
            copy.copy_(weight.detach())
            entry = (weight, copy, weight._version, weight.data_ptr())
            self.host_refreshes += 1
        self._host[id(weight)] = entry
        self._saved.append((weight, entry[1]))

    def restore(self) -> None:
        """Copy every saved weight back, and note its version so an untouched weight keeps its host copy.

        The copies are queued on the current stream and the host does not wait for them: the next kernel that reads
        a weight runs after its copy, and a host copy is only rewritten (`save`) by a copy queued behind them, so the
        CPU goes on to decode the completions and score the rewards while the weights come back.
        """
        for weight, original in self._saved:
            weight.copy_(original, non_blocking=True)
            if self.where == "host":
                self._host[id(weight)] = (weight, original, weight._version, weight.data_ptr())
        self._saved = []


@contextlib.contextmanager
def merged_lora(
    model: nn.Module, backup: BaseWeightBackup | None = None, elsewhere: set[int] = frozenset()
) -> Iterator[bool]:
    """Merge the active LoRA adapters into the base weights for the duration of the block.

    Yields True when merged (the adapters are disabled inside the block, the merged weights do their work),
    False when the model cannot be merged exactly (DoRA, a non-linear base, no 16-bit LoRA), in which case nothing
    changes. The base weights are saved before merging (`backup`: on the device by default, or in host memory) and
    copied back after, so they come back bit-identical (a bf16 merge followed by an unmerge would round).
    Layers whose `id` is in `elsewhere` are left as they are: their merged weights are kept elsewhere
    (`engine.fused_projections`), and the layers themselves are swapped out while generating.
    """
    # Quantised (bitsandbytes) bases are left out: `vlm_grpo.engine.quantized_generation` swaps them for plain layers with
    # their adapters applied while generating, so disabling their adapters here changes nothing.
    layers = [
        m
        for m in model.modules()
        if hasattr(m, "lora_A") and hasattr(m, "get_base_layer") and not is_quantized_linear(m.get_base_layer())
    ]
    if (
        not layers
        or not hasattr(model, "disable_adapter")
        or not all(merges_as_a_delta(layer) for layer in layers)
        or any(layer.merged for layer in layers)  # PEFT merged an adapter itself (`merge_adapter`): its state, not ours
    ):
        yield False
        return
    backup = backup if backup is not None else BaseWeightBackup("device")
    merges = []
    for layer in layers:
        active = [name for name in layer.active_adapters if name in layer.lora_A]
        if active and not layer.disable_adapters and id(layer) not in elsewhere:
            merges.append((layer, layer.get_base_layer().weight, active))
    if merges:
        backup.resolve([weight for _, weight, _ in merges])
    with torch.no_grad():
        for layer, weight, active in merges:
            backup.save(weight)
            for name in active:  # W += scaling * (B @ A): PEFT's delta for a Linear base, in one kernel
                lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
                weight.addmm_(lora_b.to(weight.dtype), lora_a.to(weight.dtype), alpha=layer.scaling[name])
    # The merged layers' adapters are off inside the block, each layer's own flag set and put back. PEFT's
    # `disable_adapter()` would walk the whole model twice and reset every adapter's requires_grad (unfreezing any
    # the user froze): ~90 ms a call for a 3B VLM's 414 LoRA layers, most of the merge's cost.
    merged_layers = [layer for layer, _, _ in merges]
    try:
        for layer in merged_layers:
            layer._disable_adapters = True
        yield True
    finally:
        for layer in merged_layers:
            layer._disable_adapters = False
        with torch.no_grad():
            backup.restore()


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


@dataclass
class FastGenerator:
    """Generates TRL's completions with one prefill per prompt group and a compiled static-cache decode loop.

    Args:
        compile: compile the decode step (a CUDA graph); None: on CUDA only (compiling on CPU costs more than
            it saves for the tiny models used there).
        merge_lora: merge LoRA into the 16-bit base weights while generating (exactly restored afterwards).
        merge_backup: where the base weights are kept while merged: "device" (a copy in GPU memory), "host" (pinned
            CPU memory, made once; one host-to-device copy per generation) or "auto" (`choose_backup`).
        grouped_attention: decode with `engine.decode_attention` (grouped-query heads read the KV cache in place).
        quantized: how bitsandbytes 4-bit / 8-bit layers generate ("auto", "copy" or "light"; see
            `vlm_grpo.engine.quantized_generation`): plain stand-ins, so the decode step compiles like a 16-bit model's.
        cache_bucket: the static cache length is rounded up to a multiple of this, so prompts of different
            lengths reuse one compiled graph.
        cuda_graph: how the compiled decode step becomes a CUDA graph: "recorded" (`engine.decode_graph`: recorded
            once per batch shape and replayed, one launch per token) or "compiler" (`torch.compile`'s
            reduce-overhead mode, which runs its guards and address checks at every token).
        fused_qkv: with `merge_lora`, each decoder attention layer's q, k and v projections run as one GEMM over a
            stacked copy of their merged weights (`engine.fused_projections`).
    """

    compile: bool | None = None
    merge_lora: bool = True
    merge_backup: str = "auto"
    quantized: str = "auto"
    grouped_attention: bool = True
    cache_bucket: int = 256
    cuda_graph: str = "recorded"
    fused_qkv: bool = True
    stats: dict[str, int] = field(default_factory=lambda: {"calls": 0, "rows": 0, "prefill_rows": 0, "decode_steps": 0})
    _caches: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    _compiled_call: Any = field(default=None, repr=False)
    _compiled_mode: str | None = field(default=None, repr=False)
    _graphs: DecodeGraphs = field(default_factory=DecodeGraphs, repr=False)
    _quantized_layers: QuantizedLayers | None = field(default=None, repr=False)
    _quantized_model: int | None = field(default=None, repr=False)
    _backup: BaseWeightBackup | None = field(default=None, repr=False)
    _fused: FusedQKV | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.cuda_graph not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graph must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graph!r}")

    def backup(self) -> BaseWeightBackup:
        """The base-weight backup `merged_lora` uses (one per generator, so a host copy outlives a generation)."""
        if self._backup is None or self._backup.setting != self.merge_backup:
            self._backup = BaseWeightBackup(self.merge_backup)
        return self._backup

    def unsupported_reason(self, model: nn.Module) -> str | None:
        """Why this model cannot use the fast path (None when it can)."""
        base = core_model(model)
        if getattr(base.config, "is_encoder_decoder", False):
            return "encoder-decoder models are not supported"
        if not can_generate_fast(base):
            return "this transformers version lacks the generation helpers the fast path reuses"
        quantizer = getattr(base, "hf_quantizer", None)
        if (
            quantizer is not None
            and not has_quantized_layers(base)  # bitsandbytes layers generate through plain stand-ins
            and self._compile_on(base)
            and not quantizer.is_compileable
        ):
            return f"{type(quantizer).__name__} weights cannot be compiled"
        return None

    def quantized_layers(self, model: nn.Module) -> QuantizedLayers | None:
        """The stand-ins for `model`'s quantised layers (built on the first generation; None without any)."""
        if self._quantized_model != id(model):
            self._quantized_model = id(model)
            self._quantized_layers = QuantizedLayers(model, self.quantized) if has_quantized_layers(model) else None
        return self._quantized_layers

    def fused_projections(self, model: nn.Module) -> FusedQKV | None:
        """The stacked q/k/v weights for `model` (built on the first generation, rebuilt if its layers changed; None
        when `fused_qkv` or `merge_lora` is off, or no layer qualifies)."""
        # Unsloth's patched attention reads its projections' LoRA attributes directly: they stay as they are there.
        if not (self.fused_qkv and self.merge_lora) or uses_unsloth(model):
            return None
        if self._fused is None or not self._fused.matches(model):
            self._fused = FusedQKV(model)
        return self._fused if self._fused.sites else None

    def describe_quantized(self) -> dict[str, Any]:
        """How quantised layers generate: mode, layers replaced, GiB of copies held (empty without any)."""
        return describe(self._quantized_layers)

    def _compile_on(self, model: nn.Module) -> bool:
        return self.compile if self.compile is not None else next(model.parameters()).device.type == "cuda"

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        images: Sequence[Any] | None,
        multimodal_fields: dict[str, Any],
        generation_config: Any,
        pad_token_id: int,
    ) -> list[list[int]]:
        """Complete every prompt; returns each row's completion ids up to and including its first EOS.

        `prompt_ids`, `images` and `multimodal_fields` are what TRL's `_tokenize_prompts` returns (for a batch with
        clips, the trainer's: each row's images and clips in `images`); `generation_config` is the trainer's (TRL's
        sampling settings).
        """
        base = core_model(model)
        device = next(base.parameters()).device
        media = [list(row or []) for row in images] if images is not None else [[] for _ in prompt_ids]
        videos_per_row = [sum(isinstance(item, Clip) for item in row) for row in media]
        images_per_row = [len(row) - clips for row, clips in zip(media, videos_per_row)]
        try:  # the groups, and the processor outputs of each group's first row
            unique, inverse = group_prompts(prompt_ids, images_per_row, multimodal_fields, videos_per_row)
            unique_fields = select_rows(multimodal_fields, images_per_row, unique, videos_per_row)
        except LayoutUnknown as error:
            raise FastPathUnavailable(str(error)) from error
        try:
            quantized = self.quantized_layers(model)
            swapped = quantized.swapped() if quantized is not None else contextlib.nullcontext()
            fused = self.fused_projections(model)
            elsewhere = fused.covers() if fused is not None else frozenset()
            merged = merged_lora(model, self.backup(), elsewhere) if self.merge_lora else contextlib.nullcontext(False)
            with swapped, merged:  # stand-ins first: they read the adapters before `merged_lora` disables them
                if fused is not None:
                    fused.fill()
                with fused.swapped() if fused is not None else contextlib.nullcontext():
                    rows = self._generate(base, device, prompt_ids, unique, inverse, unique_fields, generation_config,
                                          pad_token_id)  # fmt: skip
        except QuantizedGenerationUnsupported as error:  # raised before anything was swapped or generated
            raise FastPathUnavailable(str(error)) from error
        self.stats["calls"] += 1
        self.stats["rows"] += len(prompt_ids)
        self.stats["prefill_rows"] += len(unique)
        return rows

    def _generate(self, model, device, prompt_ids, unique, inverse, unique_fields, generation_config, pad_id):
        from transformers import DynamicCache

        config, model_kwargs = prepare_generation(model, generation_config, device)
        eos = eos_tokens(config)
        max_new = config.max_new_tokens
        unsupported = {  # generate features this loop does not implement: those calls take the plain path
            "num_beams > 1": (config.num_beams or 1) > 1,
            "stop_strings": bool(getattr(config, "stop_strings", None)),
            "num_return_sequences > 1": (config.num_return_sequences or 1) > 1,
            "max_new_tokens unset": not max_new,
        }
        if any(unsupported.values()):
            raise FastPathUnavailable(f"generation setting {next(k for k, v in unsupported.items() if v)}")
        batch = len(prompt_ids)

        # Left-padded unique prompts, and their multimodal fields.
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(unique), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(unique), width), dtype=torch.long)
        for i, row in enumerate(unique):
            ids = prompt_ids[row]
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        for key, value in unique_fields.items():
            if isinstance(value, torch.Tensor):
                kwargs[key] = value.to(device)
            else:  # per-token lists (mm_token_type_ids / token_type_ids): left-padded like the ids
                padded = torch.zeros((len(unique), width), dtype=torch.long)
                for i, tokens in enumerate(value):
                    padded[i, width - len(tokens) :] = torch.tensor(tokens)
                kwargs[key] = padded.to(device)
        # The position ids `generate` would use (Qwen's 3-D rotary positions included), computed by the model.
        positions = generation_position_ids(model, input_ids, kwargs)

        cache_len = -(-(width + max_new) // self.cache_bucket) * self.cache_bucket
        text_config = _text_config(model)
        window = getattr(text_config, "sliding_window", None)
        sliding = window is not None and "sliding_attention" in (getattr(text_config, "layer_types", None) or [])
        if sliding and width + max_new >= window:  # the copied prefill would have to roll inside the window
            raise FastPathUnavailable(
                f"prompt + completion ({width} + {max_new} tokens) exceeds the sliding window ({window})"
            )

        # Prefill the unique prompts, then copy their KV cache to every row of their group. (The profiler labels
        # name the phases in `benchmarks/decode_profile.py`; without a profiler running they cost microseconds.)
        with record_function("fast_generation.prefill"):
            prefill_cache = DynamicCache(config=model.config)
            kwargs[cache_kwarg(model)] = prefill_cache
            out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs)
            index = torch.tensor(inverse, device=device)
            cache = self._static_cache(model, batch, cache_len)
            for layer_index, layer in enumerate(prefill_cache.layers):
                cache.update(layer.keys.index_select(0, index), layer.values.index_select(0, index), layer_index)
            del prefill_cache

        full_mask = torch.zeros((batch, cache_len), dtype=torch.long, device=device)
        full_mask[:, :width] = attention_mask.index_select(0, index)
        tokens = torch.full((batch, width + max_new), pad_id, dtype=torch.long, device=device)
        tokens[:, :width] = input_ids.index_select(0, index)
        position = positions.index_select(-2, index)[..., -1:]  # last prompt position of every row
        processors = logits_processors(model, config, tokens[:, :width], device, model_kwargs)
        forward = self._decode_fn(model, cache)
        slot = torch.tensor([width - 1], device=device)  # the cache slot the next token is written to, minus one

        logits = out.logits[:, -1].to(dtype=torch.float32).index_select(0, index)
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        steps = 0
        # Grouped-query heads attend to the cache as it is (`engine.decode_attention`), not to a per-head copy.
        with decode_attention(model) if self.grouped_attention else contextlib.nullcontext():
            for step in range(max_new):
                with record_function("fast_generation.sample"):
                    scores = processors(tokens[:, : width + step], logits)
                    if config.do_sample:
                        next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                    else:
                        next_tokens = scores.argmax(dim=-1)
                    next_tokens = torch.where(unfinished, next_tokens, pad_id)
                    tokens[:, width + step] = next_tokens
                    unfinished &= ~torch.isin(next_tokens, eos)
                steps = step + 1
                if step + 1 == max_new or (step % 8 == 7 and not bool(unfinished.any())):
                    break
                full_mask[:, width + step] = 1
                position = position + 1
                slot = slot + 1  # stays on the device: no host-to-device copy per step
                with record_function("fast_generation.forward"):
                    logits = forward(next_tokens[:, None], position, slot, full_mask, cache)
        self.stats["decode_steps"] += steps

        completions = tokens[:, width : width + steps]
        is_eos = torch.isin(completions, eos)
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])
        return [row[: end + 1].tolist() for row, end in zip(completions.cpu(), first.cpu().tolist())]

    def _static_cache(self, model: nn.Module, batch: int, cache_len: int) -> Any:
        """An empty static cache for (batch, cache_len), reused across calls: a CUDA graph replays only on the
        same buffer addresses, so a fresh cache per call would re-record the graph every step."""
        from transformers import StaticCache

        cache = self._caches.get((batch, cache_len))
        if cache is None:
            for old in list(self._caches)[:-1]:  # keep at most two shapes alive (train and eval batches)
                del self._caches[old]
            cache = self._caches[(batch, cache_len)] = StaticCache(config=model.config, max_cache_len=cache_len)
        else:
            cache.reset()
        return cache

    def _decode_fn(self, model: nn.Module, cache: Any):
        """One decode step: `(tokens [B,1], positions, cache slot [1], mask [B, cache_len], cache) -> logits [B, V]`
        (float32; with recorded CUDA graphs, a buffer the next step overwrites)."""
        cache_name = cache_kwarg(model)  # `cache` (transformers >= 5.2x) or `past_key_values`
        compiled = self._compile_on(model)
        # Recorded on one GPU only: a model split over several (device_map) has kernels a recording would not see.
        devices = {p.device for p in model.parameters()}
        recorded = compiled and self.cuda_graph == "recorded" and len(devices) == 1 and devices.pop().type == "cuda"
        call = model.__call__
        if compiled:
            # One compiled callable per model; torch.compile keeps one graph per (batch, cache length). Recorded
            # graphs need Inductor's kernels without the compiler's own CUDA graphs.
            mode = "default" if recorded else "reduce-overhead"
            if self._compiled_call is None or self._compiled_mode != mode:
                self._compiled_call, self._compiled_mode = torch.compile(model.__call__, mode=mode, dynamic=False), mode
            call = self._compiled_call

        def forward(next_tokens, position, slot, mask, cache):
            out = call(input_ids=next_tokens, position_ids=position, attention_mask=mask, cache_position=slot,
                       use_cache=True, logits_to_keep=1, **{cache_name: cache})  # fmt: skip
            # Copy: a CUDA graph overwrites its outputs on the next replay.
            return out.logits[:, -1].to(dtype=torch.float32, copy=True)

        if recorded:
            self._graphs.begin(model, cache)

        def step(next_tokens, position, slot, mask, cache):
            if recorded and self.cuda_graph == "recorded":
                try:
                    return self._graphs.step(forward, next_tokens, position, slot, mask, cache)
                except RecordingFailed as error:  # this step runs compiled without a graph, later calls on the trees
                    logger.warning("%s; decoding with torch.compile's CUDA graphs instead (cuda_graph='compiler').",
                                   error)  # fmt: skip
                    self.cuda_graph = "compiler"
                    self._graphs.clear()
            elif compiled:
                torch.compiler.cudagraph_mark_step_begin()
            return forward(next_tokens, position, slot, mask, cache)

        return step

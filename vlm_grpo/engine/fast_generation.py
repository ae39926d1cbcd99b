"""Fast rollouts: one prefill per prompt group, a static KV cache and a compiled decode step.

TRL repeats every prompt `num_generations` times and hands the whole batch to `model.generate`, with
compilation disabled: each decode step launches hundreds of small kernels from Python (~85 ms per token
for a 3B VLM on an H100, where reading the weights takes ~2.5 ms). `FastGenerator` keeps transformers'
model, its logits processors (temperature, top-k/p, min-p, repetition penalty, suppressed image tokens,
min_new_tokens) and its position rules, and changes four things:

1. Identical prompts (same token ids, same image pixels) are prefilled once, their cache copied to every completion.
2. Decoding writes into a `StaticCache` whose length is rounded up to `cache_bucket` tokens, and the
   one-token forward is compiled (Inductor) and recorded as one CUDA graph (`engine.decode_graph`), so a run
   compiles once per (batch size, cache bucket) and a token costs one graph launch. The q/k/v projections run as
   one GEMM over stacked merged weights (`engine.fused_projections`), and grouped-query attention reads the cache
   in place (`engine.decode_attention`).
3. Optionally, LoRA is merged into the base weights while generating (one matmul per projection, not three), the
   originals copied back after, bit for bit (`engine.lora_merge`; the copies can overlap the next forward).
4. bitsandbytes 4-bit / 8-bit layers, which cannot be compiled, are replaced for the call by plain stand-ins
   (`engine.quantized_generation`): QLoRA models take this path too.

Everything else (EOS and pad handling, the mask after EOS) is what `generate` does: the same tokens under greedy
decoding and the same per-token distributions when sampling as the plain path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..compat import cache_kwarg
from ..families import core_model
from ..integrations.unsloth import uses_unsloth
from ..media.batch_layout import LayoutUnknown, group_prompts, select_rows
from ..media.clips import Clip
from ..private_api import can_generate_fast, eos_tokens, logits_processors, prepare_generation
from .cache_kinds import UnservableCache, copy_prefill
from .decode_attention import decode_attention
from .decode_cache import DecodeCaches
from .decode_graph import DecodeGraphs, RecordingFailed
from .fused_projections import FusedQKV
from .lora_merge import MERGE_BACKUPS, BaseWeightBackup, merged_lora
from .prefill import TurnCache, full_prefill
from .quantized_generation import QuantizedGenerationUnsupported, QuantizedLayers, describe, has_quantized_layers
from .regional_decode import DecodeCompiler
from .token_loop import DecodeBuffers, Sampler, on_device

__all__ = ["CUDA_GRAPHS", "MERGE_BACKUPS", "BaseWeightBackup", "FastGenerator", "FastPathUnavailable", "group_prompts",
           "merged_lora"]  # fmt: skip

logger = logging.getLogger(__name__)


class FastPathUnavailable(RuntimeError):
    """Raised before any work is done when a batch cannot use the fast path; the caller uses the plain one."""


CUDA_GRAPHS = ("recorded", "compiler", "off")  # FastGenerator.cuda_graph
STATS = ("calls", "rows", "prefill_rows", "decode_steps", "prefill_tokens", "appended_rows")  # FastGenerator.stats


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
            once per batch shape and replayed, one launch per token), "compiler" (`torch.compile`'s
            reduce-overhead mode, which runs its guards and address checks at every token) or "off" (the recording's
            compiled kernels launched one by one: slower, for telling a recording's fault from a kernel's).
        fused_qkv: with `merge_lora`, each decoder attention layer's q, k and v projections run as one GEMM over a
            stacked copy of their merged weights (`engine.fused_projections`).
        sample_in_graph: with recorded CUDA graphs and logits processors that read only the scores (temperature,
            top-k/p, min-p, suppressed tokens), record the sampling with the forward (`engine.token_loop`): one launch
            per token and no host work between tokens.
        overlap_restore: when the caller allows it (`generate(defer_restore=True)`), copy the base weights back
            from the host while the next forward runs rather than before it.
        append_turns: a row that extends a row of the previous call (a tool turn) prefills only its new tokens on that
            call's cache (`engine.prefill.TurnCache`), where the model's cache allows it.
        turn_headroom: cache slots beyond a call's need, for a tool rollout's later turns (TRL's completion budget):
            every turn then decodes in the first turn's cache, compiled and recorded once, not once per turn.
        regional_compile: with recorded CUDA graphs (or on CPU), compile the decode step one decoder layer at a time,
            one graph for all layers (`engine.regional_decode`: a first step in seconds, not a minute).
        keep_decode_memory: keep the static caches, their recorded graphs and the stacked q/k/v weights from one call
            to the next (recorded once); False frees them after every call (with `append_turns`, the caller calls
            `release` after a rollout's last turn), for the scoring and training that follow (Qwen3.5-4B at 2 x 8:
            ~1.4 GiB by their shapes), and records again at the next call.
    """

    compile: bool | None = None
    merge_lora: bool = True
    merge_backup: str = "auto"
    quantized: str = "auto"
    grouped_attention: bool = True
    cache_bucket: int = 256
    cuda_graph: str = "recorded"
    fused_qkv: bool = True
    sample_in_graph: bool = True
    overlap_restore: bool = True
    append_turns: bool = True
    turn_headroom: int = 0
    regional_compile: bool = True
    keep_decode_memory: bool = True
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))
    _compiler: DecodeCompiler = field(default_factory=DecodeCompiler, repr=False)
    _graphs: DecodeGraphs = field(default_factory=DecodeGraphs, repr=False)
    _decode_caches: DecodeCaches = field(default=None, repr=False)  # built with the graphs it tells of dropped caches
    _quantized_layers: QuantizedLayers | None = field(default=None, repr=False)
    _quantized_model: int | None = field(default=None, repr=False)
    _backup: BaseWeightBackup | None = field(default=None, repr=False)
    _fused: FusedQKV | None = field(default=None, repr=False)
    _kept_sampler: Sampler | None = field(default=None, repr=False)
    turns: TurnCache = field(default_factory=TurnCache, repr=False)  # `append_turns`' cache of the last call

    def __post_init__(self) -> None:
        self._decode_caches = DecodeCaches(self._graphs)
        if self.cuda_graph not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graph must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graph!r}")

    def backup(self) -> BaseWeightBackup:
        """The base-weight backup `merged_lora` uses (one per generator, so a host copy outlives a generation)."""
        if self._backup is None or self._backup.setting != self.merge_backup:
            if self._backup is not None:
                self._backup.wait()  # its deferred copies land before another backup saves those weights
            self._backup = BaseWeightBackup(self.merge_backup)
        return self._backup

    def finish_restore(self) -> None:
        """Make the current stream wait for base weights still being copied back (`generate(defer_restore=True)`)."""
        if self._backup is not None:
            self._backup.wait()

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
        """The stacked q/k/v weights for `model` (built on first use or when its layers changed; None when
        `fused_qkv` or `merge_lora` is off, or no layer qualifies)."""
        # Unsloth's patched attention reads its projections' LoRA attributes directly: they stay as they are there.
        if not (self.fused_qkv and self.merge_lora) or uses_unsloth(model):
            return None
        if self._fused is None or not self._fused.matches(model):
            self._fused = FusedQKV(model)
        return self._fused if self._fused.sites else None

    def release(self) -> None:
        """Free what decoding keeps between calls (caches, their recordings, the stacked q/k/v, the last turn's cache):
        the next call allocates and records them again (`keep_decode_memory=False`)."""
        self._decode_caches.clear()
        self._fused = self._kept_sampler = None
        self.turns.forget()

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
        defer_restore: bool = False,
        return_logprobs: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """Complete every prompt; returns each row's completion ids up to and including its first EOS (with
        `return_logprobs`, also the sampler's log-prob of each of those tokens: over the processed scores, so the
        temperature, suppressed ids and top-k/p included).

        `prompt_ids`, `images` and `multimodal_fields` are what TRL's `_tokenize_prompts` returns (for a batch with
        clips, the trainer's: each row's images and clips in `images`); `generation_config` is the trainer's (TRL's
        sampling settings). `defer_restore` (with `overlap_restore`): the base weights merged into come back from the
        host while the model's next forward runs (`engine.lora_merge.DeferredRestore`); the caller keeps the weights
        where they are and calls `finish_restore()` before anything but a forward reads them.
        """
        base = core_model(model)
        device = next(base.parameters()).device
        media = [list(row or []) for row in images] if images is not None else [[] for _ in prompt_ids]
        videos_per_row = [sum(isinstance(item, Clip) for item in row) for row in media]
        images_per_row = [len(row) - clips for row, clips in zip(media, videos_per_row)]
        media_counts = (images_per_row, videos_per_row)
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
            defer = defer_restore and self.overlap_restore
            merged = (
                merged_lora(model, self.backup(), elsewhere, defer_restore=defer)
                if self.merge_lora
                else contextlib.nullcontext(False)
            )
            with swapped, merged:  # stand-ins first: they read the adapters before `merged_lora` disables them
                if fused is not None:
                    fused.fill()
                with fused.swapped() if fused is not None else contextlib.nullcontext():
                    rows, logprobs = self._generate(base, device, prompt_ids, unique, inverse, unique_fields,
                                                    generation_config, pad_token_id, media_counts)  # fmt: skip
        except (QuantizedGenerationUnsupported, UnservableCache) as error:  # nothing generated; weights restored
            raise FastPathUnavailable(str(error)) from error
        finally:  # (freed in stream order: a graph still replaying is destroyed when it completes)
            if not (self.keep_decode_memory or self.append_turns):  # a tool rollout's turns: its caller frees after
                self.release()
        self.stats["calls"] += 1
        self.stats["rows"] += len(prompt_ids)
        self.stats["prefill_rows"] += len(unique)
        return (rows, logprobs) if return_logprobs else rows

    def _generate(self, model, device, prompt_ids, unique, inverse, unique_fields, generation_config, pad_id, media):
        config, model_kwargs = prepare_generation(model, generation_config, device)
        eos = eos_tokens(config)
        max_new = config.max_new_tokens
        unsupported = {  # generate features this loop does not implement: those calls take the plain path
            "num_beams > 1": (config.num_beams or 1) > 1, "max_new_tokens unset": not max_new,
            "num_return_sequences > 1": (config.num_return_sequences or 1) > 1,
            "stop_strings": bool(getattr(config, "stop_strings", None)),
            "max_time": getattr(config, "max_time", None) is not None,  # generate stops every row at that time
        }  # fmt: skip
        if any(unsupported.values()):
            raise FastPathUnavailable(f"generation setting {next(k for k, v in unsupported.items() if v)}")
        batch = len(prompt_ids)

        width = max(len(ids) for ids in prompt_ids)
        cache_len = self._decode_caches.fitting_length(batch, width + max_new, self.cache_bucket, self.turn_headroom)
        text_config = _text_config(model)
        window = getattr(text_config, "sliding_window", None)
        sliding = window is not None and "sliding_attention" in (getattr(text_config, "layer_types", None) or [])
        if sliding and width + max_new >= window:  # the copied prefill would have to roll inside the window
            raise FastPathUnavailable(
                f"prompt + completion ({width} + {max_new} tokens) exceeds the sliding window ({window})"
            )

        # Prefill each distinct prompt (a tool turn's rows: what they append to the last call's cache), then copy its
        # KV cache to every row of its group (the profiler labels: `benchmarks/decode_profile.py`).
        with record_function("fast_generation.prefill"):
            rows, counts = [prompt_ids[row] for row in unique], [[per_row[r] for r in unique] for per_row in media]
            turn = self.turns.prefill if self.append_turns else lambda *args: None
            done = turn(model, rows, unique_fields, *counts, pad_id, device)
            if done is not None:
                self.stats["appended_rows"] += len(unique)
            else:
                done = full_prefill(model, rows, unique_fields, width, pad_id, device)
            self.stats["prefill_tokens"] += done.prefilled_tokens
            index = torch.tensor(inverse, device=device)
            cache = self._decode_caches.get(model, batch, cache_len)
            copy_prefill(done.cache, cache, index)
            done.cache = None  # the prefill's own cache freed before decoding

        # Every tensor the loop reads or writes lives in buffers that outlive the generation (`engine.token_loop`),
        # so a recorded step replays on the same addresses with nothing copied in.
        position = done.positions.index_select(-2, index)[..., -1:]  # last prompt position of every row
        buffers = self._decode_caches.buffers(batch, cache_len, tuple(position.shape), device)
        first = done.input_ids.index_select(0, index), done.attention_mask.index_select(0, index)
        buffers.start(*first, position, pad_id)
        processors = on_device(logits_processors(model, config, buffers.tokens[:, :width], device, model_kwargs), width)
        sampler = self._sampler(Sampler(processors, bool(config.do_sample), eos, pad_id))
        step = self._decode_fn(model, cache, buffers, sampler)

        with record_function("fast_generation.sample"):
            sampler.sample(buffers, done.logits.float().index_select(0, index), buffers.tokens[:, :width])
        steps = 1
        # Grouped-query heads attend to the cache as it is (`engine.decode_attention`), not to a per-head copy.
        with decode_attention(model) if self.grouped_attention else contextlib.nullcontext():
            for index_of_token in range(1, max_new):
                if index_of_token % 8 == 0 and not bool(buffers.unfinished.any()):  # one host sync per 8 tokens
                    break
                with record_function("fast_generation.forward"):
                    logits = step()
                if logits is not None:  # sampling outside the recorded step (processors that read the ids)
                    with record_function("fast_generation.sample"):
                        sampler.sample(buffers, logits, buffers.tokens[:, : width + index_of_token])
                steps = index_of_token + 1
        self.stats["decode_steps"] += steps

        completions = buffers.tokens[:, width : width + steps]
        is_eos = torch.isin(completions, eos)
        ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1]).cpu().tolist()
        logprobs = buffers.logprobs[:, width : width + steps].cpu()
        ids = [row[: end + 1].tolist() for row, end in zip(completions.cpu(), ends)]
        if self.append_turns:  # for a tool turn's rows, next: each extends one of these
            self.turns.remember(model, cache, width, prompt_ids, ids, (unique_fields, counts[0], inverse))
        return ids, [row[: end + 1].tolist() for row, end in zip(logprobs, ends)]

    def _sampler(self, sampler: Sampler) -> Sampler:
        """`sampler`, or the one kept from an earlier generation if it samples alike: a recorded step reads the
        sampler's tensors (suppressed tokens, EOS ids), so recordings survive only while it is the same object."""
        if not sampler.reads_only_scores:
            return sampler
        if self._kept_sampler is None or self._kept_sampler.key != sampler.key:
            if self._kept_sampler is not None:
                self._graphs.forget(self._kept_sampler)
            self._kept_sampler = sampler
        return self._kept_sampler

    def _decode_fn(self, model: nn.Module, cache: Any, buffers: DecodeBuffers, sampler: Sampler):
        """One decode step: `() -> logits [B, V] | None`. It moves `buffers` to the token sampled last and runs the
        forward; with `sample_in_graph` and processors that read only the scores, it samples too (into `buffers`) and
        returns None; otherwise it returns the float32 logits (with recorded CUDA graphs, a buffer the next step
        overwrites) for the caller to sample from."""
        cache_name = cache_kwarg(model)  # `cache` (transformers >= 5.2x) or `past_key_values`
        compiled = self._compile_on(model)
        # Recorded on one GPU only: a model split over several (device_map) has kernels a recording would not see.
        devices = {p.device for p in model.parameters()}
        device = next(iter(devices))
        recorded = compiled and self.cuda_graph == "recorded" and len(devices) == 1 and device.type == "cuda"
        call = model.__call__
        if compiled:  # one graph per (batch, cache length); recorded graphs need Inductor's kernels without graphs
            mode = "default" if recorded or self.cuda_graph == "off" or device.type == "cpu" else "reduce-overhead"
            call = self._compiler.call(model, cache, mode, self.regional_compile)

        def token(sample: bool) -> torch.Tensor | None:
            buffers.advance()
            out = call(input_ids=buffers.next_tokens[:, None], position_ids=buffers.position,
                       attention_mask=buffers.mask, cache_position=buffers.slot, use_cache=True, logits_to_keep=1,
                       **{cache_name: cache})  # fmt: skip
            # Copy: a CUDA graph overwrites its outputs on the next replay.
            logits = out.logits[:, -1].to(dtype=torch.float32, copy=True)
            if not sample:
                return logits
            sampler.sample(buffers, logits, buffers.tokens)  # only processors that ignore the ids get here
            return None

        if recorded:
            self._graphs.begin(model, cache)

        def step() -> torch.Tensor | None:
            # Sampled inside the step whether or not it is recorded, so the CPU tests run the recorded step's code.
            sample = self.sample_in_graph and sampler.reads_only_scores
            if recorded and self.cuda_graph == "recorded":
                key = (id(buffers), id(sampler) if sample else None)
                try:
                    return self._graphs.step(lambda: token(sample), key, cache, device)
                except RecordingFailed as error:  # recording runs nothing: this step runs unrecorded
                    if sample:  # record the forward alone from the next step on, sampling on the host
                        logger.warning("%s; sampling outside the recorded step instead (sample_in_graph=False).",
                                       error)  # fmt: skip
                        self.sample_in_graph = False
                        return token(False)
                    logger.warning("%s; decoding with torch.compile's CUDA graphs instead (cuda_graph='compiler').",
                                   error)  # fmt: skip
                    self.cuda_graph = "compiler"
                    self._graphs.clear()
                    return token(False)
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            return token(sample)

        return step

"""`VLMGRPOConfig`: TRL's `GRPOConfig` with VLM defaults, the image pixel budget and the fast paths' switches.

Kept apart from the trainer, as TRL keeps `grpo_config.py` apart from `grpo_trainer.py`: a config is read by the CLI,
recipes and tests that never build a trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig

from ..compat import CHECKPOINTING_ARG
from ..engine.compiled_layers import SHAPE_MODES, UNITS, shape_mode_error, unit_error
from ..engine.lora_merge import MERGE_BACKUPS
from ..engine.quantized_generation import QUANTIZED_MODES
from ..media.pixel_budget import check_pixel_budget
from ..media.video_budget import DEFAULT_FPS, DEFAULT_MAX_FRAMES, check_frame_sampling

__all__ = ["VLMGRPOConfig"]


@dataclass
class VLMGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` with VLM defaults and the image pixel budget.

    Differences from TRL's defaults: `beta=0.04` (KL-regularised: the reference is the base model with
    the adapter disabled for PEFT models, so it costs no second copy of the weights); `bf16` chosen from
    the hardware (TRL's default of True fails on CPU); `dataloader_pin_memory` only with an accelerator (torch warns
    on a CPU); non-reentrant gradient checkpointing.
    """

    beta: float = field(
        default=0.04,
        metadata={"help": "KL coefficient against the reference model. 0.04 (the GRPO paper's) keeps the policy near "
                  "the base model, which guards small-group runs against collapsing to one answer."},
    )  # fmt: skip
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. None: on when the GPU supports bf16, off otherwise (CPU)."},
    )
    if CHECKPOINTING_ARG == "activation_checkpointing":
        # transformers >= 5.2x: `activation_checkpointing*`, with `gradient_checkpointing*` its deprecated aliases.
        # TRL's default (`gradient_checkpointing=True`) set the alias, which warned on every config; ours leaves the
        # aliases unset and resolves None to the same defaults under the new names, so a user who does set an alias
        # still gets transformers' warning and their value.
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Recompute activations in the backward pass to save memory (~20%% slower). None: on "
                      "(TRL's default).", "nargs": "?", "const": True},
        )  # fmt: skip
        activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
            default=None,
            metadata={"help": "Passed to `activation_checkpointing_enable`. None: {'use_reentrant': False}, "
                      "PyTorch's recommendation."},
        )  # fmt: skip
        gradient_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Deprecated alias of `activation_checkpointing`.", "nargs": "?", "const": True},
        )
        gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
            default=None, metadata={"help": "Deprecated alias of `activation_checkpointing_kwargs`."}
        )
    else:  # transformers < 5.2x: TRL's `gradient_checkpointing=True`, non-reentrant
        gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
            default_factory=lambda: {"use_reentrant": False},
            metadata={"help": "Passed to `gradient_checkpointing_enable`. Non-reentrant is PyTorch's recommendation."},
        )
    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin the dataloader's memory. None: on when torch has an accelerator (a GPU), off on a "
                  "CPU-only machine, where torch warns that pinning needs one."},
    )  # fmt: skip
    min_pixels: int | None = field(
        default=None,
        metadata={"help": "Smallest image area (pixels) the model is fed; smaller images are upscaled. Qwen2/2.5/3-VL: "
                  "written into the processor's own budget (size['shortest_edge']), replacing its value (logged). "
                  "None: the processor's own (Qwen-VL, e.g. from FastVisionModel.from_pretrained(min_pixels=...)), "
                  "else no lower bound."},
    )  # fmt: skip
    max_pixels: int | None = field(
        default=None,
        metadata={"help": "Largest image area (pixels) the model is fed; larger images are downscaled, aspect ratio "
                  "kept. Qwen2/2.5/3-VL: written into the processor's own budget (size['longest_edge']), replacing "
                  "its value (logged), so it bounds the image tokens. Gemma 3 / Idefics3 resize images to their own "
                  "input size after it, so there it bounds detail, not tokens. None: the processor's own (Qwen-VL), "
                  "else no bound."},
    )  # fmt: skip
    video_fps: float = field(
        default=DEFAULT_FPS,
        metadata={"help": "Frames sampled per second of a video file (Qwen-VL's own rate: 2), at most "
                  "video_max_frames, spread evenly. Frames given as a list or folder are taken to be at this rate."},
    )  # fmt: skip
    video_max_frames: int = field(
        default=DEFAULT_MAX_FRAMES,
        metadata={"help": "Most frames of a clip the model sees (memory grows with frames x pixels x generations)."},
    )
    video_num_frames: int | None = field(
        default=None,
        metadata={"help": "Exactly this many frames per clip, evenly spread (instead of video_fps). None: by rate."},
    )
    video_min_pixels: int | None = field(
        default=None,
        metadata={"help": "Qwen-VL video budget, lower bound: written into the video processor's size['shortest_edge'] "
                  "(per frame for Qwen2/2.5-VL, frames x area of the clip for Qwen3-VL). None: the processor's own."},
    )  # fmt: skip
    video_max_pixels: int | None = field(
        default=None,
        metadata={"help": "Qwen-VL video budget, upper bound: written into the video processor's size['longest_edge'] "
                  "(per frame for Qwen2/2.5-VL, frames x area of the clip for Qwen3-VL), so it bounds the video "
                  "tokens. None: the processor's own."},
    )  # fmt: skip
    check_images: bool = field(
        default=True,
        metadata={"help": "Decode every dataset image once (and open every clip) before training, so corrupt files "
                  "surface up front (missing files are found either way)."},
    )  # fmt: skip
    skip_bad_rows: bool = field(
        default=True,
        metadata={"help": "Drop rows whose images or clips are missing or cannot be read (logged and counted in "
                  "`trainer.skipped_rows`); more than half the rows bad is refused. False: raise at the first."},
    )  # fmt: skip
    fast_generation: bool = field(
        default=True,
        metadata={"help": "Generate with vlm_grpo.engine.fast_generation: one prefill per prompt group, a static KV cache and "
                  "a compiled decode step recorded as one CUDA graph (same tokens as the plain path). False: TRL's "
                  "`model.generate` path. Ignored with use_vllm."},
    )  # fmt: skip
    fast_generation_compile: bool | None = field(
        default=None,
        metadata={"help": "Compile the decode step into a CUDA graph (paid once per run). None: on CUDA, off on CPU "
                  "and where the weights are gathered afresh for every generation (ZeRO-3; FSDP2 without "
                  "fsdp_generation_copy)."},
    )  # fmt: skip
    fsdp_generation_copy: bool = field(
        default=True,
        metadata={"help": "Under FSDP2, the fast generator decodes from an unsharded copy of the model refreshed from "
                  "the shards once per step (for LoRA: the adapters only), so its decode step compiles to CUDA graphs "
                  "as on one GPU. A LoRA model's frozen base is shared with the copy and left unsharded (one base per "
                  "GPU, as under DDP); a full fine-tune's copy costs one 16-bit model per GPU. False: gather the "
                  "shards for each rollout and decode eagerly (a full fine-tune: less memory)."},
    )  # fmt: skip
    fast_generation_merge_lora: bool = field(
        default=True,
        metadata={"help": "Merge LoRA into the 16-bit base weights while generating (restored bit-exactly after, from "
                  "the copy fast_generation_merge_backup keeps; the decoder's q/k/v are merged into one stacked copy "
                  "instead, +0.4 GiB for a 3B model). 4-bit / 8-bit bases: see fast_generation_quantized."},
    )  # fmt: skip
    fast_generation_merge_backup: str = field(
        default="auto",
        metadata={"help": "Where the 16-bit base weights wait while LoRA is merged into them for generation. 'host': "
                  "one copy in pinned CPU memory, reused while the base stays frozen (no GPU memory: peak 0.82x TRL's "
                  "for a 3B model, at the same step time on an H100); it is pinned by cudaHostRegister on 8 threads "
                  "(PyTorch's pinned_use_cuda_host_register, set unless PYTORCH_ALLOC_CONF names a pinned_ option: "
                  "4x faster than its default) on a background thread while the first steps run, which keep a GPU "
                  "copy meanwhile where half the free GPU memory holds it. "
                  "'device': a fresh copy in GPU memory each generation (+1 copy of the adapted weights, 1.2-1.4x "
                  "TRL's peak). 'auto': 'host' on a GPU when every local process's copy fits in half the available "
                  "host memory, else 'device' (logged).", "choices": list(MERGE_BACKUPS)},
    )  # fmt: skip
    fast_generation_keep_decode_memory: bool = field(
        default=True,
        metadata={"help": "Keep the fast path's static KV / linear-attention caches, their recorded CUDA graph and the "
                  "stacked q/k/v weights from one generation to the next (recorded once per run). False: free them "
                  "after every generation for the scoring and training that follow (Qwen3.5-4B at 2 x 8: about "
                  "1.4 GiB) and record again at the next one."},
    )  # fmt: skip
    fast_generation_quantized: str = field(
        default="auto",
        metadata={"help": "How bitsandbytes 4-bit / 8-bit layers generate on the fast path. 'copy': a 16-bit copy of "
                  "the weights with LoRA merged, refreshed every generation (16-bit speed; +2 bytes per quantised "
                  "weight, ~6 GiB for a 3B model). 'light': each layer dequantised as it runs, LoRA unmerged (about "
                  "one layer's memory; slower). 'auto': 'copy' when it fits with a quarter of the GPU left for "
                  "training, else 'light' (logged).", "choices": list(QUANTIZED_MODES)},
    )  # fmt: skip
    fast_generation_importance_sampling: bool = field(
        default=False,
        metadata={"help": "Correct the fast path's sampler/scorer mismatch with TRL's vLLM importance sampling "
                  "(vllm_importance_sampling_mode, _clip_min, _clip_max apply; see vlm_grpo.training.sampler_logprobs). Costs "
                  "one more policy forward per generation batch. Off: the loss scores the sampler's own distribution "
                  "(blocked ids excluded) and the remaining gap, bf16 rounding and top-k/p truncation, is logged as "
                  "sampling/sampling_logp_difference."},
    )  # fmt: skip
    packed_vision_attention: bool = field(
        default=True,
        metadata={"help": "Qwen-VL vision towers (sdpa): attend to all windows of one length in one batched call "
                  "(vlm_grpo.engine.vision_attention; same outputs and gradients) instead of one call per window, "
                  "~900 calls per vision pass at 448². Other families and attention implementations: unchanged."},
    )  # fmt: skip
    compile_layers: bool | None = field(
        default=None,
        metadata={"help": "Compile each layer's attention and MLP (torch.compile) for the training forward and "
                  "backward: fused kernels, one call per module instead of PEFT's and transformers' Python, where the "
                  "training phase is host-bound (the same loss and gradients up to float rounding). The first steps "
                  "compile (~15 s for a 3B model). None: on for a model on a GPU; off on CPU, under FSDP / DeepSpeed, "
                  "torch_compile, Unsloth, reentrant checkpointing and for 4-bit / 8-bit models. Module hooks added "
                  "inside these layers after the first step do not run in the training forward: False for those."},
    )  # fmt: skip
    compile_linear_attention: bool = field(
        default=True,
        metadata={"help": "With compile_layers: also compile the linear-attention layers' training forward "
                  "(Qwen3.5's gated delta net: projections, gates, gated norm; its short convolution and chunked "
                  "scan stay eager). The same loss and gradients; Qwen3.5-4B at 2 x 8 trained in 1.77 s instead of "
                  "2.28 on an H200 and in 1.97 s instead of 2.07 on a fresh H100 (no compile wait after the first "
                  "step). False: those layers' training forward runs eagerly."},
    )  # fmt: skip
    compile_layers_dynamic: str = field(
        default="length",
        metadata={"help": "With compile_layers, how sizes are compiled: 'length' (default) the rows' length and count "
                  "symbols from the first compile, so changing lengths never compile again; 'auto' (torch's default) a "
                  "static graph first, then one with the changing lengths as symbols at the first new length (a "
                  "second compile mid-run); 'all' every size a symbol from the first compile (torch.compile's "
                  "dynamic=True: on an H200 its code generation took ~1 minute)."},
    )  # fmt: skip
    compile_layers_unit: str = field(
        default="layers",
        metadata={"help": "With compile_layers, what one compiled training forward covers: 'layers' (default) each "
                  "layer with its attention and MLP as one graph, its norms and residual adds fused in (Qwen-VL "
                  "vision blocks, models with recurrent layers such as Qwen3.5, and layers with module hooks inside "
                  "compile their attention and MLP apart); 'modules' the attention and MLP apart everywhere. The eager "
                  "loss and gradients up to float rounding. On an H200 (3B, 2 x 8) 'layers' took 0.1-0.2 s off each "
                  "step's training phase, and its first step about 1 s longer (Dynamo traces more per graph)."},
    )  # fmt: skip
    compile_layers_ahead_of_time: bool | None = field(
        default=None,
        metadata={"help": "With compile_layers: compile each layer's (or attention's and MLP's) training forward ahead "
                  "of time (torch's aot_compile, the same cost as torch.compile) and keep it in the compile cache's "
                  "folder, so a later run loads it instead of tracing it with Dynamo again (its GPU gain is still to be "
                  "measured: before the thirteenth session torch 2.11 fell back to torch.compile). Anything it "
                  "cannot serve falls back to torch.compile, said once. None: on with lengths dynamic and the "
                  "compile cache on, except under FSDP. See vlm_grpo.engine.aot_layers."},
    )  # fmt: skip
    compile_layers_in_background: bool = field(
        default=True,
        metadata={"help": "With compile_layers_ahead_of_time: a layer (or part) whose compiled forward is in no cache is "
                  "compiled by another process while it trains as written (the eager results), and loaded at its "
                  "first call of the first step after it is done, so a fresh machine's first step does not wait for "
                  "the compile. False (and with full_determinism or deterministic algorithms, whose runs must not depend on when the "
                  "compiled layer takes over): the first step compiles it. See vlm_grpo.engine.background_compile."},
    )  # fmt: skip
    compile_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where compiled code is kept for later runs, on this machine or another (torch's portable "
                  "compile caches, keyed by versions, GPU and architecture; also saved beside each checkpoint), so "
                  "a run's first step does not compile again. None: $VLM_GRPO_CACHE/compile or "
                  "~/.cache/vlm_grpo/compile; \"none\": off. See vlm_grpo.engine.compile_cache."},
    )  # fmt: skip
    gc_freeze: bool | None = field(
        default=False,
        metadata={"help": "After the first step and each step that compiled something, collect garbage once and "
                  "freeze what is alive (gc.freeze(), as vLLM does after capturing its graphs), so that Python's full "
                  "collections skip the model and the compiled code (one over the tiny 36-layer model's 0.7 million "
                  "objects: 360 ms, in a step nobody chose); unfrozen when train() ends (with anything frozen before "
                  "it: Python cannot unfreeze only some). None: on where training runs on a GPU, off on CPU. Off by "
                  "default until a GPU run measures it (on CPU it is a wash over 8 steps). See "
                  "vlm_grpo.training.gc_freeze."},
    )  # fmt: skip
    shared_prefix: bool = field(
        default=True,
        metadata={"help": "Compute each group's prompt and images once when scoring and training (the G completions "
                  "of a prompt packed into one row that attends to it; same log-probs and gradients). Models or "
                  "settings it cannot serve (e.g. FlashAttention) fall back to TRL's per-row forward, logged once."},
    )  # fmt: skip

    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "DAPO dynamic sampling: groups whose completions all earn the same reward (zero advantage, "
                  "no gradient) are dropped after scoring, and the next prompts in the sampler's order are generated "
                  "until every process's batch holds its configured number of groups with differing rewards. Costs "
                  "extra generation rounds (at most max_sampling_rounds per batch); the optimizer steps and the batch "
                  "size stay as configured. See vlm_grpo.training.dynamic_sampling."},
    )  # fmt: skip
    max_sampling_rounds: int = field(
        default=4,
        metadata={"help": "With dynamic_sampling: the most generation rounds for one batch. When they leave it short, "
                  "it is filled with zero-std groups (zero advantage; logged as dynamic_sampling/cap_hit)."},
    )  # fmt: skip

    max_nonfinite_steps: int = field(
        default=5,
        metadata={"help": "A step whose loss or gradient norm is NaN / inf is skipped (its gradients never reach the "
                  "weights or the optimizer; counted as nonfinite_steps in the logs), and the run stops once this "
                  "many steps in a row were skipped (1: at the first). See vlm_grpo.training.nonfinite."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if CHECKPOINTING_ARG == "activation_checkpointing":
            if self.activation_checkpointing is None and self.gradient_checkpointing is None:
                self.activation_checkpointing = True
            if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is None:
                self.activation_checkpointing_kwargs = {"use_reentrant": False}
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = torch.accelerator.is_available()
        check_pixel_budget(self.min_pixels, self.max_pixels)
        if self.fast_generation_merge_backup not in MERGE_BACKUPS:
            raise ValueError(
                f"fast_generation_merge_backup must be one of {', '.join(MERGE_BACKUPS)}, "
                f"got {self.fast_generation_merge_backup!r}."
            )
        check_pixel_budget(self.video_min_pixels, self.video_max_pixels)
        check_frame_sampling(self.video_fps, self.video_max_frames, self.video_num_frames)
        if self.fast_generation_quantized not in QUANTIZED_MODES:
            raise ValueError(
                f"fast_generation_quantized must be one of {', '.join(QUANTIZED_MODES)}, "
                f"got {self.fast_generation_quantized!r}."
            )
        if self.fast_generation_importance_sampling and not self.vllm_importance_sampling_correction:
            raise ValueError(
                "fast_generation_importance_sampling=True applies TRL's vLLM importance sampling to the fast path, "
                "but vllm_importance_sampling_correction=False turns it off: set it to True (TRL's default)."
            )
        if self.compile_layers_dynamic not in SHAPE_MODES:
            raise ValueError(shape_mode_error(self.compile_layers_dynamic))
        if self.compile_layers_unit not in UNITS:
            raise ValueError(unit_error(self.compile_layers_unit))
        if self.compile_layers_ahead_of_time and self.compile_layers_dynamic == "auto":
            raise ValueError("compile_layers_ahead_of_time compiles with the lengths dynamic from the first compile: it "
                             "needs compile_layers_dynamic 'length' or 'all'.")  # fmt: skip
        if self.compile_layers_ahead_of_time and self.compile_cache_dir == "none":
            raise ValueError("compile_layers_ahead_of_time keeps what it compiles in the compile cache's folder, which "
                             "compile_cache_dir='none' turns off: set a folder (or leave it None).")  # fmt: skip
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}.")
        super().__post_init__()
        self._check_dynamic_sampling()

    def _check_dynamic_sampling(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}.")
        if not self.dynamic_sampling:
            return
        rows = self.per_device_train_batch_size * self.steps_per_generation
        if rows % self.num_generations:
            # Each process filters its own groups: a group split across processes could not be kept or dropped whole.
            raise ValueError(
                f"dynamic_sampling needs each process's generation batch (per_device_train_batch_size x "
                f"steps_per_generation = {rows} rows) to hold whole groups of num_generations={self.num_generations}: "
                "make it a multiple of num_generations."
            )
        if self.remove_unused_columns:
            raise ValueError(
                "dynamic_sampling reads training rows itself, with every column (the rewards read them): set "
                "remove_unused_columns=False (TRL's default for GRPO)."
            )

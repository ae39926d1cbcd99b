"""`VLMGRPOTrainer`: TRL's `GRPOTrainer` for vision-language models.

TRL already runs multimodal rollouts; this subclass adds what a VLM user needs around them and
overrides only these hooks:
- `__init__`: takes `(model, processor)` from `FastBaseVisionModel` (or a model id), validates the
  datasets (bad rows raise or are skipped before training), refuses a model with nothing to train,
  checks reward functions on every call, and registers the requires-grad hooks so checkpointed vision
  LoRA trains; progress is one bar with the rewards in its postfix (`vlm_grpo.callbacks.RewardProgressBar`, not a
  dict per log) and checkpoints follow the umask (`vlm_grpo.files.CheckpointModesCallback`); Qwen-VL vision towers
  attend in batched calls (`vlm_grpo.engine.vision_attention`).
- `train`: refuses, before the first step, a TRL that cannot compute GRPO log-probs on this device; `True` for
  `resume_from_checkpoint` is the newest *complete* checkpoint (`vlm_grpo.checkpoints`); restarts dynamic sampling's
  prompt stream (from the checkpoint when resuming).
- `_generate_and_score_completions`: images loaded from any format, normalised, fitted to the pixel
  budget (`vlm_grpo.pixel_budget`) and given as `images` lists; plain-string prompts with images turned
  into chat messages. Rows with clips: sampled and sized by the video budget (`vlm_grpo.video_budget`),
  placed with the images in the prompts, and their vision inputs returned with the batch (TRL has no video
  path, so the trainer processes these batches itself: `vlm_grpo.processing`). With `dynamic_sampling`, a training
  batch is built by `vlm_grpo.dynamic_sampling` from rounds of these calls, keeping the groups whose rewards differ.
- `_tokenize_prompts`: each distinct prompt tokenised and its images (and clips) processed once, the outputs repeated
  for its group (TRL processes every repeated row).
- `_generate`: text-only rows in a batch with images get `[]` images (TRL's None breaks the processor); a batch with
  clips hands TRL no images (its forward would process them without the clips).
- `_compute_loss`: the batch's clips (and images) reach the log-prob computation beside TRL's inputs.
- `_calculate_rewards`: rows whose prompt was a string reach the rewards as strings again; the rewards (of every
  process) are kept for dynamic sampling's filter.
- `_generate_single_turn`: the model switched to inference mode for generation and back after; completions
  from `vlm_grpo.engine.fast_generation` (one prefill per prompt group, compiled decode; 4-bit / 8-bit layers through
  `vlm_grpo.engine.quantized_generation`'s stand-ins) unless TRL's vLLM path or a
  setting it cannot serve is in use (then TRL's `model.generate`, with a one-time log line naming why).
- `save_model`: also writes the model under FSDP with sharded checkpoints (transformers writes nothing there);
  checkpoints mid-training without transformers' "Writing model shards" bar inside the training bar.
- `_load_from_checkpoint` (transformers'): full weights resumed under the model's own names
  (`vlm_grpo.checkpoints.load_full_weights`); transformers loads the Hub names they are saved under as they are.
- `_get_per_token_logps_and_entropies`: each group's prompt and images computed once (`vlm_grpo.engine.shared_prefix`),
  same log-probs and gradients; TRL's per-row forward for what it cannot serve (a one-time log line naming why), with
  a batch's clips passed to the model beside TRL's inputs.
Everything else (losses, GSPO, vLLM, logging, checkpointing) is TRL's own. The private TRL names touched here are
listed, with the signatures they were tested with, in `vlm_grpo.private_api`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers import ProgressCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from .blocked_tokens import check_blocking_settings, scoring_as_sampled, suppress_token
from .callbacks import RewardProgressBar, library_bars_off
from .checkpoints import load_full_weights, newest_complete_checkpoint
from .compat import (
    CHECKPOINTING_ARG,
    checkpointing_from_args,
    is_checkpointing,
    quiet_third_party_checkpointing_deprecations,
)
from .config import VLMGRPOConfig
from .dynamic_sampling import DynamicSampler, DynamicSamplingState
from .engine.adapters_off import AdaptersOff, layers_to_switch
from .engine.batch_layout import VIDEO_KEYS, distinct_prompts, select_rows
from .engine.compiled_layers import CompiledLayers, detach_all
from .engine.compiled_layers import unsupported_reason as compiled_layers_unsupported
from .engine.fast_generation import FastGenerator, FastPathUnavailable
from .engine.sharded import full_weights
from .engine.sharded import unsupported_reason as sharded_unsupported_reason
from .engine.shared_prefix import SharedPrefixUnsupported, shared_prefix_logps
from .engine.vision_attention import pack_vision_attention
from .families import core_model
from .files import CheckpointModesCallback
from .hooks import enable_requires_grad_hooks
from .image_sizes import add_image_sizes
from .integrations.unsloth import maybe_patch_for_model
from .model import FastBaseVisionModel
from .modes import checkpointing_mode, checkpointing_off, generating, set_checkpointing
from .pixel_budget import apply_pixel_budget
from .private_api import merged_generation_config
from .processing import check_video_support, holds_clips, row_vision_inputs, tokenize_clip_prompts
from .processor import load_processor
from .prompts import video_column
from .reward_checks import checked_reward_func
from .rows import check_dataset, prepare_row, rows_for_rewards
from .sampler_logprobs import log_logp_gap, loss_as_vllm, mark_sampled, sampled_as_vllm
from .video_budget import apply_video_budget

__all__ = ["VLMGRPOConfig", "VLMGRPOTrainer"]

logger = logging.getLogger(__name__)

# The key under which a batch with clips carries each row's vision inputs (a list, one dict per row, so TRL's shuffle
# and split of a generation batch keep them with their rows).
VISION_ROWS = "vlm_grpo_vision_rows"
# The vision inputs of a row: its images' and its clips' processor outputs, and how many of each.


def _check_trl_device_support(device: torch.device) -> None:
    import trl
    from packaging.version import Version

    # TRL 1.15 computes every GRPO log-prob with a Triton kernel (a fused LM head) and has no CPU path: without a
    # GPU the first step dies deep inside TRL. 1.16 added the fallback.
    if device.type == "cpu" and Version(trl.__version__) < Version("1.16"):
        raise RuntimeError(
            f"trl {trl.__version__} can only train GRPO on a GPU (its log-prob kernel needs Triton on CUDA). "
            "Train on a GPU, or upgrade to trl>=1.16 for CPU training."
        )


def _is_fresh_lora(model: Any) -> bool:
    """True for a PEFT LoRA model whose only adapter has all-zero B matrices (so it changes nothing yet)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or list(peft_config) != ["default"]:
        return False
    b_weights = [p for n, p in model.named_parameters() if ".lora_B." in n or ".lora_embedding_B." in n]
    return bool(b_weights) and all(not p.detach().any() for p in b_weights)


def _model_init_kwargs(args: GRPOConfig, quantization_config: Any = None) -> dict[str, Any]:
    """`from_pretrained` kwargs for a model given by name, as TRL builds them: `model_init_kwargs`, the trainer's
    `quantization_config` argument and `args.trust_remote_code`."""
    init_kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if "quantization_config" in init_kwargs:
            raise ValueError(
                "quantization_config is set both as a trainer argument and in `args.model_init_kwargs`; set it once."
            )
        init_kwargs["quantization_config"] = quantization_config
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return init_kwargs


def _compile_default(args: Any, sharded: bool) -> bool | None:
    """`fast_generation_compile`, with None resolved to off for sharded models.

    Their weights are gathered into fresh memory for every generation, so a CUDA graph recorded on one step's
    addresses would be re-recorded (recompiled) at every step; eager decoding is faster there.
    """
    compile = getattr(args, "fast_generation_compile", None)
    return False if compile is None and sharded else compile


def _apply_configured_checkpointing(model: Any, args: Any) -> None:
    """Give the model the checkpointing its args configure, whatever state it arrived in (logged when that differs).

    The args are the truth, as transformers' Trainer treats them when they switch checkpointing on: a model left
    checkpointing by earlier code (an older `evaluate`, `get_peft_model`'s default) must not train with it when the
    config says off, nor the other way round.
    """
    enabled, kwargs = checkpointing_from_args(args)
    configured: bool | str = ("reentrant" if kwargs.get("use_reentrant") else True) if enabled else False
    found = checkpointing_mode(model)
    if configured and not getattr(model, "supports_gradient_checkpointing", True):
        return  # transformers' Trainer refuses it with its own message
    if found != configured:
        logger.warning(
            "Activation checkpointing: the model came with %s; training with %s, as `%s` in the config says.",
            _describe_checkpointing(found), _describe_checkpointing(configured), CHECKPOINTING_ARG,
        )  # fmt: skip
        set_checkpointing(model, configured)


def _describe_checkpointing(mode: bool | str) -> str:
    return {False: "it off", "reentrant": "it on (reentrant)", True: "it on (non-reentrant)"}[mode]


def _refuse_clip_settings(args: Any, kwargs: dict[str, Any]) -> None:
    """Refuse settings whose code paths would drop a batch's clips (TRL's own paths know only images)."""
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


class _WithInputs:
    """`model` called with extra keyword inputs: a batch's clips, which TRL's per-row forward does not pass."""

    def __init__(self, model: Any, inputs: dict[str, Any]) -> None:
        self.model, self.inputs = model, inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs, **self.inputs)


def _refuse_frozen_model(model: Any) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "The model has no trainable parameters, so training would run with grad_norm 0 and change nothing. "
            "FastVisionModel.from_pretrained returns a frozen model until you choose what to train: add LoRA "
            "adapters with `model = FastVisionModel.get_peft_model(model, r=16, ...)`, or load it with "
            "`FastVisionModel.from_pretrained(..., full_finetuning=True)` to train all weights."
        )


class VLMGRPOTrainer(GRPOTrainer):
    """GRPO for vision-language models. Same arguments as `trl.GRPOTrainer`.

    Args:
        model: a model from `FastBaseVisionModel.from_pretrained` (PEFT or full, 16-bit or 4-bit), any
            transformers VLM, or a model id / path (loaded with `FastBaseVisionModel`, fully fine-tuned
            unless `peft_config` is given).
        reward_funcs: TRL reward functions `(prompts, completions, **columns) -> list[float | None]`
            (see `vlm_grpo.rewards`), reward model ids, or a list of them.
        args: a `VLMGRPOConfig` (a plain `GRPOConfig` works too).
        train_dataset / eval_dataset: rows with `prompt` (string or chat messages) and `image` (one) or
            `images` (a list, possibly empty) as PIL images, paths, bytes, numpy arrays or
            `{"bytes", "path"}` dicts. Other columns reach the reward functions as keyword arguments.
        processing_class: the processor; defaults to the one `FastBaseVisionModel` loaded with the model.
        **kwargs: passed to `trl.GRPOTrainer` (`peft_config`, `callbacks`, `optimizers`, ...).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = VLMGRPOConfig(output_dir="vlm-grpo-output")
        if isinstance(model, str):
            model, loaded_processor = FastBaseVisionModel.from_pretrained(
                model,
                full_finetuning=kwargs.get("peft_config") is None,
                use_gradient_checkpointing=checkpointing_from_args(args)[0],
                **_model_init_kwargs(args, kwargs.pop("quantization_config", None)),
            )
            processing_class = processing_class or loaded_processor
        if processing_class is None:
            processing_class = getattr(model, "_vlm_grpo_processor", None) or load_processor(
                model.config._name_or_path, model.config.model_type
            )
        # The processor's own budget (Qwen-VL), overwritten by the config's where it sets one; else the config's.
        self.pixel_budget = apply_pixel_budget(
            processing_class, getattr(args, "min_pixels", None), getattr(args, "max_pixels", None)
        )
        self.video_budget = apply_video_budget(
            processing_class, fps=getattr(args, "video_fps", None), max_frames=getattr(args, "video_max_frames", None),
            num_frames=getattr(args, "video_num_frames", None), min_pixels=getattr(args, "video_min_pixels", None),
            max_pixels=getattr(args, "video_max_pixels", None),
        )  # fmt: skip
        datasets = [train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])]
        with_clips = any(video_column(getattr(d, "column_names", None) or []) for d in datasets if d is not None)
        if with_clips:
            check_video_support(processing_class, model if not isinstance(model, str) else None)
            _refuse_clip_settings(args, kwargs)

        check_images = getattr(args, "check_images", True)
        skip_bad_rows = getattr(args, "skip_bad_rows", True)
        train_dataset, skipped_train = check_dataset(
            train_dataset, "train_dataset", check_images=check_images, skip_bad_rows=skip_bad_rows
        )
        self.skipped_rows = {"train": skipped_train}
        if isinstance(eval_dataset, dict):
            checked = {}
            for split, dataset in eval_dataset.items():
                checked[split], self.skipped_rows[f"eval_{split}"] = check_dataset(
                    dataset, f"eval_dataset[{split!r}]", check_images=check_images, skip_bad_rows=skip_bad_rows
                )
            eval_dataset = checked
        else:
            eval_dataset, self.skipped_rows["eval"] = check_dataset(
                eval_dataset, "eval_dataset", check_images=check_images, skip_bad_rows=skip_bad_rows
            )

        if kwargs.get("peft_config") is None:  # else TRL adds the trainable adapters
            _refuse_frozen_model(model)
        if reward_funcs is not None:
            reward_funcs = [
                checked_reward_func(f) for f in (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
            ]

        # TRL keeps a frozen copy of a passed-in adapter ("ref") as the KL reference, because the adapter might be
        # pretrained. A fresh LoRA adapter (every B zero) is the identity, so the base model with the adapter disabled
        # is the same reference without the copy's memory and compute.
        fresh_adapter = _is_fresh_lora(model)
        with quiet_third_party_checkpointing_deprecations():  # TRL (and PEFT, given a peft_config) read the old name
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                **kwargs,
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        if with_clips:  # as TRL suppresses the image token: a sampled video token would have no features behind it
            suppress_token(self, getattr(unwrapped.config, "video_token_id", None))
        check_blocking_settings(merged_generation_config(core_model(unwrapped), self.generation_config))
        _apply_configured_checkpointing(unwrapped, args)
        if fresh_adapter and "ref" in getattr(unwrapped, "peft_config", {}):
            unwrapped.delete_adapter("ref")
            unwrapped.set_adapter("default")
        if is_checkpointing(unwrapped):
            enable_requires_grad_hooks(unwrapped)
        maybe_patch_for_model(unwrapped)  # no-op unless the model came from Unsloth
        if getattr(args, "packed_vision_attention", True):
            pack_vision_attention(unwrapped)
        if self.pop_callback(ProgressCallback) is not None:  # its bar, without a printed dict per log record
            self.add_callback(RewardProgressBar())
        self.add_callback(CheckpointModesCallback())
        self.fast_generator = FastGenerator(
            compile=_compile_default(args, sharded=self.is_fsdp_enabled or self._is_zero3),
            merge_lora=getattr(args, "fast_generation_merge_lora", True),
            merge_backup=getattr(args, "fast_generation_merge_backup", "auto"),
            quantized=getattr(args, "fast_generation_quantized", "auto"),
        )
        self._fast_generation_fallbacks: set[str] = set()
        # A fresh adapter's KL reference: the policy with its adapters off by their own flags, not PEFT's walks
        # (`vlm_grpo.engine.adapters_off`); TRL hands it back to `_get_per_token_logps_and_entropies`.
        if self.beta != 0.0 and self.ref_model is None and (layers := layers_to_switch(unwrapped)) is not None:
            self.ref_model = AdaptersOff(lambda: self.model, layers)
        self.compiled_layers = CompiledLayers()
        self._compile_layers(unwrapped, args)
        self.dynamic_sampler = DynamicSampler(self) if getattr(args, "dynamic_sampling", False) else None
        if self.dynamic_sampler is not None:
            self.add_callback(DynamicSamplingState())  # carries its position into checkpoints
        # Each row's vision inputs while a batch with clips is generated and scored (`_tokenize_prompts`) or trained
        # on (`_compute_loss`); None otherwise. `_get_per_token_logps_and_entropies` passes them to the model.
        self._vision_rows: list[dict[str, Any]] | None = None

    def _compile_layers(self, unwrapped: Any, args: Any) -> None:
        """Compile the layers' attention and MLP for the training forward and backward (`engine.compiled_layers`) as
        `compile_layers` asks: None is on for a model on a GPU, where the training phase is host-bound. Idempotent;
        compiled forwards another trainer left on the model are removed first (this config decides)."""
        if not self.compiled_layers.modules:
            detach_all(unwrapped)
        setting = getattr(args, "compile_layers", None)
        if setting is False or (setting is None and next(unwrapped.parameters()).device.type != "cuda"):
            return
        reason = (
            "torch_compile compiles the whole model" if args.torch_compile
            else "sharded (FSDP / DeepSpeed) layers" if self.is_fsdp_enabled or self.is_deepspeed_enabled
            else compiled_layers_unsupported(unwrapped)
        )  # fmt: skip
        if reason is not None:
            warned = self.__dict__.setdefault("_compile_layers_warnings", set())
            if setting and reason not in warned:  # asked for by name: say why not, once
                warned.add(reason)
                logger.warning("compile_layers=True, but the layers are left uncompiled: %s.", reason)
            return
        before = len(self.compiled_layers.modules)
        count = self.compiled_layers.attach(unwrapped)
        if count != before:
            logger.info("Compiled the training forward of %d attention / MLP modules (the first step compiles them).",
                        count)  # fmt: skip

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after checking this TRL can compute GRPO log-probs on this device.

        `resume_from_checkpoint=True` resumes from the newest *complete* checkpoint in `output_dir`
        (`vlm_grpo.checkpoints`), where transformers would take the newest one, even one cut short by a kill.
        """
        _check_trl_device_support(self.accelerator.device)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint to resume from in {self.args.output_dir}.")
        if self.dynamic_sampler is not None:
            self.dynamic_sampler.restart()
        # The layers compiled for this run only: afterwards the model's own forwards, for whatever uses it next.
        self._compile_layers(self.accelerator.unwrap_model(self.model), self.args)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.compiled_layers.detach()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, which also writes the model under FSDP with sharded checkpoints.

        transformers writes nothing there (its checkpoints hold the shards), so a run's final `save_model` would
        leave an empty directory. Checkpoints are written without transformers' bar, inside the training bar. Outside checkpointing the weights (the adapter, for LoRA) are gathered and written
        as plain files. A collective: call it on every rank, as with any sharded model.
        """
        plugin = self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None
        if plugin is None or _internal_call or "FULL_STATE_DICT" in str(plugin.state_dict_type):
            # A checkpoint mid-training: transformers' "Writing model shards" bar would break into the training bar.
            with library_bars_off() if _internal_call else contextlib.nullcontext():
                return super().save_model(output_dir, _internal_call)
        self._save(output_dir or self.args.output_dir, state_dict=self.accelerator.get_state_dict(self.model))
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # transformers reloads a checkpoint's full weights with `load_state_dict` under the names they were saved with,
        # the Hub's (Qwen2.5-VL's `model.layers.*`), not the model's (`model.language_model.layers.*`): only the LM
        # head would resume, the rest silently left as it was (transformers #43701). Sharded models (loaded after
        # `prepare`, by FSDP / DeepSpeed) and adapters load as transformers does.
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        if sharded or not load_full_weights(self.model if model is None else model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if self.dynamic_sampler is not None and self.model.training:
            # The prompts come from the sampler's stream (the same order as `inputs`, which only sets the batch size).
            return self.dynamic_sampler.fill(len(inputs))
        return self._score_rollouts(inputs)

    def _score_rollouts(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring of dataset rows `inputs` (each prompt repeated for its group)."""
        memo: dict[str, Any] = {}  # a clip file named by several rows (each of TRL's repeats) is decoded once
        inputs = [prepare_row(row, self.pixel_budget, self.video_budget, memo) for row in inputs]
        inputs = add_image_sizes(inputs, self.processing_class)  # grounding rewards map boxes back
        self._vision_rows = None  # set by `_tokenize_prompts` for a batch with clips
        try:
            # TRL's step reads transformers' old checkpointing name; the fast path's importance sampling runs as TRL's
            # for vLLM (`vlm_grpo.sampler_logprobs`).
            with quiet_third_party_checkpointing_deprecations(), sampled_as_vllm(self):
                output = super()._generate_and_score_completions(inputs)
            if self._vision_rows is not None:
                output[VISION_ROWS] = self._vision_rows
            return output
        finally:
            self._vision_rows = None
            self.fast_generator.finish_restore()  # base weights whole for whatever reads them next

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        # TRL passes the model only the inputs it knows by name; a batch's clips travel under VISION_ROWS.
        self._vision_rows = inputs.get(VISION_ROWS)
        self._scored_logps = []  # the policy's log-probs, for the sampler gap (`vlm_grpo.sampler_logprobs`)
        try:
            with loss_as_vllm(self, inputs):
                loss = super()._compute_loss(model, inputs)
        finally:
            self._vision_rows, scored, self._scored_logps = None, self._scored_logps, None
        if "sampling_per_token_logps" in inputs and "importance_sampling_ratio" not in inputs and scored:
            # TRL logs the gap itself when it corrects for it; else it is the loss's log-probs against the sampler's,
            # on the policy that sampled (the batch's first use, or TRL's old log-probs where it computed them).
            mask = (
                inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
            )
            reference = inputs.get("old_per_token_logps", scored[0])
            log_logp_gap(self, reference, inputs["sampling_per_token_logps"], mask)
        return loss

    def _tokenize_prompts(self, prompts: list):
        if holds_clips(prompts):
            return self._tokenize_prompts_with_clips(prompts)
        # TRL repeats every prompt num_generations times; the processor (tokenizer and image processor, on the CPU)
        # runs once per distinct prompt and its outputs are repeated (`engine.batch_layout`): the same ids and tensors.
        distinct = distinct_prompts(prompts) if self.environment_factories is None else None
        if distinct is None or len(distinct[0]) == len(prompts):
            return super()._tokenize_prompts(prompts)
        unique, inverse = distinct
        prompt_ids, images, fields = super()._tokenize_prompts([prompts[row] for row in unique])
        images_per_row = [len(row or []) for row in images] if images is not None else [0] * len(unique)
        fields = select_rows(fields, images_per_row, inverse)
        images = [images[i] for i in inverse] if images is not None else None
        return [prompt_ids[i] for i in inverse], images, fields

    def _tokenize_prompts_with_clips(self, prompts: list):
        """`_tokenize_prompts` for a batch with clips (`vlm_grpo.processing`: TRL's would drop them), keeping each
        row's vision inputs for the forward passes (`_vision_rows`)."""
        if self.tools or self.environment_factories is not None:
            raise ValueError("Clips in tool-calling rollouts are not supported: the tool loop re-enters TRL's image-only "
                             "processing.")  # fmt: skip
        prompt_ids, media, fields, self._vision_rows = tokenize_clip_prompts(
            self.processing_class, prompts, chat_template=self.chat_template, template_kwargs=self.chat_template_kwargs
        )
        return prompt_ids, media, fields

    def _generate(self, prompts: list):
        # TRL marks a text-only row's images None even in a batch whose other rows have images (vLLM wants that), and
        # the processor then fails on the None. An empty list is what processors expect for "no image in this row".
        # Unpacked by name, so a change in TRL's return fails here rather than patching the wrong element.
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = (
            super()._generate(prompts)
        )
        mark_sampled(self, logprobs)
        if self._vision_rows is not None:
            images = None  # TRL would process the images without the clips; the rows carry both (`_vision_rows`)
        elif images is not None and any(images):
            images = [[] if i is None else i for i in images]
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        def decode(ids: list[list[int]]) -> list[str]:
            return self.processing_class.batch_decode(ids, skip_special_tokens=True)

        inputs, prompts, completions = rows_for_rewards(inputs, prompts, completions, completion_ids_list, decode)
        self._last_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._last_rewards_per_func

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        # Inference mode while generating, then exactly the mode the model was in (train or eval, checkpointing as
        # configured at __init__): `vlm_grpo.modes` owns the switching.
        unwrapped = self.accelerator.unwrap_model(self.model)
        with generating(unwrapped):
            completions = self._fast_generate(*args, **kwargs)
            if completions is not None:
                return completions
            # TRL's generation switches checkpointing off and on again with the config's kwargs: off here first, so
            # it leaves it alone, and given back exactly as found after.
            with checkpointing_off(unwrapped):
                return super()._generate_single_turn(*args, **kwargs)

    @property
    def _is_zero3(self) -> bool:
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and plugin.zero_stage == 3

    def _fast_generation_blocker(self, has_tool_images: bool) -> str | None:
        """Why this trainer generates on TRL's plain path (None: the fast path can serve it)."""
        # TRL's attributes read plainly (vlm_grpo.private_api.TRAINER_ATTRIBUTES, checked against TRL by a test).
        if self.use_vllm or self.use_transformers_continuous_batching:
            return "generation runs in vLLM / transformers continuous batching"
        if self.tools or has_tool_images or self.environment_factories is not None:
            return "tool-calling rollouts re-enter generation with tool results"
        if self.is_fsdp_enabled and (reason := sharded_unsupported_reason(self.model_wrapped)):
            return reason
        if self._is_zero3 and not self.args.ds3_gather_for_generation:
            return "ds3_gather_for_generation=False: ZeRO-3 weights stay sharded while generating"
        return self.fast_generator.unsupported_reason(self.accelerator.unwrap_model(self.model))

    @contextlib.contextmanager
    def _unwrapped_for_generation(self):
        """The model without DDP / DeepSpeed wrappers; under ZeRO-3, TRL's context, which gathers the weights (with
        checkpointing off around it, which it would switch back on with the config's kwargs)."""
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        if not self._is_zero3:
            yield unwrapped  # TRL's context would add a walk of the model to switch checkpointing off and on, for nothing
            return
        with checkpointing_off(unwrapped), unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, generation_kwargs=self.generation_kwargs
        ) as model:  # fmt: skip
            yield model

    def _fast_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions from `vlm_grpo.engine.fast_generation`, or None when the plain path must serve this call."""
        if not getattr(self.args, "fast_generation", False):
            return None
        reason = self._fast_generation_blocker(has_tool_images)
        if reason is None:
            # FSDP2 units are unsharded here, once for the whole rollout rather than per layer per token.
            with (
                self._unwrapped_for_generation() as model,
                full_weights(self.model_wrapped) if self.is_fsdp_enabled else contextlib.nullcontext(),
            ):
                try:
                    completion_ids, logprobs = self.fast_generator.generate(
                        model,
                        prompt_ids,
                        images,
                        multimodal_fields,
                        self.generation_config,
                        self._tokenizer.pad_token_id,
                        # The base weights come back while TRL's scoring forward runs (`_score_rollouts` waits for
                        # them after it); not where the weights are resharded on leaving these contexts, nor under
                        # torch_compile (Dynamo does not run the hooks that make each layer wait for its weight).
                        defer_restore=not (self.is_fsdp_enabled or self._is_zero3 or self.args.torch_compile),
                        return_logprobs=True,
                    )
                    return completion_ids, logprobs
                except FastPathUnavailable as error:
                    reason = str(error)
        if reason not in self._fast_generation_fallbacks:  # say it once per reason, not every step
            self._fast_generation_fallbacks.add(reason)
            logger.warning("Fast generation is off for this batch (%s); using TRL's model.generate.", reason)
        return None

    shared_prefix_calls: int = 0  # log-prob computations served by the shared-prefix path
    _scored_logps: list[torch.Tensor] | None = None  # set by `_compute_loss` while it runs

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **model_inputs,
    ):  # fmt: skip
        if isinstance(model, AdaptersOff):  # the KL reference: the policy, its adapters off (`engine.adapters_off`)
            with model.switched_off() as policy:
                return self._get_per_token_logps_and_entropies(
                    policy, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **model_inputs,
                )  # fmt: skip
        # The ids the sampler never picks are out of the softmax, for the policy and the reference alike
        # (`vlm_grpo.blocked_tokens`): TRL's fused LM head, which every path below scores with, gives them 0.
        with scoring_as_sampled(self, model):
            result = self._logps_by_path(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                model_inputs,
            )  # fmt: skip
        if self._scored_logps is not None:  # inside `_compute_loss`: the policy's, kept for the sampler gap
            self._scored_logps.append(result[0])
        return result

    def _logps_by_path(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
        model_inputs,
    ):  # fmt: skip
        # Each group's prompt and images computed once (vlm_grpo.engine.shared_prefix), else TRL's per-row forward.
        rows = self._vision_rows
        if rows is not None:  # a batch with clips: its vision inputs (images too) come from the rows, not from TRL
            if len(rows) != input_ids.size(0):
                raise RuntimeError(f"{len(rows)} rows of vision inputs for a batch of {input_ids.size(0)} rows")
            model_inputs = {**model_inputs, **row_vision_inputs(rows, input_ids, logits_to_keep, self.processing_class)}
        if getattr(self.args, "shared_prefix", False):
            try:
                with self.accelerator.autocast():
                    logps, entropies = shared_prefix_logps(
                        model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                        compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                        unwrapped_model=self.accelerator.unwrap_model(model), **model_inputs,
                    )  # fmt: skip
                self.shared_prefix_calls += 1
                return logps, entropies, None
            except SharedPrefixUnsupported as error:
                fallbacks = self.__dict__.setdefault("shared_prefix_fallbacks", {})
                if str(error) not in fallbacks:
                    logger.warning("Shared-prefix scoring off for this call, using TRL's per-row forward: %s", error)
                fallbacks[str(error)] = fallbacks.get(str(error), 0) + 1
        if rows is not None:
            return self._per_row_logps_with_clips(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, **model_inputs,
        )  # fmt: skip

    def _per_row_logps_with_clips(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
    ):
        """TRL's per-row forward for a batch with clips: TRL's own method on each `batch_size` rows, its image inputs
        passed by name and its clips handed to the model beside them (`_WithInputs`)."""
        rows, size = self._vision_rows, input_ids.size(0)
        results = []
        for start in range(0, size, batch_size or size):
            end = min(start + (batch_size or size), size)
            inputs = row_vision_inputs(rows[start:end], input_ids[start:end], logits_to_keep, self.processing_class)
            clips = {k: inputs.pop(k) for k in VIDEO_KEYS if k in inputs}
            inputs.pop("num_videos")
            if "pixel_values" not in inputs:
                inputs.pop("num_images")
            result = super()._get_per_token_logps_and_entropies(
                _WithInputs(model, clips), input_ids[start:end], attention_mask[start:end], logits_to_keep,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **inputs,
            )  # fmt: skip
            results.append(result)
        logps = torch.cat([r[0] for r in results])
        entropies = torch.cat([r[1] for r in results]) if compute_entropy else None
        aux = torch.stack([r[2] for r in results]).mean() if compute_aux_loss else None
        return logps, entropies, aux

"""`VLMGRPOTrainer`: TRL's `GRPOTrainer` for vision-language models, as a list of overrides.

TRL already runs multimodal rollouts; this subclass overrides only these hooks, each calling the module that owns
its concern:
- `__init__`: the model (or its name), processor, media budgets, datasets and reward functions made ready
  (`vlm_grpo.training.inputs`); then the model's modes (`vlm_grpo.models.modes`: checkpointing as configured, requires-grad
  hooks so checkpointed vision LoRA trains), the blocked ids checked (`vlm_grpo.blocked_tokens`), a fresh adapter's KL
  reference without TRL's copy (`vlm_grpo.engine.adapters_off`), Qwen-VL vision towers attending in batched calls
  (`vlm_grpo.engine.vision_attention`), transformers' input-grads hook replaced rather than added to each time TRL
  switches checkpointing on (`vlm_grpo.models.hooks`), one progress bar (`vlm_grpo.training.callbacks.RewardProgressBar`), checkpoints
  following the umask (`vlm_grpo.files`), steps with a NaN / inf loss or gradient norm skipped
  (`vlm_grpo.training.nonfinite`), SIGTERM turned into a checkpoint and a stop (`vlm_grpo.training.preemption`). With `use_vllm`, vLLM's
  sampling settled before it loads (`vlm_grpo.engine.vllm_sampling`) and TRL's vLLM generation given vLLM's
  placeholder form and checked (`vlm_grpo.engine.vllm_rollouts`).
- `train`: refuses a TRL that cannot compute GRPO log-probs on this device (`vlm_grpo.compat`); `True` for
  `resume_from_checkpoint` is the newest *complete* checkpoint (`vlm_grpo.training.checkpoints`); dynamic sampling's prompt
  stream restarted; the layers' training forward compiled for the run (`vlm_grpo.engine.compiled_layers`); a run
  stopped by SIGTERM raises `TrainingPreempted` naming its checkpoint (`vlm_grpo.training.preemption`).
- `_save_checkpoint`: a write that fails (a full disk, the file-size limit) removes what it left incomplete and raises
  one line naming the path and the need (`vlm_grpo.training.checkpoint_writes`).
- `_get_grad_norm`: transformers' gradient norm, read by the non-finite guard before each optimizer step.
- `save_model` / `_load_from_checkpoint`: the model written under FSDP with sharded checkpoints (transformers writes
  nothing there), without transformers' bar inside the training bar; full weights resumed under the model's own names
  (`vlm_grpo.training.checkpoints.load_full_weights`).
- `_generate_and_score_completions`: each row's media loaded and fitted, string prompts made chat messages
  (`vlm_grpo.data.rows.prepare_row`); with `dynamic_sampling`, the batch built from rounds of these calls
  (`vlm_grpo.training.dynamic_sampling`); the fast path's importance sampling as TRL's for vLLM (`vlm_grpo.training.sampler_logprobs`).
- `_tokenize_prompts`: each distinct prompt processed once; a batch with clips processed here (TRL has no video path:
  `vlm_grpo.media.processing`), each row's vision inputs kept for the forward passes; an environment's image fields
  as the tensors TRL's tool loop takes (`vlm_grpo.tools.rollouts`).
- `_generate`: `[]` images for text-only rows (TRL's None breaks the processor); no images for a batch with clips (its
  forward would process them without them); unparsed tool calls logged (`vlm_grpo.tools.rollouts`); the fast path's
  decode memory freed after a tool rollout's last turn where `fast_generation_keep_decode_memory=False`.
- `_generate_single_turn`: inference mode while generating (`vlm_grpo.models.modes`); completions from the fast generator
  unless it cannot serve the call (`vlm_grpo.training.generation_route`: TRL's `model.generate`, the reason logged once).
- `_calculate_rewards`: rows reach the rewards in the dataset's own format (`vlm_grpo.data.rows.rows_for_rewards`), each
  marked where its prompt opened the thinking (`vlm_grpo.data.thinking`); the rewards kept for dynamic sampling; a
  failing reward's row named by its file and line where known; the rows for `evaluation.evaluate_with_tools`.
- `_get_per_token_logps_and_entropies`: the sampler's blocked ids out of the scored softmax, for the policy and the
  reference (`vlm_grpo.blocked_tokens`); each group's prompt and images computed once where the shared-prefix path
  serves (`vlm_grpo.training.scoring_route`), else TRL's per-row forward, with a batch's clips.
- `_compute_loss`: a batch's clips reach the log-probs; the gap between the loss's and the sampler's log-probs logged;
  the loss read by the non-finite guard.
Everything else (losses, GSPO, vLLM, logging, checkpointing) is TRL's own. The private TRL names touched here are
listed, with the signatures they were tested with, in `vlm_grpo.private_api`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from transformers import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from ..blocked_tokens import check_blocking_settings, scoring_as_sampled, suppress_token
from ..compat import check_trl_device_support, is_checkpointing, quiet_third_party_checkpointing_deprecations
from ..data.rows import add_image_sizes, name_failing_row, prepare_row, rows_for_rewards
from ..data.thinking import mark_thinking, prompts_open_thinking
from ..engine.adapters_off import AdaptersOff, is_fresh_lora, layers_to_switch
from ..engine.compile_cache import CompileCache
from ..engine.compiled_layers import CompiledLayers
from ..engine.generation_copy import GenerationCopy
from ..engine.vision_attention import pack_vision_attention
from ..engine.vllm_rollouts import attach_vllm, engine_settings
from ..engine.vllm_sampling import vllm_sampling
from ..families import core_model, find_family
from ..files import CheckpointModesCallback
from ..integrations.unsloth import maybe_patch_for_model
from ..media.images_once import images_processed_once
from ..media.processing import VISION_ROWS, holds_clips, tokenize_clip_prompts, tokenize_distinct
from ..models.hooks import enable_requires_grad_hooks, replace_stale_input_grads_hooks
from ..models.model_card import complete_model_card
from ..models.modes import apply_configured_checkpointing, checkpointing_off, generating
from ..private_api import merged_generation_config
from ..rewards.checks import RewardFunctionError
from ..tools.rollouts import fields_as_tensors, log_malformed_calls
from .callbacks import RewardProgressBar, library_bars_off
from .checkpoint_writes import writing_checkpoint
from .checkpoints import load_full_weights, newest_complete_checkpoint
from .config import VLMGRPOConfig
from .dynamic_sampling import DynamicSampler, DynamicSamplingState
from .gc_freeze import FreezeLongLived
from .generation_route import fast_generate, make_generator, prepare_generation_copy, uses_generation_copy
from .inputs import prepare_inputs
from .nonfinite import NonFiniteGuard
from .preemption import PreemptionCallback
from .sampler_logprobs import (
    log_batch_gap,
    log_masked_sequences,
    loss_as_vllm,
    mark_sampled,
    plain_turn_logprobs,
    sampled_as_vllm,
)
from .scoring_route import logps_by_path
from .unwrapped import unwrap_once

__all__ = ["VISION_ROWS", "VLMGRPOConfig", "VLMGRPOTrainer"]


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
            `{"bytes", "path"}` dicts, and / or `video` / `videos` clips. Other columns reach the reward functions as
            keyword arguments.
        processing_class: the processor; defaults to the one `FastBaseVisionModel` loaded with the model.
        **kwargs: passed to `trl.GRPOTrainer` (`peft_config`, `callbacks`, `optimizers`, ...).
    """

    shared_prefix_calls: int = 0  # log-prob computations served by the shared-prefix path
    _scored_logps: list[torch.Tensor] | None = None  # set by `_compute_loss` while it runs
    # Each row's vision inputs while a batch with clips is generated and scored (`_tokenize_prompts`) or trained on
    # (`_compute_loss`); None otherwise. `_get_per_token_logps_and_entropies` passes them to the model.
    _vision_rows: list[dict[str, Any]] | None = None
    # The last batch's rows, prompts and completions as the rewards got them (`_calculate_rewards`).
    _rewarded: tuple[list[dict[str, Any]], list[Any], list[Any]] | None = None

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
        ready = prepare_inputs(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, kwargs)
        self.pixel_budget, self.video_budget = ready.pixel_budget, ready.video_budget
        self.skipped_rows = ready.skipped_rows
        fresh_adapter = is_fresh_lora(ready.model)
        # vLLM's sampling settled (and refused where vLLM cannot apply it) before vLLM loads (`engine.vllm_sampling`).
        vllm = vllm_sampling(args, ready.model, ready.processing_class) if args.use_vllm else None
        if vllm is not None and ready.with_clips:
            raise ValueError("use_vllm=True with clips: TRL's vLLM path takes images only. Use the fast engine "
                             "(use_vllm=False, the default), which serves clips.")  # fmt: skip
        with (
            quiet_third_party_checkpointing_deprecations(),  # TRL (and PEFT, given a peft_config) read the old name
            engine_settings(ready.processing_class) if vllm is not None else contextlib.nullcontext(),
        ):
            super().__init__(
                model=ready.model, reward_funcs=ready.reward_funcs, args=args, train_dataset=ready.train_dataset,
                eval_dataset=ready.eval_dataset, processing_class=ready.processing_class, **kwargs,
            )  # fmt: skip
        unwrapped = self.accelerator.unwrap_model(self.model)
        if vllm is not None:  # prompts vLLM expands as the trainer did, checked; the blocked ids reach its sampling
            attach_vllm(self, vllm)
        if (ready.with_clips or self.tools) and vllm is None:  # as TRL blocks the image pad (vLLM: both, already):
            # a sampled video pad has no features behind it, in scoring (clips) or in the next turn's prompt (tools)
            suppress_token(self, getattr(unwrapped.config, "video_token_id", None))
        check_blocking_settings(merged_generation_config(core_model(unwrapped), self.generation_config))
        apply_configured_checkpointing(unwrapped, args)
        if fresh_adapter and "ref" in getattr(unwrapped, "peft_config", {}):  # TRL's copy of an identity adapter
            unwrapped.delete_adapter("ref")
            unwrapped.set_adapter("default")
        if is_checkpointing(unwrapped):
            enable_requires_grad_hooks(unwrapped)
        replace_stale_input_grads_hooks(unwrapped)  # TRL re-enables checkpointing every step: one hook, not one a step
        maybe_patch_for_model(unwrapped)  # no-op unless the model came from Unsloth
        if getattr(args, "packed_vision_attention", True):
            pack_vision_attention(unwrapped)
        if self.pop_callback(ProgressCallback) is not None:  # its bar, without a printed dict per log record
            self.add_callback(RewardProgressBar())
        self.add_callback(CheckpointModesCallback())
        self.nonfinite_guard = NonFiniteGuard(self)  # NaN / inf steps skipped, counted, the run stopped after a few
        self.preemption = PreemptionCallback()  # SIGTERM: a checkpoint and a stop at the end of the step
        self.fast_generator = make_generator(self)
        self.generation_copy = GenerationCopy()  # under FSDP2, what the fast generator decodes from (`train`)
        self._fast_generation_fallbacks: set[str] = set()
        # A fresh adapter's KL reference: the policy with its adapters off by their own flags, not PEFT's walks; TRL
        # hands it back to `_get_per_token_logps_and_entropies`.
        if self.beta != 0.0 and self.ref_model is None and (layers := layers_to_switch(unwrapped)) is not None:
            self.ref_model = AdaptersOff(lambda: self.model, layers)
        self.compile_cache = CompileCache.for_trainer(unwrapped, args)
        self.compiled_layers = CompiledLayers()
        self._compile_layers()
        # compile_cache saves what the steps compile, for the next run; gc_freeze spares the steps full collections
        self.gc_freeze = FreezeLongLived.as_configured(getattr(args, "gc_freeze", False), self.accelerator.device)
        for callback in (self.nonfinite_guard, self.preemption, self.compile_cache, self.gc_freeze, self.compiled_layers):  # fmt: skip
            self.add_callback(callback)
        sampling = getattr(args, "dynamic_sampling", False)
        self.dynamic_sampler = DynamicSampler(self, self._score_rollouts) if sampling else None
        if self.dynamic_sampler is not None:
            self.add_callback(DynamicSamplingState())  # carries its position into checkpoints

    def _compile_layers(self) -> None:
        # Compiled before accelerate shards the model (torchtitan's order): FSDP2 keeps each layer's modules, unsharding
        # their weights as the layer runs; FSDP1's flat parameters and DeepSpeed's partitions are not read through them.
        fsdp1 = self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2
        blocked_by = (
            "torch_compile compiles the whole model" if self.args.torch_compile
            else "sharded (FSDP1 / DeepSpeed) layers" if fsdp1 or self.is_deepspeed_enabled else None
        )  # fmt: skip
        a, unwrapped = self.args, self.accelerator.unwrap_model(self.model)
        folder = self.compile_cache.layers_folder()
        self.compiled_layers.attach_as_configured(unwrapped, a, blocked_by, folder, sharded=self.is_fsdp_enabled)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after checking this TRL can compute GRPO log-probs on this device.

        `resume_from_checkpoint=True` resumes from the newest *complete* checkpoint in `output_dir`
        (`vlm_grpo.training.checkpoints`), where transformers would take the newest one, even one cut short by a kill.
        """
        check_trl_device_support(self.accelerator.device, self.accelerator.unwrap_model(self.model))
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint to resume from in {self.args.output_dir}.")
        if self.dynamic_sampler is not None:
            self.dynamic_sampler.restart()
        if uses_generation_copy(self) and self.generation_copy.model is None:  # before accelerate shards the model
            prepare_generation_copy(self)
        self._compile_layers()  # for this run only: afterwards the model's own forwards, for whatever uses it next
        self.compile_cache.load(resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.gc_freeze.release()  # the collector gets back what the run froze, even after an error
            self.compiled_layers.detach()
        self.preemption.raise_if_stopped(self.args.output_dir, self.state.global_step)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, which also writes the model under FSDP with sharded checkpoints (transformers writes
        nothing there, its checkpoints hold the shards): outside checkpointing the weights (the adapter, for LoRA) are
        gathered and written as plain files; checkpoints without transformers' bar, inside the training bar. A
        collective: call it on every rank, as with any sharded model."""
        plugin = self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None
        if plugin is None or _internal_call or "FULL_STATE_DICT" in str(plugin.state_dict_type):
            # A checkpoint mid-training: transformers' "Writing model shards" bar would break into the training bar.
            with library_bars_off() if _internal_call else contextlib.nullcontext():
                return super().save_model(output_dir, _internal_call)
        self._save(output_dir or self.args.output_dir, state_dict=self.accelerator.get_state_dict(self.model))
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        unwrapped = self.accelerator.unwrap_model(self.model)
        with writing_checkpoint(checkpoint, self.args.output_dir, unwrapped, writes=self.args.should_save):
            super()._save_checkpoint(model, trial)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return self.nonfinite_guard.note_grad_norm(super()._get_grad_norm(model, grad_norm=grad_norm))

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: Any = None, model_dir: Any = None
    ):
        """TRL's model card, with a local base model named rather than `[None]` and a quick start that asks an image
        question of the kind trained on of `model_dir` (default: the checkpoint being saved) (`vlm_grpo.models.model_card`)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        complete_model_card(self, model_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # transformers reloads full weights under the names they were saved with, the Hub's (`model.layers.*`), not
        # the model's (`model.language_model.layers.*`): only the LM head would resume (transformers #43701). Sharded
        # models (loaded after `prepare`, by FSDP / DeepSpeed) and adapters load as transformers does.
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
        tools = self.environment_factories is not None  # image tools cut from the images as loaded (`vlm_grpo.tools`)
        inputs = [prepare_row(row, self.pixel_budget, self.video_budget, memo, keep_sources=tools) for row in inputs]
        inputs = add_image_sizes(inputs, self.processing_class)  # grounding rewards map boxes back
        self._vision_rows = None  # set by `_tokenize_prompts` for a batch with clips
        try:  # TRL's step reads transformers' old checkpointing name; its tool loop processes each image every turn
            with (quiet_third_party_checkpointing_deprecations(), sampled_as_vllm(self),
                  images_processed_once(self.processing_class, bool(self.tools))):  # fmt: skip
                output = super()._generate_and_score_completions(inputs)
            log_masked_sequences(self, output)  # a batch TRL's importance-sampling mask zeroed whole is said
            if self._vision_rows is not None:
                output[VISION_ROWS] = self._vision_rows
            return output
        finally:
            self._vision_rows = None
            self.fast_generator.finish_restore()  # base weights whole for whatever reads them next

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        # TRL passes the model only the inputs it knows by name; a batch's clips travel under VISION_ROWS.
        self._vision_rows = inputs.get(VISION_ROWS)
        self._scored_logps = []  # the policy's log-probs, for the sampler gap
        try:
            with loss_as_vllm(self, inputs):
                loss = super()._compute_loss(model, inputs)
        finally:
            self._vision_rows, scored, self._scored_logps = None, self._scored_logps, None
        log_batch_gap(self, inputs, scored[0] if scored else None)
        if model.training:  # evaluation's losses train nothing
            self.nonfinite_guard.note_loss(loss)
        return loss

    def _tokenize_prompts(self, prompts: list):
        if holds_clips(prompts):
            if self.tools or self.environment_factories is not None:
                raise ValueError("Clips in tool-calling rollouts are not supported: the tool loop re-enters TRL's "
                                 "image-only processing.")  # fmt: skip
            prompt_ids, media, fields, self._vision_rows = tokenize_clip_prompts(
                self.processing_class, prompts, chat_template=self.chat_template,
                template_kwargs=self.chat_template_kwargs,
            )  # fmt: skip
            return prompt_ids, media, fields
        if self.environment_factories is not None:  # each row renders its own environment's tools
            prompt_ids, images, fields = super()._tokenize_prompts(prompts)
            return prompt_ids, images, fields_as_tensors(fields)  # TRL's tool loop takes tensors (`tools.rollouts`)
        return tokenize_distinct(super()._tokenize_prompts, prompts, find_family(self.model))

    def _generate(self, prompts: list):
        # Unpacked by name, so a change in TRL's return fails here rather than patching the wrong element.
        self._rollout_has_logprobs = False  # set by a turn the fast path generates (`plain_turn_logprobs`)
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = (
            super()._generate(prompts)
        )
        mark_sampled(self, logprobs)
        self._opened_thinking = prompts_open_thinking(self.processing_class, prompt_ids)  # for `_calculate_rewards`
        if not (generator := self.fast_generator).keep_decode_memory and generator.append_turns:  # left to us
            generator.release()  # a tool rollout's turns kept their caches until now
        if self.tools:  # calls that did not parse: TRL counts them nowhere (`tools.rollouts`)
            log_malformed_calls(self, completions)
        if self._vision_rows is not None:
            images = None  # TRL would process the images without the clips; the rows carry both (`_vision_rows`)
        elif images is not None and any(images):
            # TRL marks a text-only row's images None (vLLM wants that); processors expect [] for "no image here".
            images = [[] if i is None else i for i in images]
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        def decode(ids: list[list[int]]) -> list[str]:
            return self.processing_class.batch_decode(ids, skip_special_tokens=True)

        rows, prompts, completions = rows_for_rewards(inputs, prompts, completions, completion_ids_list, decode)
        rows = mark_thinking(rows, self._opened_thinking)
        self._rewarded = (rows, prompts, completions)  # what `evaluation.evaluate_with_tools` scores
        try:
            self._last_rewards_per_func = super()._calculate_rewards(rows, prompts, completions, completion_ids_list)
        except RewardFunctionError as error:  # the row named by its file and line, where the dataset kept them
            name_failing_row(error, inputs)
            raise
        return self._last_rewards_per_func

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Inference mode while generating, then exactly the mode the model was in (`vlm_grpo.models.modes`).
        unwrapped, mode = unwrap_once(self, self.model), "train" if self.model.training else "eval"
        with generating(unwrapped):
            completions = fast_generate(self, prompt_ids, images, multimodal_fields, has_tool_images, mode)
            if completions is not None:
                self._rollout_has_logprobs = True
                return completions
            # TRL's generation switches checkpointing off and on again with the config's kwargs: off here first, so
            # it leaves it alone, and given back exactly as found after.
            with checkpointing_off(unwrapped):
                ids, logprobs = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            return ids, plain_turn_logprobs(self, ids, logprobs)

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
        # The ids the sampler never picks are out of the softmax: TRL's fused LM head, which every path scores with,
        # gives them 0.
        trl_scoring = super()._get_per_token_logps_and_entropies
        with scoring_as_sampled(self, model, unwrap_once(self, model)):
            result = logps_by_path(
                self, trl_scoring, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, model_inputs,
            )  # fmt: skip
        if self._scored_logps is not None:  # inside `_compute_loss`: the policy's, kept for the sampler gap
            self._scored_logps.append(result[0])
        return result

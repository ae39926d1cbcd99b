"""`VLMGRPOTrainer`: TRL's `GRPOTrainer` for vision-language models.

TRL already runs multimodal rollouts; this subclass adds what a VLM user needs around them and
overrides only four hooks:
- `__init__`: takes `(model, processor)` from `FastBaseVisionModel` (or a model id), validates the
  datasets (bad rows raise or are skipped before training), checks reward functions on every call,
  and registers the requires-grad hooks so checkpointed vision LoRA trains.
- `_generate_and_score_completions`: images loaded from any format, normalised and fitted to the pixel
  budget; plain-string prompts with images turned into chat messages.
- `_generate_single_turn`: the model switched to inference mode for generation and back after.
- `_generate`: text-only rows in a batch with images get `[]` images (TRL's None breaks the processor).
Everything else (losses, GSPO, vLLM, logging, checkpointing) is TRL's own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from .hooks import enable_requires_grad_hooks
from .integrations.unsloth import maybe_patch_for_model
from .model import FastBaseVisionModel, is_checkpointing
from .processor import load_processor
from .reward_checks import checked_reward_func
from .rows import check_dataset, prepare_row
from .shared_prefix import SharedPrefixUnsupported, shared_prefix_logps

__all__ = ["VLMGRPOConfig", "VLMGRPOTrainer"]

logger = logging.getLogger(__name__)


@dataclass
class VLMGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` with VLM defaults and the image pixel budget.

    Differences from TRL's defaults: `beta=0.04` (KL-regularised: the reference is the base model with
    the adapter disabled for PEFT models, so it costs no second copy of the weights); `bf16` chosen from
    the hardware (TRL's default of True fails on CPU); non-reentrant gradient checkpointing.
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
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default_factory=lambda: {"use_reentrant": False},
        metadata={"help": "Passed to `gradient_checkpointing_enable`. Non-reentrant is PyTorch's recommendation."},
    )
    min_pixels: int | None = field(
        default=None,
        metadata={"help": "Smallest image area (pixels) fed to the processor; smaller images are upscaled. None: the "
                  "budget given to FastBaseVisionModel.from_pretrained, else no lower bound."},
    )  # fmt: skip
    max_pixels: int | None = field(
        default=None,
        metadata={"help": "Largest image area (pixels) fed to the processor; larger images are downscaled, aspect "
                  "ratio kept. Bounds memory per image. None: the from_pretrained budget, else no bound."},
    )  # fmt: skip
    check_images: bool = field(
        default=True,
        metadata={"help": "Decode every dataset image once before training, so corrupt files surface up front."},
    )
    skip_bad_rows: bool = field(
        default=True,
        metadata={"help": "Drop rows whose images cannot be read (logged and counted in `trainer.skipped_rows`). "
                  "False: raise instead."},
    )  # fmt: skip
    shared_prefix: bool = field(
        default=True,
        metadata={"help": "Compute each group's prompt and images once when scoring and training (the G completions "
                  "of a prompt packed into one row that attends to it; same log-probs and gradients). Models or "
                  "settings it cannot serve (e.g. FlashAttention) fall back to TRL's per-row forward, logged once."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels}).")
        super().__post_init__()


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
        min_pixels, max_pixels = getattr(args, "min_pixels", None), getattr(args, "max_pixels", None)
        if isinstance(model, str):
            model, loaded_processor = FastBaseVisionModel.from_pretrained(
                model,
                full_finetuning=kwargs.get("peft_config") is None,
                use_gradient_checkpointing=args.gradient_checkpointing,
                min_pixels=min_pixels,
                max_pixels=max_pixels,
                **(args.model_init_kwargs or {}),
            )
            processing_class = processing_class or loaded_processor
        if processing_class is None:
            processing_class = getattr(model, "_vlm_grpo_processor", None) or load_processor(
                model.config._name_or_path, model.config.model_type
            )
        budget = getattr(processing_class, "_vlm_grpo_pixel_budget", (None, None))
        self.min_pixels = min_pixels if min_pixels is not None else budget[0]
        self.max_pixels = max_pixels if max_pixels is not None else budget[1]

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

        if reward_funcs is not None:
            reward_funcs = [checked_reward_func(f) for f in (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])]

        # TRL keeps a frozen copy of a passed-in adapter ("ref") as the KL reference, because the adapter might be
        # pretrained. A fresh LoRA adapter (every B zero) is the identity, so the base model with the adapter disabled
        # is the same reference without the copy's memory and compute.
        fresh_adapter = _is_fresh_lora(model)
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
        if fresh_adapter and "ref" in getattr(unwrapped, "peft_config", {}):
            unwrapped.delete_adapter("ref")
            unwrapped.set_adapter("default")
        if is_checkpointing(unwrapped):
            enable_requires_grad_hooks(unwrapped)
        maybe_patch_for_model(unwrapped)  # no-op unless the model came from Unsloth

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after checking this TRL can compute GRPO log-probs on this device."""
        _check_trl_device_support(self.accelerator.device)
        return super().train(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        inputs = [prepare_row(row, self.min_pixels, self.max_pixels) for row in inputs]
        return super()._generate_and_score_completions(inputs)

    def _generate(self, prompts: list):
        outputs = super()._generate(prompts)
        images = outputs[6]
        # TRL marks a text-only row's images as None; in a batch that also has images the processor then fails on
        # the None. An empty list is what processors expect for "no image in this row".
        if images is not None and any(i is None for i in images) and any(i for i in images):
            outputs = (*outputs[:6], [i if i is not None else [] for i in images], *outputs[7:])
        return outputs

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        checkpointing = is_checkpointing(model)
        FastBaseVisionModel.for_inference(model)
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            if was_training:
                reentrant = (self.args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False)
                mode = ("reentrant" if reentrant else True) if checkpointing else False
                FastBaseVisionModel.for_training(model, use_gradient_checkpointing=mode)

    shared_prefix_calls: int = 0  # log-prob computations served by the shared-prefix path

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **model_inputs,
    ):  # fmt: skip
        # Each group's prompt and images computed once (vlm_grpo.shared_prefix), else TRL's per-row forward.
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
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, **model_inputs,
        )  # fmt: skip

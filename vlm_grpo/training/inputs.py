"""What `VLMGRPOTrainer` is handed, made ready before TRL sees it.

A model given by name is loaded with `FastBaseVisionModel` (as TRL would load it, with `model_init_kwargs`), the
processor defaults to the one loaded with the model, the media budgets are put where they act, the datasets are
checked row by row (structural problems raise; rows with unreadable images or clips are dropped and counted), a model
with nothing to train is refused, every reward function is wrapped so a bad return names the function and the row, and
given tools, a processor whose chat template cannot render them gets one where the package has one
(`vlm_grpo.tools.templates`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ..compat import checkpointing_from_args
from ..data.rows import check_dataset
from ..media.checks import SkippedRows
from ..media.columns import video_column
from ..media.pixel_budget import PixelBudget, apply_pixel_budget
from ..media.processing import check_video_support, refuse_clip_settings
from ..media.processor import load_processor
from ..media.video_budget import VideoBudget, apply_video_budget
from ..models.loader import FastBaseVisionModel
from ..rewards.checks import checked_reward_func
from ..tools.templates import prepare_tool_template

__all__ = [
    "TrainerInputs",
    "model_init_kwargs",
    "prepare_inputs",
    "reference_on_host_under_fsdp",
    "refuse_frozen_model",
]

logger = logging.getLogger(__name__)


@dataclass
class TrainerInputs:
    """The trainer's arguments, ready for TRL (see the module docstring)."""

    model: Any
    processing_class: Any
    train_dataset: Any
    eval_dataset: Any
    reward_funcs: Any
    pixel_budget: PixelBudget
    video_budget: VideoBudget
    skipped_rows: dict[str, SkippedRows]
    with_clips: bool


def model_init_kwargs(args: Any, quantization_config: Any = None) -> dict[str, Any]:
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


def refuse_frozen_model(model: Any) -> None:
    """Raise when `model` has no trainable parameter: training would run with grad_norm 0 and change nothing."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "The model has no trainable parameters, so training would run with grad_norm 0 and change nothing. "
            "FastVisionModel.from_pretrained returns a frozen model until you choose what to train: add LoRA "
            "adapters with `model = FastVisionModel.get_peft_model(model, r=16, ...)`, or load it with "
            "`FastVisionModel.from_pretrained(..., full_finetuning=True)` to train all weights."
        )


def reference_on_host_under_fsdp(model: Any, args: Any, peft_config: Any) -> None:
    """Under FSDP, have TRL load a full fine-tune's KL reference with `device_map=None`.

    TRL builds that reference from `args.model_init_kwargs` and resets `device_map` to None only under DDP and
    DeepSpeed; under FSDP its default `"auto"` puts every rank's whole reference on the first GPUs (the 7B full
    fine-tune on four H100s died there before its first step). Loaded on the host, `prepare_fsdp` moves each rank's
    shard to its own GPU. A `device_map` the user set is kept."""
    from accelerate.utils import is_peft_model  # TRL's own test for "the adapters off serve as the reference"

    if getattr(args, "beta", 0.0) == 0.0 or peft_config is not None or is_peft_model(model):
        return  # no reference model, or the adapters switched off serve as it
    # Before the trainer's Accelerator exists, FSDP shows only in the launcher's environment or the config's `fsdp`
    # (the state TRL reads says FSDP once the Accelerator is made, hence TRL's "auto").
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" and not getattr(args, "fsdp", None):
        return
    init_kwargs = dict(args.model_init_kwargs or {})
    if "device_map" in init_kwargs:
        return
    args.model_init_kwargs = {**init_kwargs, "device_map": None}
    logger.warning("FSDP: TRL's KL reference loads on the host and is sharded to each rank (device_map=None); TRL's "
                "note that model_init_kwargs is ignored is about the policy, which was already loaded.")  # fmt: skip


def _checked_datasets(
    train: Any, evaluation: Any, args: Any, pixel_budget: PixelBudget
) -> tuple[Any, Any, dict[str, SkippedRows]]:
    options = {
        "check_images": getattr(args, "check_images", True),
        "skip_bad_rows": getattr(args, "skip_bad_rows", True),
        "pixel_budget": pixel_budget,  # an image the processor would refuse is skipped now, not met at a batch
    }
    train, skipped = check_dataset(train, "train_dataset", **options)
    skipped_rows = {"train": skipped}
    if isinstance(evaluation, dict):
        checked = {}
        for split, dataset in evaluation.items():
            checked[split], skipped_rows[f"eval_{split}"] = check_dataset(
                dataset, f"eval_dataset[{split!r}]", **options
            )
        return train, checked, skipped_rows
    evaluation, skipped_rows["eval"] = check_dataset(evaluation, "eval_dataset", **options)
    return train, evaluation, skipped_rows


def prepare_inputs(
    model: Any,
    reward_funcs: Any,
    args: Any,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    kwargs: dict[str, Any],
) -> TrainerInputs:
    """The trainer's arguments made ready (see the module docstring); `kwargs` are the trainer's keyword arguments for
    TRL (its `quantization_config` is taken out of them for a model given by name)."""
    if isinstance(model, str):
        model, loaded_processor = FastBaseVisionModel.from_pretrained(
            model,
            full_finetuning=kwargs.get("peft_config") is None,
            use_gradient_checkpointing=checkpointing_from_args(args)[0],
            **model_init_kwargs(args, kwargs.pop("quantization_config", None)),
        )
        processing_class = processing_class or loaded_processor
    if processing_class is None:
        processing_class = getattr(model, "_vlm_grpo_processor", None) or load_processor(
            model.config._name_or_path, model.config.model_type
        )
    prepare_tool_template(processing_class, model, kwargs)  # before TRL checks the template renders tools
    # The processor's own budget (Qwen-VL), overwritten by the config's where it sets one; else the config's.
    pixel_budget = apply_pixel_budget(
        processing_class, getattr(args, "min_pixels", None), getattr(args, "max_pixels", None)
    )
    video_budget = apply_video_budget(
        processing_class, fps=getattr(args, "video_fps", None), max_frames=getattr(args, "video_max_frames", None),
        num_frames=getattr(args, "video_num_frames", None), min_pixels=getattr(args, "video_min_pixels", None),
        max_pixels=getattr(args, "video_max_pixels", None),
    )  # fmt: skip
    datasets = [train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])]
    with_clips = any(video_column(getattr(d, "column_names", None) or []) for d in datasets if d is not None)
    if with_clips:
        check_video_support(processing_class, model)
        refuse_clip_settings(args, kwargs)
    train_dataset, eval_dataset, skipped_rows = _checked_datasets(train_dataset, eval_dataset, args, pixel_budget)
    if kwargs.get("peft_config") is None:  # else TRL adds the trainable adapters
        refuse_frozen_model(model)
    reference_on_host_under_fsdp(model, args, kwargs.get("peft_config"))
    if reward_funcs is not None:
        reward_funcs = [
            checked_reward_func(f) for f in (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
        ]
    return TrainerInputs(model, processing_class, train_dataset, eval_dataset, reward_funcs, pixel_budget, video_budget,
                         skipped_rows, with_clips)  # fmt: skip

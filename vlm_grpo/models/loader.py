"""`FastBaseVisionModel`: load a vision-language model, add LoRA where you mean it, switch modes, export.

Unsloth's `FastVisionModel` API shape, built on transformers + peft only:

    model, processor = FastVisionModel.from_pretrained("Qwen/Qwen2.5-VL-3B-Instruct", load_in_4bit=True)
    model = FastVisionModel.get_peft_model(model, r=16, finetune_vision_layers=False)
    FastVisionModel.for_inference(model)   # generate
    FastVisionModel.for_training(model)    # train
    FastVisionModel.save_pretrained_merged(model, processor, "merged")
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import torch
from torch import nn

from ..compat import quiet_third_party_checkpointing_deprecations
from ..families import projector_names
from ..media.pixel_budget import check_pixel_budget, set_processor_pixel_budget
from ..media.processor import load_processor
from ..third_party_logs import library_bars_off
from ..validation import is_int
from . import modes
from .adapters import adapter_base, attach_adapter
from .hooks import VISION_TOWER_NAMES
from .lora_selection import LoraSelection, expert_parameters, select_lora_modules

__all__ = ["FastBaseVisionModel", "FastVisionModel", "LoraSelection", "check_quantization", "select_lora_modules"]


def _is_linear(module: nn.Module) -> bool:
    # bitsandbytes' Linear4bit / Linear8bitLt subclass nn.Linear, so quantised layers are found too.
    return isinstance(module, nn.Linear)


def _looks_like_local_path(name: str) -> bool:
    # A Hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper nesting) is meant as a path.
    return name.startswith((os.sep, ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _default_dtype() -> torch.dtype:
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    """A torch dtype from a dtype or its name; "auto" (the checkpoint's own dtype) is left to transformers."""
    if dtype is None:
        return _default_dtype()
    if dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if isinstance(resolved, torch.dtype):
        return resolved
    raise ValueError(f"dtype must be a torch dtype, its name (e.g. 'bfloat16') or 'auto', got {dtype!r}.")


def check_quantization(load_in_4bit: bool, load_in_8bit: bool) -> None:
    """Raise unless the requested quantisation can load here: not both, bitsandbytes installed, and a CUDA GPU or
    bitsandbytes' CPU backend (`ValueError`, `ImportError`, `RuntimeError`; the message names the fix)."""
    if not (load_in_4bit or load_in_8bit):
        return
    if load_in_4bit and load_in_8bit:
        raise ValueError("Choose one of load_in_4bit=True or load_in_8bit=True, not both.")
    bits = "4-bit" if load_in_4bit else "8-bit"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"{bits} loading needs bitsandbytes: `pip install 'vlm-grpo[quant]'` (or `pip install bitsandbytes`)."
        ) from error
    if not torch.cuda.is_available() and not _bitsandbytes_runs_on_cpu():
        raise RuntimeError(
            f"{bits} loading needs a CUDA GPU, or bitsandbytes >= 0.46 with its CPU backend, and neither is here. "
            "Load in 16/32-bit instead (load_in_4bit=False, load_in_8bit=False), upgrade bitsandbytes, or run on a GPU."
        )


def _bitsandbytes_runs_on_cpu() -> bool:
    """Whether this bitsandbytes quantises on the CPU (its multi-backend releases do; older ones are CUDA-only)."""
    from bitsandbytes.functional import quantize_4bit

    try:
        quantize_4bit(torch.ones(64))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    return True


def _one_attention_implementation(model: nn.Module) -> None:
    """Eager attention for the whole model where transformers chose sdpa for it but its text model has none (PaliGemma
    2's Gemma 2 under transformers 5.2x). TRL reloads a full fine-tune's KL reference with the model's top-level
    setting, and Gemma 2 refuses sdpa with a ValueError there."""
    top = getattr(model.config, "_attn_implementation", None)
    text = getattr(model.config.get_text_config(), "_attn_implementation", None)
    if top == "sdpa" and text == "eager":
        model.set_attn_implementation("eager")


class FastBaseVisionModel:
    """Load, adapt, switch and export vision-language models (static methods, Unsloth's names)."""

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int | None = None,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        full_finetuning: bool = False,
        use_gradient_checkpointing: bool | str = True,
        device_map: str | dict | None = None,
        trust_remote_code: bool = False,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> tuple[nn.Module, Any]:
        """Load a VLM and its processor: `(model, processor)`.

        Args:
            model_name: a Hub id (`Qwen/Qwen2.5-VL-3B-Instruct`), a local checkpoint directory, or a saved LoRA
                adapter folder (its base model loaded, then the adapter, trainable: `vlm_grpo.models.adapters`).
            max_seq_length: accepted for compatibility with Unsloth's `from_pretrained` and has no effect: a
                transformers model has no fixed context to set. Bound lengths with `VLMGRPOConfig`'s
                `max_completion_length` (and the pixel budget, which bounds the image tokens of a prompt).
            dtype: None picks bf16 on a GPU that supports it, else fp16 on GPU, else fp32 on CPU; "auto" keeps the
                checkpoint's own dtype (transformers' meaning).
            load_in_4bit / load_in_8bit: bitsandbytes quantisation of the language model (NF4 with double
                quantisation for 4-bit). The vision tower, projector and lm_head stay in `dtype`.
            full_finetuning: train every weight (no LoRA); gradient checkpointing is set up here then.
            use_gradient_checkpointing: True / "unsloth" (non-reentrant), "reentrant", or False; applied by
                `get_peft_model` (or here with `full_finetuning`).
            device_map: passed to transformers; None puts the model on the first GPU when there is one.
            min_pixels / max_pixels: the image pixel budget of a processor that resizes by one (Qwen2/2.5/3-VL),
                written into its `image_processor.size` as `AutoProcessor.from_pretrained(..., min_pixels=...,
                max_pixels=...)` does; None keeps the checkpoint's value. Processors without a budget (Gemma 3,
                Idefics3) raise ValueError rather than drop it: give those a budget with `VLMGRPOConfig(min_pixels=,
                max_pixels=)` and `evaluate(...)`. See `vlm_grpo.media.pixel_budget`.
            attn_implementation: "eager", "sdpa", "flash_attention_2"...; None lets transformers choose.
            **kwargs: passed to `AutoModelForImageTextToText.from_pretrained` (e.g. `revision`, `token`). Hub
                kernels stay off unless `use_kernels=True` or a `kernel_config` is passed: transformers >= 5.25 turns
                them on by default, which fetches kernels from the Hub at load and swaps layers' forwards at every
                switch between training and generation; the engine's numbers are measured without them.
        """
        from transformers import AutoConfig, AutoModelForImageTextToText

        if _looks_like_local_path(model_name) and not os.path.exists(os.path.expanduser(model_name)):
            raise FileNotFoundError(
                f"Model path {model_name!r} does not exist. Pass an existing checkpoint directory or a Hub id "
                "such as 'Qwen/Qwen2.5-VL-3B-Instruct'."
            )
        model_name = os.path.expanduser(model_name)
        if (base := adapter_base(model_name)) is not None:  # a saved LoRA adapter: its base, then the adapter
            if full_finetuning:
                raise ValueError(f"{model_name!r} is a LoRA adapter: merge it (save_pretrained_merged) to full-tune.")
            model, processor = FastBaseVisionModel.from_pretrained(
                base, max_seq_length, dtype, load_in_4bit, load_in_8bit, False, use_gradient_checkpointing,
                device_map, trust_remote_code, min_pixels, max_pixels, attn_implementation, **kwargs,
            )  # fmt: skip
            return attach_adapter(model, model_name, use_gradient_checkpointing), processor
        if os.path.isdir(model_name) and not os.path.exists(os.path.join(model_name, "config.json")):
            raise FileNotFoundError(
                f"{model_name!r} has no config.json, so it is not a transformers checkpoint. Point at the directory "
                "that `save_pretrained` wrote (it holds config.json and the weights)."
            )
        if kwargs.get("quantization_config") is not None and (load_in_4bit or load_in_8bit):
            raise ValueError("Pass either quantization_config or load_in_4bit / load_in_8bit, not both.")
        check_quantization(load_in_4bit, load_in_8bit)
        if full_finetuning and (load_in_4bit or load_in_8bit or kwargs.get("quantization_config") is not None):
            raise ValueError(
                "full_finetuning needs 16/32-bit weights: drop load_in_4bit / load_in_8bit / quantization_config, or "
                "use LoRA (FastVisionModel.get_peft_model, or a `peft_config` for VLMGRPOTrainer)."
            )
        modes.checkpointing_kwargs(use_gradient_checkpointing)  # validate early
        check_pixel_budget(min_pixels, max_pixels)
        hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}

        config = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code, **hub_kwargs)
        if getattr(config, "vision_config", None) is None:
            raise ValueError(
                f"{model_name!r} is a {config.model_type!r} model without a vision encoder, not a vision-language "
                "model. Pass a VLM checkpoint (Qwen2/2.5/3-VL, Gemma 3, SmolVLM/Idefics3, ...); for text-only "
                "models use trl.GRPOTrainer directly."
            )
        dtype = _resolve_dtype(dtype)
        load_kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
        load_kwargs.setdefault("use_kernels", load_kwargs.get("kernel_config") is not None)  # 5.25's default is on
        if attn_implementation is not None:
            load_kwargs["attn_implementation"] = attn_implementation
        if device_map is None and torch.cuda.is_available():
            # One whole model per process: under DDP (accelerate/torchrun) each rank takes its own GPU.
            device_map = {"": int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))}
        if device_map is not None:
            load_kwargs["device_map"] = device_map
        if load_in_4bit or load_in_8bit:
            compute_dtype = _default_dtype() if dtype == "auto" else dtype
            load_kwargs["quantization_config"] = _bnb_config(config, load_in_4bit, compute_dtype)

        # The processor first: it is cheap, and a pixel budget it cannot keep is refused before GBs of weights load.
        processor = load_processor(model_name, config.model_type, trust_remote_code=trust_remote_code, **hub_kwargs)
        set_processor_pixel_budget(processor, min_pixels, max_pixels)
        # A local folder loads in moments: its "Loading weights" bar is noise. A Hub download keeps its bars.
        with library_bars_off() if os.path.isdir(model_name) else contextlib.nullcontext():
            model = AutoModelForImageTextToText.from_pretrained(model_name, **load_kwargs)
        if attn_implementation is None:
            _one_attention_implementation(model)

        object.__setattr__(model, "_vlm_grpo_processor", processor)
        if full_finetuning:
            model.requires_grad_(True)
            FastBaseVisionModel.for_training(model, use_gradient_checkpointing)
        else:
            # Like Unsloth: frozen until get_peft_model, so a forgotten adapter never full-tunes by accident
            # (VLMGRPOTrainer refuses a model with nothing trainable, naming both fixes).
            model.requires_grad_(False)
            model.eval()
        return model, processor

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        r: int = 16,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: list[str] | str | None = None,
        finetune_vision_layers: bool = True,
        finetune_language_layers: bool = True,
        finetune_attention_modules: bool = True,
        finetune_mlp_modules: bool = True,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = True,
        random_state: int = 3407,
        use_rslora: bool = False,
        modules_to_save: list[str] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Add LoRA adapters and return the `PeftModel`.

        The four `finetune_*` flags choose the Linear layers (see `LoraSelection`); an explicit
        `target_modules` (list of names/suffixes, a regex, or "all-linear") overrides them. Quantised
        models are prepared for k-bit training; gradient checkpointing and the requires-grad hooks
        are switched on. `**kwargs` reach `peft.LoraConfig` (e.g. `init_lora_weights`, `use_dora`).
        """
        from peft import LoraConfig, PeftModel, get_peft_model

        if isinstance(model, PeftModel):
            raise TypeError("This model already has LoRA adapters; call get_peft_model on the base model once.")
        if not is_int(r):
            raise TypeError(f"LoRA rank r must be a positive integer, got {r!r}.")
        if r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}.")
        if lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be positive, got {lora_alpha!r}.")
        if not 0.0 <= lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}.")
        modes.checkpointing_kwargs(use_gradient_checkpointing)

        if target_modules is None:
            selection = LoraSelection(
                finetune_vision_layers=finetune_vision_layers,
                finetune_language_layers=finetune_language_layers,
                finetune_attention_modules=finetune_attention_modules,
                finetune_mlp_modules=finetune_mlp_modules,
            )
            names = selection.modules(model)
            if not names:
                raise ValueError(f"The finetune_* flags select no Linear layer in {type(model).__name__}.")
            # An anchored regex of exact names: PEFT's suffix matching could otherwise catch a same-named layer elsewhere.
            target: list[str] | str = "^(" + "|".join(re.escape(n) for n in names) + ")$"
            experts = expert_parameters(model, selection)
            if experts and "target_parameters" not in kwargs:  # routed experts held in fused 3-D weights
                kwargs["target_parameters"] = experts
        else:
            target = _check_target_modules(model, target_modules)

        torch.manual_seed(random_state)
        # k-bit preparation: PEFT freezes the base weights and `for_training` below adds checkpointing and the
        # input-grad hooks. peft.prepare_model_for_kbit_training would also upcast every 16-bit weight (vision
        # tower included) to fp32, which costs GBs on a 7B model for no accuracy gain with bf16 compute.
        config = LoraConfig(
            r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target, bias=bias,
            use_rslora=use_rslora, modules_to_save=modules_to_save, task_type="CAUSAL_LM", **kwargs,
        )  # fmt: skip
        with quiet_third_party_checkpointing_deprecations():  # PEFT reads transformers' old checkpointing name
            peft_model = get_peft_model(model, config)
        if hasattr(model, "_vlm_grpo_processor"):
            object.__setattr__(peft_model, "_vlm_grpo_processor", model._vlm_grpo_processor)
        FastBaseVisionModel.for_training(peft_model, use_gradient_checkpointing)
        return peft_model

    # Mode switching lives in `vlm_grpo.models.modes` (one owner); these are Unsloth's names for it.
    for_inference = staticmethod(modes.for_inference)
    for_training = staticmethod(modes.for_training)

    @staticmethod
    def save_pretrained_merged(
        model: nn.Module, processor: Any, save_directory: str | os.PathLike, dtype: torch.dtype = torch.float16
    ) -> str:
        """Write a standalone 16-bit checkpoint with the LoRA weights merged in; return its path.

        Works for 16/32-bit and bitsandbytes 4/8-bit bases (dequantised first), and for FSDP2 / ZeRO-3 sharded
        models (call it on every rank; rank 0 writes). Written by transformers' `save_pretrained` (its checkpoint
        format, shards, config) with the processor alongside. The model itself is left untouched (adapters stay,
        training can go on). The directory is written to a temporary sibling
        and renamed into place, so an interrupted save never leaves a half-written checkpoint.
        """
        from .export import merged_state_dict, write_checkpoint
        from .sharded import full_weights, is_main_process

        # A sharded (FSDP2 / ZeRO-3) model is gathered on every rank (a collective: call this on all ranks);
        # rank 0 merges and writes, the others wait for the directory to be in place.
        # Written inside the block: a CPU state dict of gathered weights may share their memory, freed on exit.
        path = os.path.abspath(os.fspath(save_directory))
        with full_weights(model):
            if is_main_process():
                path = write_checkpoint(model, processor, merged_state_dict(model, dtype), save_directory, dtype)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return path


FastVisionModel = FastBaseVisionModel


# The vision encoders (the names the hooks look for) and the projectors that feed them to the language model (the
# family records', `vlm_grpo.families`).
_KEEP_16BIT = (*VISION_TOWER_NAMES, *projector_names())


def _unquantised_modules(config: Any) -> list[str]:
    """Full names of the modules bitsandbytes must skip: vision tower, projector and lm_head.

    Found on a meta-device copy of the model (no memory), because transformers matches skip patterns from the
    start of a module's name (5.x) or as substrings (4.x): exact full names work with both.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText

    with init_empty_weights():
        skeleton = AutoModelForImageTextToText.from_config(config)
    names = ["lm_head"]
    for name, _ in skeleton.named_modules():
        if name.rsplit(".", 1)[-1] in _KEEP_16BIT and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def _bnb_config(config: Any, load_in_4bit: bool, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    # Quantising the vision tower hurts accuracy for little memory (it is small), and lm_head is the
    # precision-critical output layer: Unsloth and the Qwen-VL QLoRA recipes both keep them in 16-bit.
    skip = _unquantised_modules(config)
    if load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=skip,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def _check_target_modules(model: nn.Module, target_modules: list[str] | str) -> list[str] | str:
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return target_modules
        if not any(re.fullmatch(target_modules, n) for n, m in model.named_modules() if _is_linear(m)):
            raise ValueError(
                f"target_modules regex {target_modules!r} matches no Linear layer of {type(model).__name__}. "
                "Check the names with `[n for n, m in model.named_modules()]`."
            )
        return target_modules
    target_modules = list(target_modules)
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"target_modules {missing} match no module of {type(model).__name__}. Use module names or suffixes "
            "such as 'q_proj', or leave target_modules=None and choose layers with the finetune_* flags."
        )
    return target_modules

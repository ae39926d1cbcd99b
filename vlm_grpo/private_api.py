"""Every private TRL and transformers API vlm-grpo touches, in one place, with the versions it was tested on.

The fast paths reuse transformers' generation helpers and TRL's trainer hooks rather than copying them, which ties
the package to names outside their libraries' public API. Those names move between releases (TRL's
`_generate_single_turn` gained two parameters between 1.10 and 1.16), and a moved one used to surface as a failed
training run. So here, and only here:
- `OVERRIDDEN`: the TRL methods `VLMGRPOTrainer` overrides, with the parameters TRL calls them with;
- `CALLED`: the transformers methods the engine calls, with the parameters it passes;
- `CHECKPOINT_LOADING`: the transformers function resuming a checkpoint calls (`vlm_grpo.training.checkpoints`);
- `TOOL_LOOP`: the TRL method that tokenizes a tool turn, which the tool warm start runs (`tool_suffix_ids`);
- `TRAINER_ATTRIBUTES`: the TRL trainer attributes the trainer reads (read plainly, never `getattr(..., default)`,
  so a rename raises instead of silently reading the default);
- `FUSED_LM_HEAD_KEYWORDS`: what TRL's fused LM head adds to a model's forward, which shared-prefix scoring passes;
- the wrappers the engine calls (`prepare_generation`, `logits_processors`, `generation_position_ids`), and
  `tool_suffix_ids`, TRL's tokenization of a tool turn for the tool warm start.
`tests/test_private_api.py` checks each signature and attribute against the installed libraries: a release that
changes one fails a unit test that names it. `TESTED` records the releases these were read from.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CALLED",
    "CHECKPOINT_LOADING",
    "FUSED_LM_HEAD_KEYWORDS",
    "OVERRIDDEN",
    "TESTED",
    "TOOL_LOOP",
    "TRAINER_ATTRIBUTES",
    "PrivateMethod",
    "can_generate_fast",
    "eos_tokens",
    "generation_position_ids",
    "logits_processors",
    "merged_generation_config",
    "prepare_generation",
    "signature_drift",
    "tool_suffix_ids",
]

# The releases the lists below were read from: the floors in setup.cfg and the newest at the time.
TESTED = {"trl": ("1.15.0", "1.16.0"), "transformers": ("5.17.0", "5.24.0")}


@dataclass(frozen=True)
class PrivateMethod:
    """A private method of another library: the class that owns it, its name, and its parameters after `self`."""

    owner: str  # "module:Class", or "module" for a module-level function
    name: str
    parameters: tuple[str, ...]
    used_by: str

    def installed_parameters(self) -> tuple[str, ...]:
        """The parameters (after `self`, for a method) of the installed library's method or function."""
        module, _, cls = self.owner.partition(":")
        owner = importlib.import_module(module)
        method = getattr(getattr(owner, cls) if cls else owner, self.name)
        return tuple(inspect.signature(method).parameters)[1 if cls else 0 :]


_GRPO = "trl:GRPOTrainer"
_VLLM = "trl.generation.vllm_generation:VLLMGeneration"  # its attributes `mode`, `llm`, `_dist`, `generation_kwargs`
_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")  # fmt: skip
# fmt: off
OVERRIDDEN: tuple[PrivateMethod, ...] = (
    PrivateMethod(_GRPO, "_generate_and_score_completions", ("inputs",), "trainer: images normalised and budgeted"),
    PrivateMethod(_GRPO, "_generate", ("prompts",), "trainer: [] images for text rows (unpacks an 8-tuple by name)"),
    PrivateMethod(_GRPO, "_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list"),
                  "trainer: string prompts reach rewards as strings"),
    PrivateMethod(_GRPO, "_generate_single_turn",
                  ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
                  "trainer: engine.fast_generation"),
    PrivateMethod(_GRPO, "_get_per_token_logps_and_entropies",
                  ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                   "compute_aux_loss", *_MULTIMODAL_INPUTS), "trainer: engine.shared_prefix"),
    PrivateMethod(_GRPO, "_tokenize_prompts", ("prompts",), "trainer: prompts processed once per group; clips"),
    PrivateMethod(_GRPO, "_compute_loss", ("model", "inputs"), "trainer: a batch's clips reach the log-probs"),
    PrivateMethod("transformers:Trainer", "_load_from_checkpoint", ("resume_from_checkpoint", "model"),
                  "trainer: full weights resumed under the model's names (checkpoints.load_full_weights)"),
    PrivateMethod("transformers:Trainer", "_save_checkpoint", ("model", "trial"),
                  "trainer: a failed write named, the incomplete checkpoint removed (checkpoint_writes)"),
    PrivateMethod("transformers:Trainer", "_get_grad_norm", ("model", "grad_norm"),
                  "trainer: the norm the non-finite guard checks before each optimizer step (nonfinite)"),
    PrivateMethod(_VLLM, "generate", ("prompts", "images", "num_generations", "profiler"),
                  "engine.vllm_rollouts: placeholder runs collapsed for vLLM, its expansion checked"),
    PrivateMethod(_VLLM, "sync_weights", (), "engine.vllm_rollouts: vLLM's encoder cache emptied after"),
    PrivateMethod(_VLLM, "_iter_named_params", (), "engine.vllm_rollouts: LoRA merged out of place"),
)
_GENERATION = "transformers:GenerationMixin"
CALLED: tuple[PrivateMethod, ...] = (
    PrivateMethod(_GENERATION, "_prepare_generation_config", ("generation_config", "kwargs"),
                  "prepare_generation, merged_generation_config"),
    PrivateMethod(_GENERATION, "_prepare_special_tokens",
                  ("generation_config", "kwargs_has_attention_mask", "device", "batch_size"), "prepare_generation"),
    PrivateMethod(_GENERATION, "_get_logits_processor",
                  ("generation_config", "input_ids_seq_length", "encoder_input_ids", "prefix_allowed_tokens_fn",
                   "logits_processor", "device", "model_kwargs", "negative_prompt_ids",
                   "negative_prompt_attention_mask"), "logits_processors"),
    PrivateMethod(_GENERATION, "_prepare_position_ids_for_generation", ("inputs_tensor", "model_kwargs"),
                  "generation_position_ids"),
)
# The TRL method `tool_suffix_ids` runs (not an override: called unbound, for a processor, without a trainer).
TOOL_LOOP: tuple[PrivateMethod, ...] = (
    PrivateMethod(_GRPO, "_get_tool_suffix_ids", ("tool_messages",),
                  "tool_suffix_ids: a warm-start trace's tool turn tokenized as TRL's tool loop tokenizes it"),
)
# transformers' internals the checkpoint code calls (module-level functions).
CHECKPOINT_LOADING: tuple[PrivateMethod, ...] = (
    PrivateMethod("transformers.core_model_loading", "revert_weight_conversion", ("model", "state_dict"),
                  "checkpoints.load_full_weights: the saved names of the model's weights"),
)
# fmt: on
TRAINER_ATTRIBUTES = (
    "_tokenizer",
    "_logs",
    "use_vllm",
    "use_transformers_continuous_batching",
    "tools",
    "environment_factories",
    "generation_config",
    "generation_kwargs",
    "num_generations",  # dynamic_sampling: group size, reward weights, metrics, micro-step and dataset order
    "reward_weights",
    "multi_objective_aggregation",  # dynamic_sampling: which rewards' spread gives a group advantages
    "reward_func_names",  # nonfinite: which reward's values overflow float32
    "_metrics",  # nonfinite: the count of skipped steps in the training records
    "_step",
    "shuffle_dataset",
    "num_iterations",
    "chat_template",
    "chat_template_kwargs",
    "beta",  # adapters_off: a fresh adapter's reference is the policy, its adapters off, set as TRL's ref_model
    "ref_model",
    "_image_pad_token_id",  # generation_route: a tool turn's image tokens marked as TRL's plain path marks them
    "_video_pad_token_id",
)  # fmt: skip
FUSED_LM_HEAD_KEYWORDS = ("fused_lm_head", "shift_labels")


def signature_drift(
    methods: tuple[PrivateMethod, ...] = (*OVERRIDDEN, *CALLED, *CHECKPOINT_LOADING, *TOOL_LOOP),
) -> list[str]:
    """Each of `methods` whose installed parameters differ from the tested ones, as one line naming it."""
    drift = []
    for method in methods:
        try:
            found = method.installed_parameters()
        except AttributeError:
            drift.append(f"{method.owner}.{method.name}: gone (used by {method.used_by})")
            continue
        if found != method.parameters:
            drift.append(f"{method.owner}.{method.name}: tested with {method.parameters}, installed has {found} "
                         f"(used by {method.used_by})")  # fmt: skip
    return drift


def prepare_generation(model: Any, generation_config: Any, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """`(config, model_kwargs)` as `generate` prepares them: the model's defaults merged into `generation_config`,
    special tokens (`config._eos_token_tensor`) on `device`."""
    config, model_kwargs = model._prepare_generation_config(generation_config)
    model._prepare_special_tokens(config, True, device=device)
    return config, model_kwargs


def tool_suffix_ids(processor: Any, tool_messages: list[dict[str, Any]],
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
    """The tokens TRL's tool loop appends after a completion that called tools: `tool_messages` (the tool turn, its
    images' tokens expanded) and the next generation prompt, from TRL's own `GRPOTrainer._get_tool_suffix_ids` run
    for `processor` (its template, with the trainer's `chat_template_kwargs`) rather than a copy of it."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    tokenizer = getattr(processor, "tokenizer", processor)
    trainer = SimpleNamespace(processing_class=processor, chat_template=None,
                              chat_template_kwargs=dict(chat_template_kwargs or {}), _is_vlm=tokenizer is not processor,
                              _tokenizer=tokenizer)  # fmt: skip
    return list(GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages))


def merged_generation_config(model: Any, generation_config: Any) -> Any:
    """`generation_config` with the model's own generation defaults filled in where it leaves a field unset: the
    settings `generate` (and the fast path, through `prepare_generation`) samples with."""
    return model._prepare_generation_config(generation_config)[0]


def eos_tokens(config: Any) -> torch.Tensor:
    """The EOS token ids `prepare_generation` put on the device."""
    return config._eos_token_tensor


def logits_processors(
    model: Any, config: Any, prompt_tokens: torch.Tensor, device: torch.device, model_kwargs: dict[str, Any]
) -> Any:
    """The logits processors `generate` would apply (temperature, top-k/p, min-p, repetition penalty, suppressed
    tokens, min_new_tokens) for prompts `prompt_tokens` [batch, width]."""
    from transformers import LogitsProcessorList

    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=prompt_tokens.shape[1], encoder_input_ids=prompt_tokens,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device,
        model_kwargs=model_kwargs,
    )  # fmt: skip


def generation_position_ids(model: Any, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> torch.Tensor:
    """The position ids `generate` would use for a prefill (Qwen's 3-D rotary positions included)."""
    return model._prepare_position_ids_for_generation(input_ids, dict(model_kwargs))


def can_generate_fast(model: Any) -> bool:
    """Whether `model` has the generation helpers the fast path reuses."""
    return all(hasattr(model, method.name) for method in CALLED)

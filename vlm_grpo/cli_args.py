"""The `vlm-grpo` command's flags: `ScriptArguments`, the parser (TRL's `TrlParser`, with `--config` YAML) and the
checks that need no model or data.

Kept apart from `vlm_grpo.cli` because making argparse read well needs its internals: transformers' `--no_x` flags
get honest help, our options come before the long list of training flags, and `--help` shows the common ones
(`--help-all`: every flag of TRL's GRPOConfig and transformers' TrainingArguments).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from .compat import CHECKPOINTING_ARG
from .demo import DEMO
from .families import model_types

__all__ = [
    "TINY_PREFIX",
    "ScriptArguments",
    "UsageError",
    "build_parser",
    "check_args",
    "parse_args",
    "resolve_rewards",
    "short_help",
]

TINY_PREFIX = "tiny:"
PROG = "vlm-grpo"
DESCRIPTION = """\
GRPO (reinforcement learning with verifiable rewards) for vision-language models. Trains on a synthetic
visual task or on your own dataset, prints held-out accuracy before and after, and writes metrics.jsonl,
reward_curve.png, eval.json and the trained checkpoint (final/) to --output_dir.

examples:
  vlm-grpo --output_dir runs/demo       # tiny model built offline, synthetic colour task, CPU, ~2 minutes
  vlm-grpo --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit --use_peft \\
      --dataset hiyouga/geometry3k --eval_split test --reward_funcs think_answer_format answer_accuracy \\
      --prompt_template "{prompt} Think in <think></think>, then answer in <answer></answer>." \\
      --max_completion_length 512 --output_dir runs/geo3k
"""
# The training flags shown by `--help`; `--help-all` lists all of TRL's GRPOConfig and transformers' TrainingArguments.
COMMON_TRAINING_FLAGS = (
    "output_dir", "max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size", "num_generations",
    "max_completion_length", "temperature", "beta", "logging_steps", "save_strategy", "seed",
    CHECKPOINTING_ARG, "bf16", "min_pixels", "max_pixels", "use_vllm", "report_to", "disable_tqdm",
    "resume_from_checkpoint",
)  # fmt: skip


def _lora_flag(name: str) -> Any:
    """A `ScriptArguments` field for one of `vlm_grpo.lora_selection.LoraSelection`'s flags: its default and help."""
    from .lora_selection import LoraSelection

    flag = {f.name: f for f in fields(LoraSelection)}[name]
    return field(default=flag.default, metadata={"help": f"{flag.metadata['help'].rstrip('.')} (with --use_peft)."})


class UsageError(ValueError):
    """Bad command-line input: `main` prints it as one line and exits with status 2, as argparse does."""


@dataclass
class ScriptArguments:
    """What to train and on which data; the optimiser and GRPO settings are `VLMGRPOConfig`'s flags. The defaults
    are the embedded demo's (`vlm_grpo.demo.DEMO`)."""

    _argument_group_name = "vlm-grpo options"

    model: str = field(
        default=DEMO.model,
        metadata={"help": "A VLM id or path, or `tiny:<family>` for an offline tiny model built in code "
                  f"(families: {', '.join(model_types(lambda f: f.tiny))})."},
    )  # fmt: skip
    task: str = field(
        default=DEMO.task,
        metadata={
            "help": "Synthetic task (without --dataset): color, count, spatial, arithmetic, locate, position, "
            "or the video task motion (which way a shape moves; Qwen-VL models)."
        },
    )
    difficulty: int = field(
        default=DEMO.difficulty, metadata={"help": "Synthetic task difficulty 1-3 (1: four colours, chance 0.25)."}
    )
    train_size: int = field(
        default=DEMO.train_size, metadata={"help": "Synthetic training prompts generated (rows are reused per epoch)."}
    )
    test_size: float | None = field(
        default=None,
        metadata={"help": f"Held-out prompts for accuracy before/after. Synthetic task: a count (default {DEMO.test_size})."
                  " With --dataset and no --eval_split: a fraction (< 1) or a count of rows held out (default 0.1); "
                  "0: none."},
    )  # fmt: skip
    image_size: int = field(default=DEMO.image_size, metadata={"help": "Side of the synthetic images, in pixels."})
    dataset: str | None = field(
        default=None,
        metadata={"help": "Train on your own data: a Hub id, a directory from `save_to_disk`, a JSONL / CSV / Parquet "
                  "file (image column: paths relative to the file, or bytes), or an image folder with metadata.jsonl."},
    )  # fmt: skip
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    eval_split: str | None = field(
        default=None, metadata={"help": "Split for accuracy before/after (else --test_size rows are held out)."}
    )
    prompt_column: str | None = field(
        default=None, metadata={"help": "Question column (default: prompt, problem or question)."}
    )
    image_column: str | None = field(
        default=None, metadata={"help": "Image column, one image or a list (default: images or image)."}
    )
    video_column: str | None = field(
        default=None,
        metadata={"help": "Clip column: a video file, a frame folder or a list of frame paths per row, or a list of "
                  "video files (default: videos or video). Qwen-VL models."},
    )  # fmt: skip
    answer_column: str | None = field(
        default=None,
        metadata={"help": "Gold-answer column, passed to rewards as `answer` (default: answer or solution)."},
    )
    system_prompt: str | None = field(default=None, metadata={"help": "System message added to every prompt."})
    prompt_template: str | None = field(
        default=None,
        metadata={"help": "Template for string prompts; {prompt} is replaced by the question, e.g. \"{prompt} Think in "
                  "<think></think>, then give the final answer in <answer></answer>.\" <image> places the images."},
    )  # fmt: skip
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: names from vlm_grpo.rewards (e.g. think_answer_format answer_accuracy) or "
                  "import paths pkg.mod:fn. Default: the synthetic task's reward, answer_accuracy for --dataset."},
    )  # fmt: skip
    accuracy_reward: str | None = field(
        default=None,
        metadata={"help": "The reward reported as held-out accuracy (a name or import path; trained on only if in "
                  "--reward_funcs). Default: the first of --reward_funcs that reads a gold answer column (a format "
                  "reward reads none); without --reward_funcs, the synthetic task's own reward or answer_accuracy."},
    )  # fmt: skip
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    # LoRA's layer selection: LoraSelection's flags, with its defaults and help.
    finetune_vision_layers: bool = _lora_flag("finetune_vision_layers")
    finetune_language_layers: bool = _lora_flag("finetune_language_layers")
    finetune_attention_modules: bool = _lora_flag("finetune_attention_modules")
    finetune_mlp_modules: bool = _lora_flag("finetune_mlp_modules")
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit NF4 base weights (CUDA + bitsandbytes)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit base weights (CUDA + bitsandbytes)."})
    eval_max_new_tokens: int = field(
        default=0, metadata={"help": "Tokens per held-out answer; 0: max_completion_length."}
    )
    torch_threads: int = field(default=1, metadata={"help": "CPU threads for torch (1 is fastest for tiny models)."})


def build_parser() -> Any:
    """The `TrlParser` over `(ScriptArguments, VLMGRPOConfig)`, training defaults the demo's, help made readable."""
    from trl import TrlParser

    from .trainer import VLMGRPOConfig

    parser = TrlParser((ScriptArguments, VLMGRPOConfig), prog=PROG, description=DESCRIPTION)
    parser.allow_abbrev = False  # `--learning_rat` must be an error, not `--learning_rate`
    parser.formatter_class = _HelpFormatter
    parser.usage = f"{PROG} [--config recipe.yaml] [options]   ({PROG} --help: main options; --help-all: all)"
    parser.set_defaults(**DEMO.training_args())
    for action in parser._actions:
        # transformers gives `--no_x` the help of `--x` and its own default, so it read as the opposite of what it does.
        if (
            action.option_strings
            and action.option_strings[0].startswith("--no_")
            and isinstance(action, argparse._StoreFalseAction)
        ):
            action.help, action.default = f"Turn off --{action.dest}.", argparse.SUPPRESS
    # TrlParser reads `--config` itself before argparse runs; listed here so --help shows it.
    script_group = next(g for g in parser._action_groups if g.title == ScriptArguments._argument_group_name)
    script_group.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS,
                              help="Read any flag of this command from a YAML file (command-line flags win).")  # fmt: skip
    script_group.add_argument("--help-all", action="store_true", default=argparse.SUPPRESS,
                              help="List every training flag (TRL's GRPOConfig and transformers' TrainingArguments).")  # fmt: skip
    parser._optionals.title = "training options (VLMGRPOConfig: TRL's GRPOConfig + transformers' TrainingArguments)"
    # Our options first, then the long list of training flags.
    parser._action_groups.remove(script_group)
    parser._action_groups.insert(1, script_group)
    return parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description's examples keep their lines; option help shows defaults."""


def short_help(parser: Any) -> str:
    """`--help`: the description, this command's options and the common training flags (`--help-all`: everything)."""
    short = argparse.ArgumentParser(prog=PROG, usage=parser.usage, description=DESCRIPTION, formatter_class=_HelpFormatter,
                                    add_help=False, epilog=f"All {len(parser._actions)} flags: {PROG} --help-all")  # fmt: skip
    script_dests = {f.name for f in fields(ScriptArguments)} | {"config", "help_all", "help"}
    ours = short.add_argument_group(ScriptArguments._argument_group_name)
    common = short.add_argument_group("common training options (more: --help-all)")
    for action in parser._actions:
        if action.dest in script_dests:
            ours._add_action(action)
        elif action.dest in COMMON_TRAINING_FLAGS:
            common._add_action(action)
    return short.format_help()


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, Any]:
    """Command-line flags (and `--config` YAML) -> `(ScriptArguments, VLMGRPOConfig)`. Bad values raise `UsageError`."""
    import torch

    parser = build_parser()
    if not torch.cuda.is_available():
        # Set before the config exists: it sets up the process group when built, so under `accelerate launch` a
        # later `use_cpu = True` would leave a gloo group that the trainer does not use (each rank training alone).
        # Pinned memory needs an accelerator; torch warns on every epoch.
        parser.set_defaults(use_cpu=True, dataloader_pin_memory=False)
    argv = _with_negative_values(parser, list(sys.argv[1:] if argv is None else argv))
    _refuse_unknown_flags(parser, argv)
    try:
        script, config = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # a config's __post_init__ check (e.g. batch size vs num_generations)
        raise UsageError(str(error)) from error
    return script, config


# A negative number (`-1e-4`, `-.5`, `-3`): argparse reads `-1e-4` after a flag as another flag.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _with_negative_values(parser: Any, argv: list[str]) -> list[str]:
    """`--flag -1e-4` as `--flag=-1e-4`, for flags that take one value, so argparse does not read it as a flag."""
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        action = parser._option_string_actions.get(previous)
        if action is not None and action.nargs in (None, "?") and _NEGATIVE_NUMBER.match(token):
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def _refuse_unknown_flags(parser: Any, argv: list[str]) -> None:
    """A flag that is not one of the command's, named with the closest real one (flags are never abbreviated: an
    abbreviation would silently set whichever flag it prefixes)."""
    known = set(parser._option_string_actions)
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        if flag in known:
            continue
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]}?" if near else f" (see {PROG} --help, or --help-all for every flag)"
        raise UsageError(f"unknown flag {flag}{hint}")


def resolve_rewards(names: list[str] | None) -> list[Any]:
    """`--reward_funcs` names -> functions (`vlm_grpo.rewards.resolve_reward`); an unknown one is a `UsageError`."""
    from .rewards import resolve_reward

    try:
        return [resolve_reward(name) for name in names or []]
    except ValueError as error:
        raise UsageError(str(error)) from error


def _check_video_task(script: ScriptArguments) -> None:
    """A video task on a tiny family that takes no video is refused before anything is built."""
    from .data.tasks import TASK_SPECS
    from .families import FAMILIES, model_types

    family = FAMILIES.get(script.model[len(TINY_PREFIX) :]) if script.model.startswith(TINY_PREFIX) else None
    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    if spec is not None and spec.video and family is not None and not family.supports_video:
        raise UsageError(
            f"--task {script.task} is a video task and {script.model} takes no video; use one of "
            f"{', '.join(TINY_PREFIX + t for t in model_types(lambda f: f.supports_video and f.tiny))}."
        )


def check_args(script: ScriptArguments, config: Any) -> None:
    """Every check that needs no model or data, before anything is written; raises `UsageError`."""
    from .data import DIFFICULTIES, TASKS
    from .model import check_quantization
    from .tiny import TINY_FAMILIES

    if script.dataset is None:
        if script.task not in TASKS:
            raise UsageError(
                f"unknown --task {script.task!r}; choose one of {', '.join(TASKS)} (or train on --dataset)."
            )
        if script.difficulty not in DIFFICULTIES:
            raise UsageError(
                f"--difficulty must be one of {', '.join(map(str, DIFFICULTIES))}, got {script.difficulty}."
            )
        if script.test_size is not None and (script.test_size < 1 or script.test_size != int(script.test_size)):
            raise UsageError(f"--test_size for a synthetic task is a count >= 1, got {script.test_size:g}.")
        if script.prompt_template is not None and "{prompt}" not in script.prompt_template:
            raise UsageError("--prompt_template must contain {prompt}, where the question goes.")
    elif script.test_size is not None and script.test_size < 0:
        raise UsageError(f"--test_size must be a fraction in (0, 1), a count, or 0, got {script.test_size:g}.")
    if script.model.startswith(TINY_PREFIX) and script.model[len(TINY_PREFIX) :] not in TINY_FAMILIES:
        raise UsageError(
            f"Unknown tiny family {script.model[len(TINY_PREFIX) :]!r}; choose one of {', '.join(TINY_FAMILIES)}."
        )
    _check_video_task(script)
    if script.model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(script.model)):
        raise UsageError(f"--model {script.model}: no such directory.")
    try:
        check_quantization(script.load_in_4bit, script.load_in_8bit)
    except (ValueError, RuntimeError, ImportError) as error:
        raise UsageError(f"--load_in_{'4' if script.load_in_4bit else '8'}bit: {error}") from error
    _check_training_values(config)
    funcs = resolve_rewards(script.reward_funcs)
    resolve_rewards([script.accuracy_reward] if script.accuracy_reward else [])
    if config.reward_weights is not None and len(config.reward_weights) != max(len(funcs), 1):
        raise UsageError(
            f"--reward_weights has {len(config.reward_weights)} value(s) for {max(len(funcs), 1)} reward function(s)."
        )


def _check_training_values(config: Any) -> None:
    """Values transformers accepts but the run would fail on later (the optimizer, after the model is built and the
    baseline evaluated) or that would overwrite something that is not a run directory."""
    if config.output_dir and os.path.exists(config.output_dir) and not os.path.isdir(config.output_dir):
        raise UsageError(f"--output_dir {config.output_dir} is a file; name a directory (new or a run's).")
    if config.learning_rate < 0:
        raise UsageError(f"--learning_rate must be >= 0, got {config.learning_rate:g}.")
    if config.weight_decay < 0:
        raise UsageError(f"--weight_decay must be >= 0, got {config.weight_decay:g}.")
    if config.adam_epsilon < 0:
        raise UsageError(f"--adam_epsilon must be >= 0, got {config.adam_epsilon:g}.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            raise UsageError(f"--{name} must be in [0, 1), got {getattr(config, name):g}.")

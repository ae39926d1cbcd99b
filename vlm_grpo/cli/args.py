"""The `vlm-grpo` command's flags: `ScriptArguments` and the parser (TRL's `TrlParser`, with `--config` YAML); the
checks that need no model or data are `vlm_grpo.cli.checks`.

Kept apart from `vlm_grpo.cli.command` because making argparse read well needs its internals: transformers' `--no_x` flags
get honest help, our options come before the long list of training flags, and `--help` shows the common ones
(`--help-all`: every flag of TRL's GRPOConfig and transformers' TrainingArguments).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap
from dataclasses import dataclass, field, fields
from typing import Any

from ..families import model_types
from .defaults import fit_defaults, given_flags
from .demo import DEMO
from .recipe import check_recipe
from .usage import PROG, UsageError

__all__ = [
    "TINY_PREFIX",
    "ScriptArguments",
    "UsageError",
    "build_parser",
    "parse_args",
    "short_help",
]

TINY_PREFIX = "tiny:"
AUTO = "auto"  # --resume_from_checkpoint's value for the newest complete checkpoint in --output_dir
USAGE = f"{PROG} [--config recipe.yaml] [options]   ({PROG} --help: main options; --help-all: every flag)"
DESCRIPTION = """\
GRPO (reinforcement learning with verifiable rewards) for vision-language models: trains on a synthetic visual
task or on your own dataset, prints held-out accuracy before and after, and writes metrics.jsonl, reward_curve.png,
eval.json, final/ (the trained model) and, for a tiny: model, tiny-base/ (the model it started from) to --output_dir.

examples:
  vlm-grpo --output_dir runs/demo            # a tiny model built offline learns a colour task on CPU, ~2 minutes
  vlm-grpo --dataset data/train.jsonl --output_dir runs/mine   # your data (the tiny model learns its words)
  vlm-grpo --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit --use_peft --dataset hiyouga/geometry3k \\
      --eval_split test --reward_funcs think_answer_format answer_accuracy --max_completion_length 512 \\
      --prompt_template "{prompt} Think in <think></think>, then answer in <answer></answer>." --output_dir runs/geo3k
"""
# `--help`: the options most runs set, one line each: (flag, metavar, what it does). Defaults are read from
# ScriptArguments and the demo's settings, so they cannot drift; tests/test_cli.py checks each is a real flag.
# `--help-all` lists every flag with its full help.
MAIN_OPTIONS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "what to train": (
        ("model", "ID|DIR", "a VLM: Hub id or directory, or tiny:<family> built offline"),
        (
            "task",
            "NAME",
            "color (default) count spatial arithmetic locate position motion color_change zoom zoom_color",
        ),
        ("dataset", "SOURCE", "your data: Hub id, JSONL / CSV / Parquet file, image folder, save_to_disk dir"),
        ("prompt_column", "NAME", "your question column (also --image_column, --answer_column)"),
        ("tools", "NAMES", "image tools the model may call: crop, zoom, rotate (Qwen-VL, Qwen3.5)"),
        ("warm_start", "N", "supervised steps on traces of the task first (with --tools zoom: calling it)"),
        ("reward_funcs", "NAME ...", "vlm_grpo.rewards names or pkg.mod:fn (default: the task's own; answer_choice)"),
        ("eval_split", "SPLIT", "held-out split for accuracy before/after (default: --test_size rows of --dataset)"),
        ("prompt_template", "TEXT", '"{prompt} ..." around each question (also --system_prompt)'),
        ("use_peft", "", "LoRA adapters (--lora_r, --finetune_vision_layers ...) instead of all weights"),
        ("load_in_4bit", "", "4-bit base weights for QLoRA, CUDA + bitsandbytes (also --load_in_8bit)"),
    ),
    "how to train": (
        ("output_dir", "DIR", "where everything is written"),
        ("max_steps", "N", "optimizer steps"),
        ("learning_rate", "LR", "AdamW learning rate"),
        ("per_device_train_batch_size", "N", "completions per step: prompts x --num_generations"),
        ("num_generations", "G", "completions per prompt, compared with each other (GRPO's group)"),
        ("max_completion_length", "N", "tokens per completion"),
        ("beta", "B", "KL coefficient against the starting model"),
        ("logging_steps", "N", "steps between records in metrics.jsonl"),
        ("save_strategy", "no|steps", "checkpoints during training, every --save_steps"),
        ("resume_from_checkpoint", "[DIR]", "go on from the newest checkpoint in --output_dir (or from DIR)"),
        ("report_to", "none|wandb|trackio", "experiment tracking"),
        ("config", "YAML", "any flag from a YAML file (flags on the command line win)"),
    ),
}


def _lora_flag(name: str) -> Any:
    """A `ScriptArguments` field for one of `vlm_grpo.models.lora_selection.LoraSelection`'s flags: its default and help."""
    from ..models.lora_selection import LoraSelection

    flag = {f.name: f for f in fields(LoraSelection)}[name]
    return field(default=flag.default, metadata={"help": f"{flag.metadata['help'].rstrip('.')} (with --use_peft)."})


@dataclass
class ScriptArguments:
    """What to train and on which data; the optimiser and GRPO settings are `VLMGRPOConfig`'s flags. The defaults
    are the embedded demo's (`vlm_grpo.cli.demo.DEMO`)."""

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
            "or a video task (Qwen-VL and Qwen3.5 models): motion (which way a shape moves), color_change (the "
            "colour a shape turns); zoom: a small mark on a large canvas, made for --tools zoom; zoom_color: the "
            "colour of a dot at the centre, invisible at the prompt's pixel budget, shown by one zoom."
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
    image_size: int | None = field(
        default=None,
        metadata={
            "help": "Side of the synthetic images, in pixels (default: the task's own, 56; zoom: 448; "
            "zoom_color: 1024)."
        },
    )
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
        default=None,
        metadata={
            "help": "Image column, one image or a list (default: image or images, else the one column whose "
            "values are image paths, URLs or bytes, found by what it holds)."
        },
    )
    video_column: str | None = field(
        default=None,
        metadata={"help": "Clip column: a video file, a frame folder or a list of frame paths per row, or a list of "
                  "video files (default: videos or video). Qwen-VL models."},
    )  # fmt: skip
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "Gold-answer column, passed to rewards as `answer` and under its own name (default: "
            "answer or solution)."
        },
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
                  "import paths pkg.mod:fn (found from the current folder, as a script's imports are). Default: the "
                  "synthetic task's reward; for --dataset, answer_choice when the answers are a few words repeated "
                  "(a closed vocabulary), else answer_accuracy."},
    )  # fmt: skip
    accuracy_reward: str | None = field(
        default=None,
        metadata={"help": "The reward reported as held-out accuracy (a name or import path; trained on only if in "
                  "--reward_funcs). Default: the first of --reward_funcs that reads a gold answer column (a format "
                  "reward reads none); without --reward_funcs, the synthetic task's own reward, or the dataset's "
                  "default (answer_choice / answer_accuracy)."},
    )  # fmt: skip
    tools: str | None = field(
        default=None,
        metadata={"help": "Image tools the model may call in multi-turn rollouts, comma-separated: crop, zoom, rotate "
                  "(vlm_grpo.tools; they act on the row's image). Qwen-VL and Qwen3.5 models. Unless set, "
                  "--max_completion_length 256 and --max_tool_calling_iterations 2 (a call, its image and the answer; "
                  "128 tokens at least)."},
    )  # fmt: skip
    warm_start: int = field(
        default=0,
        metadata={"help": "Supervised steps before GRPO on traces of the task (vlm_grpo.tools.warm_start): with --tools "
                  "zoom, each looks, calls zoom on a box around the mark, reads the tool's image and answers, so GRPO "
                  "starts from a model that calls the tool (--task zoom or zoom_color); without --tools, each answers at "
                  "once. With a KL term (--beta) and all weights trained, the warm-started model is saved to "
                  "warm-start/ and is GRPO's KL reference. 0: none."},
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
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a new run in an --output_dir that holds an earlier run: its checkpoints, final/, "
                  "metrics.jsonl, eval.json and reward_curve.png are deleted first (else such a run is refused)."},
    )  # fmt: skip


def build_parser() -> Any:
    """The `TrlParser` over `(ScriptArguments, VLMGRPOConfig)`, training defaults the demo's, help made readable."""
    from trl import TrlParser

    from ..training.trainer import VLMGRPOConfig

    parser = TrlParser((ScriptArguments, VLMGRPOConfig), prog=PROG, description=DESCRIPTION)
    parser.allow_abbrev = False  # `--learning_rat` must be an error, not `--learning_rate`
    parser.formatter_class = _HelpFormatter
    parser.usage = USAGE
    parser.set_defaults(**DEMO.training_args())
    for action in parser._actions:
        # transformers gives `--no_x` the help of `--x` and its own default, so it read as the opposite of what it does.
        if (
            action.option_strings
            and action.option_strings[0].startswith("--no_")
            and isinstance(action, argparse._StoreFalseAction)
        ):
            action.help, action.default = f"Turn off --{action.dest}.", argparse.SUPPRESS
    # `--resume_from_checkpoint` alone (or `auto`): the newest complete checkpoint in --output_dir.
    resume = parser._option_string_actions["--resume_from_checkpoint"]
    resume.nargs, resume.const, resume.metavar = "?", AUTO, "CHECKPOINT"
    resume.help = (f"Continue a run from a checkpoint directory; with no value (or `{AUTO}`), from the newest complete "
                   "checkpoint in --output_dir (a new run if it holds none).")  # fmt: skip
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
    """The description's examples keep their lines; each flag is shown once (HfArgumentParser adds a `--dash-case`
    alias to every `--snake_case` flag) and its default once: not when its help already says it, nor when None."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        names = action.option_strings
        shown = [s for s in names if not (s.startswith("--") and s != _snake(s) and _snake(s) in names)]
        if action.nargs == 0:
            return ", ".join(shown)
        args = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{s} {args}" for s in shown)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or re.search(r"\bdefault|\bNone:", help_text, re.IGNORECASE):
            return help_text
        return super()._get_help_string(action)


def _snake(flag: str) -> str:
    return "--" + flag[2:].replace("-", "_")


def _default(flag: str) -> Any:
    """The default `--help` states for `flag`: the demo's setting, else the ScriptArguments field's, else None."""
    script_defaults = {f.name: f.default for f in fields(ScriptArguments)}
    return DEMO.training_args().get(flag, script_defaults.get(flag))


def short_help() -> str:
    """`--help`: the description, examples and the main options, a line each (`--help-all`: every flag). Built
    without the parser, so it imports neither torch nor transformers and prints at once."""
    lines = [f"usage: {USAGE}", "", DESCRIPTION.rstrip()]
    for title, options in MAIN_OPTIONS.items():
        lines += ["", f"{title}:"]
        for flag, metavar, text in options:
            default = _default(flag)
            if default not in (None, False, "") and "default" not in text:
                text = f"{text} (default: {default})"
            # A text too long for the line goes on under itself, so the help stays 120 columns wide.
            lines += textwrap.wrap(text, 120, initial_indent=f"  {f'--{flag} {metavar}'.rstrip():<33}",
                                   subsequent_indent=" " * 35)  # fmt: skip
    lines += ["", f"every flag (TRL's GRPOConfig and transformers' TrainingArguments, 200+): {PROG} --help-all"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, Any]:
    """Command-line flags (and `--config` YAML) -> `(ScriptArguments, VLMGRPOConfig)`. Bad values raise `UsageError`."""
    import torch

    parser = build_parser()
    if not torch.cuda.is_available():
        # Set before the config exists: it sets up the process group when built, so under `accelerate launch` a
        # later `use_cpu = True` would leave a gloo group that the trainer does not use (each rank training alone).
        parser.set_defaults(use_cpu=True)
    given = list(sys.argv[1:] if argv is None else argv)
    # TrlParser reads only `--config PATH`: `--config=PATH` reached argparse whole and failed in an unpacking.
    split = [p for t in given for p in (t.split("=", 1) if t.startswith("--config=") else [t])]
    argv = _with_negative_values(parser, split)
    _refuse_unknown_flags(parser, argv)
    recipe = check_recipe(parser, argv)
    try:
        script, config = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # a config's __post_init__ check (e.g. batch size vs num_generations)
        raise UsageError(str(error)) from error
    for line in fit_defaults(script, config, given_flags(argv, recipe)):
        print(line, flush=True)
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

"""`vlm-grpo`: GRPO fine-tuning of a vision-language model, from a laptop smoke run to a real GPU recipe.

    vlm-grpo                                   # embedded: tiny Qwen2.5-VL, synthetic colour task, CPU, minutes
    vlm-grpo --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit --use_peft --task count   # the GPU recipe
    vlm-grpo --dataset data/train.jsonl --reward_funcs think_answer_format answer_accuracy   # your own data
    vlm-grpo --config recipe.yaml              # any flag below, or of VLMGRPOConfig, from YAML

It prints held-out accuracy before and after training and writes to `--output_dir`: `metrics.jsonl` (one line
per logging step, with a few sample completions), `reward_curve.png`, `eval.json` and `final/` (the trained
checkpoint with its processor, written atomically).

`main()` is the console script (returns the exit status); `run(script, config)` is for Python callers.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .compat import CHECKPOINTING_ARG, checkpointing_from_args
from .families import model_types

__all__ = ["ScriptArguments", "UsageError", "main", "parse_args", "run"]

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
    """What to train and on which data; the optimiser and GRPO settings are `VLMGRPOConfig`'s flags."""

    _argument_group_name = "vlm-grpo options"

    model: str = field(
        default="tiny:qwen2_5_vl",
        metadata={"help": "A VLM id or path, or `tiny:<family>` for an offline tiny model built in code "
                  f"(families: {', '.join(model_types(lambda f: f.tiny))})."},
    )  # fmt: skip
    task: str = field(
        default="color",
        metadata={"help": "Synthetic task (without --dataset): color, count, spatial, arithmetic, locate, position."},
    )
    difficulty: int = field(
        default=1, metadata={"help": "Synthetic task difficulty 1-3 (1: four colours, chance 0.25)."}
    )
    train_size: int = field(
        default=2048, metadata={"help": "Synthetic training prompts generated (rows are reused per epoch)."}
    )
    test_size: float | None = field(
        default=None,
        metadata={"help": "Held-out prompts for accuracy before/after. Synthetic task: a count (default 128). With "
                  "--dataset and no --eval_split: a fraction (< 1) or a count of rows held out (default 0.1); 0: none."},
    )  # fmt: skip
    image_size: int = field(default=56, metadata={"help": "Side of the synthetic images, in pixels."})
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
                  "import paths pkg.mod:fn. The first *accuracy* one decides held-out accuracy. Default: the synthetic "
                  "task's reward, answer_accuracy for --dataset."},
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


# The embedded demo's settings, chosen from runs on 7 seeds and 5 families (docs/demo.md): full fine-tuning of a
# tiny random-init model (LoRA on random weights barely learns: embeddings and head stay frozen), lr 5e-4 (>= 3e-3
# collapses to one answer), and 16 generations per prompt: with 8, some seeds stalled at 0.3-0.7 accuracy
# because too many groups had identical rewards (no signal); 16 learned to >= 0.8 on every seed tried.
DEMO_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/image-reasoning",
    "learning_rate": 5e-4,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "max_steps": 400,
    "per_device_train_batch_size": 64,  # 4 prompts x 16 generations per step
    "num_generations": 16,
    "max_completion_length": 4,  # the answer is one word; a short budget keeps rollouts cheap
    "temperature": 1.0,
    "beta": 0.04,
    "logging_steps": 10,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "disable_tqdm": False,
}


def _build_parser() -> Any:
    from trl import TrlParser

    from .trainer import VLMGRPOConfig

    parser = TrlParser((ScriptArguments, VLMGRPOConfig), prog=PROG, description=DESCRIPTION)
    parser.formatter_class = _HelpFormatter
    parser.usage = f"{PROG} [--config recipe.yaml] [options]   ({PROG} --help: main options; --help-all: all)"
    parser.set_defaults(**DEMO_DEFAULTS)
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


def _short_help(parser: Any) -> str:
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

    parser = _build_parser()
    if not torch.cuda.is_available():
        # Set before the config exists: it sets up the process group when built, so under `accelerate launch` a
        # later `use_cpu = True` would leave a gloo group that the trainer does not use (each rank training alone).
        # Pinned memory needs an accelerator; torch warns on every epoch.
        parser.set_defaults(use_cpu=True, dataloader_pin_memory=False)
    try:
        script, config = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # a config's __post_init__ check (e.g. batch size vs num_generations)
        raise UsageError(str(error)) from error
    return script, config


def reward_names() -> list[str]:
    """Names of the reward functions in `vlm_grpo.rewards` usable by name (TRL signature: takes `completions`)."""
    from . import rewards

    names = []
    for name in getattr(rewards, "__all__", dir(rewards)):
        value = getattr(rewards, name, None)
        if callable(value) and not inspect.isclass(value):
            try:
                params = inspect.signature(value).parameters
            except (TypeError, ValueError):
                continue
            if "completions" in params:
                names.append(name)
    return sorted(names)


def resolve_reward(name: str) -> Callable:
    """A reward function by `vlm_grpo.rewards` name or import path (`pkg.mod:fn` or `pkg.mod.fn`)."""
    from . import rewards

    if name in reward_names():
        return getattr(rewards, name)
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if sep and module_name and attr:
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise UsageError(f"--reward_funcs {name!r}: cannot import it ({error}).") from error
        if callable(func):
            return func
    raise UsageError(
        f"unknown reward {name!r}; choose from {', '.join(reward_names())} or give an import path pkg.mod:fn."
    )


def _check(script: ScriptArguments, config: Any) -> None:
    """Every check that needs no model or data, before anything is written."""
    from .data import DIFFICULTIES, TASKS
    from .model import _check_quantization
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
    if script.model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(script.model)):
        raise UsageError(f"--model {script.model}: no such directory.")
    try:
        _check_quantization(script.load_in_4bit, script.load_in_8bit)
    except (ValueError, RuntimeError, ImportError) as error:
        raise UsageError(f"--load_in_{'4' if script.load_in_4bit else '8'}bit: {error}") from error
    funcs = [resolve_reward(name) for name in script.reward_funcs or []]
    if config.reward_weights is not None and len(config.reward_weights) != max(len(funcs), 1):
        raise UsageError(
            f"--reward_weights has {len(config.reward_weights)} value(s) for {max(len(funcs), 1)} reward function(s)."
        )


def _synthetic_data(script: ScriptArguments, config: Any) -> tuple[Any, Any, list[Callable], str]:
    from .data import answer_words, make_visual_reasoning_dataset
    from .rewards import iou, make_choice_reward

    make = {"seed": config.seed, "image_size": script.image_size, "difficulty": script.difficulty}
    train = make_visual_reasoning_dataset(script.task, script.train_size, split="train", **make)
    test = make_visual_reasoning_dataset(script.task, int(script.test_size or 128), split="test", **make)
    # Closed-vocabulary accuracy: 1 when the completion names exactly one candidate answer, the right one.
    reward = iou if script.task == "locate" else make_choice_reward(answer_words(script.task, script.difficulty))
    funcs = [resolve_reward(n) for n in script.reward_funcs] if script.reward_funcs else [reward]
    if script.system_prompt or script.prompt_template:
        train, test = (_synthetic_prompts(d, script.system_prompt, script.prompt_template) for d in (train, test))
    return train, test, funcs, f"synthetic task '{script.task}'"


def _synthetic_prompts(dataset: Any, system_prompt: str | None, template: str | None) -> Any:
    """`--system_prompt` / `--prompt_template` on the synthetic task's rows (chat prompts of one user message)."""
    import datasets

    def edit(row: dict[str, Any]) -> dict[str, Any]:
        messages = [dict(m) for m in row["prompt"]]
        if template:
            messages[-1]["content"] = template.replace("{prompt}", messages[-1]["content"])
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return {"prompt": messages}

    datasets.disable_progress_bars()
    try:
        return dataset.map(edit)
    finally:
        datasets.enable_progress_bars()


def _own_data(script: ScriptArguments, config: Any) -> tuple[Any, Any, list[Callable], str]:
    import datasets

    from .data.load import DatasetError, load_grpo_dataset
    from .reward_checks import reward_name
    from .rows import check_dataset

    datasets.disable_progress_bars()  # casts and maps of a small dataset are not worth a bar each
    try:
        train, test = load_grpo_dataset(
            script.dataset, script.dataset_split, name=script.dataset_config, eval_split=script.eval_split,
            test_size=0.1 if script.test_size is None else script.test_size, seed=config.seed,
            prompt_column=script.prompt_column, image_column=script.image_column, answer_column=script.answer_column,
            system_prompt=script.system_prompt, prompt_template=script.prompt_template,
        )  # fmt: skip
        check_dataset(train, "dataset", check_images=False)
    except DatasetError as error:
        raise UsageError(f"--dataset {script.dataset}: {error}") from error
    except (FileNotFoundError, ConnectionError, OSError) as error:  # a Hub id that cannot be fetched
        raise UsageError(f"--dataset {script.dataset}: cannot load it ({type(error).__name__}: {error}).") from error
    except ValueError as error:  # rows the trainer would refuse, e.g. placeholders that do not match the images
        raise UsageError(f"--dataset {script.dataset}: {error}") from error
    finally:
        datasets.enable_progress_bars()
    if script.reward_funcs:
        funcs = [resolve_reward(n) for n in script.reward_funcs]
    elif "answer" in train.column_names:
        funcs = [resolve_reward("answer_accuracy")]
    else:
        raise UsageError(f"--dataset {script.dataset} has no answer column (columns: {', '.join(train.column_names)}): "
                         "name it with --answer_column, or give --reward_funcs.")  # fmt: skip
    needs_answer = [reward_name(f) for f in funcs if reward_name(f) in _ANSWER_REWARDS]
    if needs_answer and "answer" not in train.column_names:
        raise UsageError(f"{', '.join(needs_answer)} read an `answer` column; name yours with --answer_column.")
    return train, test, funcs, os.path.basename(script.dataset.rstrip("/")) or script.dataset


_ANSWER_REWARDS = ("answer_accuracy", "multiple_choice", "counting", "anls")


def _summary(logs: dict[str, Any]) -> dict[str, str]:
    """The few numbers worth watching: mean reward, each reward function's mean (`acc` for accuracy ones), KL."""
    shown = {}
    if "reward" in logs:
        shown["reward"] = f"{logs['reward']:.3f}"
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            name = key[len("rewards/") : -len("/mean")]
            shown["acc" if "accuracy" in name and "acc" not in shown else name[:16]] = f"{value:.3f}"
    if "kl" in logs:
        shown["kl"] = f"{logs['kl']:.3g}"
    return shown


def _progress_callbacks(trainer: Any, metrics_path: str) -> None:
    """Replace transformers' per-log dict printing with one progress bar (reward in its postfix); full records, with
    sample completions, go to metrics.jsonl. With `--disable_tqdm true`, one short line per logging step instead."""
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    from .callbacks import MetricsJsonlCallback

    class RewardProgressBar(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if state.is_world_process_zero and self.training_bar is not None and logs and "reward" in logs:
                self.training_bar.set_postfix(_summary(logs), refresh=True)

    class RewardPrinter(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if state.is_world_process_zero and logs and "reward" in logs:
                shown = "  ".join(f"{k} {v}" for k, v in _summary(logs).items())
                print(f"step {state.global_step}/{state.max_steps}  {shown}", flush=True)

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(RewardPrinter() if trainer.args.disable_tqdm else RewardProgressBar())
    # A few sampled completions per logging step go with the metrics (`--num_completions_to_print` of them, else 4);
    # `--log_completions true` also sends TRL's completion tables to wandb / trackio and output_dir/completions/.
    samples = trainer.args.num_completions_to_print or 4
    trainer.add_callback(MetricsJsonlCallback(metrics_path, trainer=trainer, num_samples=samples))


def _plot(metrics_path: str, out_path: str, before: float, after: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards = [], []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "reward" in record:
                steps.append(record["step"])
                rewards.append(record["reward"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker=".", label="mean training reward")
    if not math.isnan(before):
        ax.axhline(before, color="gray", linestyle="--", label=f"held-out accuracy before ({before:.2f})")
        ax.axhline(after, color="green", linestyle="--", label=f"held-out accuracy after ({after:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out_path)


def _load(script: ScriptArguments, config: Any) -> tuple[Any, Any]:
    from .data import answer_words
    from .lora_selection import LoraSelection
    from .model import FastBaseVisionModel
    from .tiny import build_tiny_vlm

    path = script.model
    if path.startswith(TINY_PREFIX):
        # The tiny tokenizer knows the synthetic task's answer words; on your own data it has its base vocabulary.
        words = answer_words(script.task, script.difficulty) if script.dataset is None else None
        family, path = path[len(TINY_PREFIX) :], os.path.join(config.output_dir, "tiny-base")
        # Under `accelerate launch` only global rank 0 may write it (transformers' save_pretrained writes on rank 0
        # only); the other ranks load it once it is complete. Several machines need a shared output_dir for this.
        with config.main_process_first(local=False, desc="building the tiny model"):
            if config.process_index == 0:
                build_tiny_vlm(family, path, seed=config.seed, words=words)
    model, processor = FastBaseVisionModel.from_pretrained(
        path,
        load_in_4bit=script.load_in_4bit,
        load_in_8bit=script.load_in_8bit,
        full_finetuning=not script.use_peft,
        use_gradient_checkpointing=checkpointing_from_args(config)[0],
    )  # the pixel budget (config.min_pixels / max_pixels) is applied by VLMGRPOTrainer and evaluate, for every family
    if script.use_peft:
        model = FastBaseVisionModel.get_peft_model(
            model,
            r=script.lora_r,
            lora_alpha=script.lora_alpha,
            **{flag.name: getattr(script, flag.name) for flag in fields(LoraSelection)},
            use_gradient_checkpointing=checkpointing_from_args(config)[0],
            random_state=config.seed,
        )
    return model, processor


def run(script: ScriptArguments, config: Any) -> dict[str, float]:
    """Train on the synthetic task or `script.dataset`; return held-out metrics before and after (`before/…`,
    `after/…`; empty without a held-out set). Raises `UsageError` for bad arguments, before writing anything."""
    import torch

    from .engine.sharded import full_weights
    from .evaluation import evaluate
    from .export import atomic_directory
    from .reward_checks import reward_name
    from .trainer import VLMGRPOTrainer

    _check(script, config)
    train, test, reward_funcs, data_name = (_own_data if script.dataset else _synthetic_data)(script, config)
    if not torch.cuda.is_available():
        torch.set_num_threads(script.torch_threads)
    os.makedirs(config.output_dir, exist_ok=True)

    model, processor = _load(script, config)
    eval_tokens = script.eval_max_new_tokens or config.max_completion_length
    # Greedy decoding for accuracy: what a user of the trained model gets. The first reward named *accuracy* decides
    # correctness (a format reward would call a well-formatted wrong answer correct).
    judge = next((f for f in reward_funcs if "accuracy" in reward_name(f)), reward_funcs[0])
    eval_funcs = [judge] + [f for f in reward_funcs if f is not judge]
    score = {"max_new_tokens": eval_tokens, "min_pixels": config.min_pixels, "max_pixels": config.max_pixels}
    before: dict[str, float] = {}
    if test is not None:
        before = evaluate(model, processor, test, eval_funcs, **score)
        print(
            f"held-out accuracy before training: {before['accuracy']:.3f}  ({data_name}, {len(test)} prompts)",
            flush=True,
        )

    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    trainer = VLMGRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=config, train_dataset=train, processing_class=processor,
    )  # fmt: skip
    _progress_callbacks(trainer, metrics_path)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)

    # The trained model is saved before the held-out evaluation, so a failure there cannot lose it. A collective
    # (sharded weights are gathered on every rank); rank 0 writes.
    final = os.path.join(config.output_dir, "final")
    if trainer.accelerator.is_main_process:
        with atomic_directory(final) as tmp:
            trainer.save_model(tmp)
            processor.save_pretrained(tmp)
    else:
        trainer.save_model(final)  # joins the gather; writes nothing off rank 0
    trainer.accelerator.wait_for_everyone()

    results: dict[str, float] = {}
    if test is not None:
        with full_weights(trainer.model_wrapped):  # a sharded model gathered once, not per layer per token
            after = evaluate(trainer.model, processor, test, eval_funcs, **score)
        print(f"held-out accuracy after training:  {after['accuracy']:.3f}", flush=True)
        results = {f"before/{k}": v for k, v in before.items()} | {f"after/{k}": v for k, v in after.items()}
    if not trainer.accelerator.is_main_process:
        return results
    tmp_json = os.path.join(config.output_dir, "eval.json.tmp")
    with open(tmp_json, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp_json, os.path.join(config.output_dir, "eval.json"))
    nan = float("nan")
    title = f"GRPO: {data_name} — {script.model}"
    _plot(metrics_path, os.path.join(config.output_dir, "reward_curve.png"), before.get("accuracy", nan),
          results.get("after/accuracy", nan), title)  # fmt: skip
    print(f"wrote {config.output_dir}/: metrics.jsonl, reward_curve.png, eval.json, final/", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `vlm-grpo`: the exit status (0 success, 1 non-finite accuracy, 2 bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if "--help-all" in argv:
            _build_parser().print_help()
            return 0
        if "-h" in argv or "--help" in argv:
            print(_short_help(_build_parser()))
            return 0
        results = run(*parse_args(argv))
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if not all(math.isfinite(v) for k, v in results.items() if k.endswith("accuracy")):
        print(f"{PROG}: held-out accuracy is not a number: {results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

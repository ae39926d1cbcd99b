"""`vlm-grpo`: GRPO fine-tuning of a vision-language model, from a laptop smoke run to a real GPU recipe.

    vlm-grpo                                   # embedded: tiny Qwen2.5-VL, synthetic colour task, CPU, minutes
    vlm-grpo --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit --use_peft --task count   # the GPU recipe
    vlm-grpo --dataset data/train.jsonl --reward_funcs think_answer_format answer_accuracy   # your own data
    vlm-grpo --config recipe.yaml              # any flag below, or of VLMGRPOConfig, from YAML

It prints held-out accuracy before and after training (beside its chance level, for a closed vocabulary of answers)
and writes to `--output_dir`: `metrics.jsonl` (one line per logging step, with a few sample completions),
`reward_curve.png`, `eval.json` and `final/` (the trained checkpoint with its processor, written atomically), and for
a `tiny:` model `tiny-base/`, the model it started from.
With `--save_strategy steps`, a killed run continues with `--resume_from_checkpoint` (its newest complete
checkpoint), `metrics.jsonl` keeping every step once; a new run into a directory holding checkpoints is refused unless
`--overwrite_output_dir`.

`main()` is the console script (returns the exit status); `run(script, config)` is for Python callers. The flags
and their checks are `vlm_grpo.cli.args`, what to train on is a `vlm_grpo.cli.task.Task`, the defaults are the demo's
(`vlm_grpo.cli.demo.DEMO`) and the progress display is `vlm_grpo.training.callbacks`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import warnings
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .args import PROG, TINY_PREFIX, ScriptArguments, UsageError, build_parser, parse_args, short_help
from .checks import check_args, check_clips_family, resolve_rewards, resume_checkpoint
from .demo import DEMO
from .finish import ONE_TURN, WARM_START_DIR, finish, warm_start_saved, with_tools
from .stop import Stopped, stopped_line, stopped_on_fault, stops_as

if TYPE_CHECKING:
    from .task import Task

__all__ = ["ScriptArguments", "UsageError", "build_task", "main", "parse_args", "run"]


def build_task(script: ScriptArguments, config: Any) -> Task:
    """The `vlm_grpo.cli.task.Task` the flags describe: `--dataset` with `--reward_funcs` (default `answer_choice` for a
    closed vocabulary of answers, else `answer_accuracy`), else the synthetic `--task` with its own reward. Bad data or
    rewards raise `UsageError`."""
    from .task import dataset_task, synthetic_task

    rewards = {"reward_funcs": resolve_rewards(script.reward_funcs) or None,
               "accuracy": resolve_rewards([script.accuracy_reward])[0] if script.accuracy_reward else None}  # fmt: skip
    if script.dataset is None:
        try:
            return synthetic_task(
                script.task, difficulty=script.difficulty, train_size=script.train_size,
                test_size=int(script.test_size or DEMO.test_size), image_size=script.image_size, seed=config.seed,
                system_prompt=script.system_prompt, prompt_template=script.prompt_template, **rewards,
            )  # fmt: skip
        except ValueError as error:  # e.g. rewards reading columns the synthetic rows lack
            raise UsageError(str(error)) from error
    import datasets

    datasets.disable_progress_bars()  # casts and maps of a small dataset are not worth a bar each
    try:
        return dataset_task(
            script.dataset, script.dataset_split, name=script.dataset_config, eval_split=script.eval_split,
            test_size=0.1 if script.test_size is None else script.test_size, seed=config.seed,
            prompt_column=script.prompt_column, image_column=script.image_column, answer_column=script.answer_column,
            video_column=script.video_column,
            system_prompt=script.system_prompt, prompt_template=script.prompt_template, **rewards,
            check_images=config.check_images, skip_bad_rows=config.skip_bad_rows, stop_hint="--no_skip_bad_rows",
            keep_origin=True,  # a reward that fails on a row names its line
        )  # fmt: skip
    except OSError as error:  # a missing file, or a Hub id that cannot be fetched
        raise UsageError(f"--dataset {script.dataset}: cannot load it ({type(error).__name__}: {error}).") from error
    except ValueError as error:  # DatasetError, or rows the trainer would refuse (placeholders vs images)
        where = "" if script.dataset in str(error) else f"--dataset {script.dataset}: "  # said once
        raise UsageError(f"{where}{error}") from error
    finally:
        datasets.enable_progress_bars()


def _say_where_the_images_are(task: Task) -> None:
    """One line when your data's images were found by what a column holds (its name not `image` / `images`), and
    one when no column holds images or clips: the run never goes text-only without saying so."""
    columns = task.source_columns
    if task.image_found_by_content:
        print(f"images: column `{columns['image']}` (found by what it holds; --image_column names another)",
              flush=True)  # fmt: skip
    elif "image" not in columns and "video" not in columns:
        print(f"{PROG}: warning: no column of --dataset holds images (image files, URLs or bytes; columns: "
              f"{', '.join(task.train.column_names)}): the model trains on text only; name the image column with "
              "--image_column.", file=sys.stderr, flush=True)  # fmt: skip


def _note_if_unlearnable(task: Task) -> None:
    """One line, before any time is spent, when the offline tiny model (its vocabulary: your data's words) is unlikely
    to learn your data."""
    from ..tiny import offline_learning_note

    answers = task.train["answer"] if "answer" in task.train.column_names else []
    note = offline_learning_note(task.answer_words or [], answers)
    if note:
        print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)


# Fewer held-out rows than this measure accuracy coarsely: near 0.5 its noise is 0.5 / sqrt(rows), 0.20 on 6 rows and
# 0.09 on 30, so below 30 a change of a few tenths can be luck.
MIN_HELD_OUT = 30


def _say_what_is_measured(script: ScriptArguments, task: Task) -> None:
    """One line each, before any time is spent: the reward picked for a closed vocabulary of answers when no
    `--reward_funcs` was given, and a held-out set too small to measure accuracy."""
    from ..rewards.checks import reward_name

    values = task.answer_values or []
    if script.dataset is not None and not script.reward_funcs and reward_name(task.reward_funcs[0]) == "answer_choice":
        shown = ", ".join(values[:6]) + (", ..." if len(values) > 6 else "")
        print(f"reward: answer_choice, the first of the answer column's {len(values)} values ({shown}) a completion "
              "names (few distinct answers; --reward_funcs answer_accuracy for the exact answer)", flush=True)  # fmt: skip
    rows = len(task.test) if task.test is not None else 0
    if 0 < rows < MIN_HELD_OUT:
        flag = "a larger --eval_split" if script.eval_split else f"--test_size {MIN_HELD_OUT}"
        print(f"{PROG}: warning: only {rows} held-out rows: accuracy moves in steps of {1 / rows:.3f} and by about "
              f"{0.5 / math.sqrt(rows):.2f} from luck alone; hold out {MIN_HELD_OUT} or more with {flag}.",
              file=sys.stderr, flush=True)  # fmt: skip


def _chance(task: Task) -> str:
    """`  chance 0.333: 1 of 3 answers at random` after the accuracy before training, for a closed vocabulary."""
    if task.chance is None:
        return ""
    return f"  chance {task.chance:.3f}: 1 of {len(task.answer_values or [])} answers at random"


def _taught_calls(script: ScriptArguments, config: Any, task: Task) -> list[dict[str, Any]]:
    """The call a tiny model with tools is taught on a zoom task whose traces share one (`zoom_color`'s, to a dot in a
    known place): its tokenizer makes it one token (`build_tiny_vlm(tool_calls=...)`). It is in pixels of the prompt's
    image, the tiny processor's budget (or `--max_pixels`) applied to the task's canvas."""
    from ..data.tasks import TASK_SPECS
    from ..media.pixel_budget import fed_size, update_size_budget
    from ..tiny.build import tiny_image_processor
    from ..tools.warm_start import shared_call

    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    if not (script.tools and script.model.startswith(TINY_PREFIX) and spec is not None and spec.zoom is not None):
        return []
    image_processor = tiny_image_processor(script.model[len(TINY_PREFIX) :])
    update_size_budget(image_processor.size, config.min_pixels, config.max_pixels)
    canvas = (script.image_size or spec.image_size,) * 2
    call = shared_call(task.train["bbox"], canvas, fed_size(image_processor, *canvas), spec.zoom)
    return [call] if call is not None else []


def _load(
    script: ScriptArguments, config: Any, words: list[str] | None, calls: list[dict[str, Any]]
) -> tuple[Any, Any]:
    """The model and processor `--model` names (a tiny one is built first, knowing `words` and writing `calls` as one
    token each), with LoRA if asked."""
    from ..compat import checkpointing_from_args
    from ..models.loader import FastBaseVisionModel
    from ..models.lora_selection import LoraSelection
    from ..tiny import build_tiny_vlm
    from ..training.callbacks import library_bars_off

    path = script.model
    checkpointing = checkpointing_from_args(config)[0]
    tiny = path.startswith(TINY_PREFIX)
    if tiny:
        family, path = path[len(TINY_PREFIX) :], os.path.join(config.output_dir, "tiny-base")
        # Under `accelerate launch` only global rank 0 may write it (transformers' save_pretrained writes on rank 0
        # only); the other ranks load it once it is complete. Several machines need a shared output_dir for this.
        with config.main_process_first(local=False, desc="building the tiny model"):
            if config.process_index == 0:
                build_tiny_vlm(family, path, seed=config.seed, words=words, tools=bool(script.tools),
                               tool_calls=calls)  # fmt: skip
    # A Hub model's download and loading bars are worth seeing; the tiny model loads in no time.
    with library_bars_off() if tiny else contextlib.nullcontext():
        model, processor = FastBaseVisionModel.from_pretrained(
            path,
            load_in_4bit=script.load_in_4bit,
            load_in_8bit=script.load_in_8bit,
            full_finetuning=not script.use_peft,
            use_gradient_checkpointing=checkpointing,
        )  # fmt: skip  (the pixel budget is applied by VLMGRPOTrainer and evaluate, for every family)
    if script.use_peft:
        model = FastBaseVisionModel.get_peft_model(
            model, r=script.lora_r, lora_alpha=script.lora_alpha,
            **{flag.name: getattr(script, flag.name) for flag in fields(LoraSelection)},
            use_gradient_checkpointing=checkpointing, random_state=config.seed,
        )  # fmt: skip
    return model, processor


def _warm_start(script: ScriptArguments, config: Any, model: Any, processor: Any, task: Task, tools: Any) -> None:
    """`--warm_start`: supervised steps on traces of the training rows (`vlm_grpo.tools.warm_start`), one line said;
    then the warm-started model made GRPO's KL reference."""
    from ..data.tasks import TASK_SPECS
    from ..tools.warm_start import ZOOM, fold_adapters, tool_warm_start
    from ..training.callbacks import library_bars_off

    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    zoom = spec.zoom if spec is not None and spec.zoom is not None else ZOOM
    done = tool_warm_start(model, processor, task.train, script.warm_start, tools, min_pixels=config.min_pixels,
                           max_pixels=config.max_pixels, zoom=zoom, seed=config.seed,
                           chat_template_kwargs=config.chat_template_kwargs)  # fmt: skip
    what = "look, call zoom on the mark, answer" if tools else "look, answer"
    print(f"warm start: {done.steps} supervised steps on {done.traces} traces ({what}), loss on the model's tokens "
          f"{done.first_loss:.3f} -> {done.last_loss:.3f}", flush=True)  # fmt: skip
    if warm_start_saved(script, config):
        # TRL builds the KL reference of a fully trained model again from its config's name_or_path: pointed at the
        # warm-started weights, the reference is the model GRPO starts from, not the one before the warm start (whose
        # KL pulls a warm-started policy back to random calls).
        path = os.path.join(config.output_dir, WARM_START_DIR)
        with config.main_process_first(local=False, desc="saving the warm-started model"), library_bars_off():
            if config.process_index == 0:
                model.save_pretrained(path)
        model.config.name_or_path = path
    elif config.beta and (folded := fold_adapters(model)):  # the adapter-off reference is the warm-started model
        # The folded base is saved and named as the adapter's base, so final/ loads onto the warm-started model.
        from ..models.export import merged_state_dict, write_checkpoint

        path, dtype = os.path.join(config.output_dir, WARM_START_DIR), model.get_base_model().dtype
        with config.main_process_first(local=False, desc="saving the warm-started base"), library_bars_off():
            if config.process_index == 0:
                write_checkpoint(model, processor, merged_state_dict(model, dtype), path, dtype)
        for adapter in model.peft_config.values():
            adapter.base_model_name_or_path = path
        print(f"warm start: the adapter folded into the base weights ({folded} layers, saved to {path}) and started "
              "afresh: GRPO's KL reference is the warm-started model", flush=True)  # fmt: skip
    elif config.beta:  # a quantised base cannot take the update exactly
        print(f"{PROG}: note: with --use_peft on this base the KL reference is the model with its adapter off, as it "
              "was before the warm start; --beta 0 keeps GRPO from pulling the warm-started adapter back.",
              file=sys.stderr, flush=True)  # fmt: skip


def _show_progress(trainer: Any, metrics_path: str, accuracy: str) -> None:
    """One progress bar with the reward in its postfix instead of transformers' dict per log (`--disable_tqdm true`:
    one short line per logging step); every record, with sample completions, goes to metrics.jsonl."""
    from transformers import PrinterCallback, ProgressCallback

    from ..training.callbacks import MetricsJsonlCallback, RewardPrinter, RewardProgressBar
    from .reward_watch import ZeroRewardNote

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(RewardPrinter(accuracy) if trainer.args.disable_tqdm else RewardProgressBar(accuracy))
    # A few sampled completions per logging step go with the metrics (`--num_completions_to_print` of them, else 4);
    # `--log_completions true` also sends TRL's completion tables to wandb / trackio and output_dir/completions/.
    samples = trainer.args.num_completions_to_print or 4
    trainer.add_callback(MetricsJsonlCallback(metrics_path, trainer=trainer, num_samples=samples))
    trainer.add_callback(ZeroRewardNote(trainer, say=_say_above_the_bar))


def _say_above_the_bar(line: str) -> None:
    """One line of ours on stderr during training, above the progress bar (which tqdm redraws below it)."""
    from tqdm.auto import tqdm

    tqdm.write(f"{PROG}: {line}", file=sys.stderr)


# What a run writes to --output_dir besides tiny-base/ (rebuilt by every run): --overwrite_output_dir deletes an
# earlier run's, so none of it is mistaken for the new run's.
_RUN_OUTPUTS = ("final", "metrics.jsonl", "eval.json", "reward_curve.png", WARM_START_DIR)


def _clear_earlier_run(output_dir: str) -> None:
    """Delete an earlier run's checkpoints and outputs from `output_dir` (`--overwrite_output_dir`), saying which."""
    from ..training.checkpoints import checkpoint_dirs

    doomed = checkpoint_dirs(output_dir) + [os.path.join(output_dir, n) for n in _RUN_OUTPUTS]
    doomed = [path for path in doomed if os.path.lexists(path)]
    for path in doomed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if doomed:
        print(f"--overwrite_output_dir: deleted the earlier run's {', '.join(map(os.path.basename, doomed))} "
              f"from {output_dir}", flush=True)  # fmt: skip


def run(script: ScriptArguments, config: Any) -> dict[str, float]:
    """Train on the synthetic task or `script.dataset`; return held-out metrics before and after (`before/…`,
    `after/…`; empty without a held-out set). Raises `UsageError` for bad arguments, before writing anything."""
    import torch

    from ..media.video_budget import VIDEO_SETTINGS
    from ..rewards.checks import reward_name
    from ..training.callbacks import close_progress_bars, library_bars_off
    from ..training.evaluation import evaluate
    from ..training.trainer import VLMGRPOTrainer

    check_args(script, config)
    resume = resume_checkpoint(script, config)
    task = build_task(script, config)
    if script.dataset is not None:
        check_clips_family(script, task.train)
        _say_where_the_images_are(task)
    if script.dataset is not None and script.model.startswith(TINY_PREFIX):
        _note_if_unlearnable(task)
    _say_what_is_measured(script, task)
    if not torch.cuda.is_available():
        torch.set_num_threads(script.torch_threads)
    os.makedirs(config.output_dir, exist_ok=True)
    if script.overwrite_output_dir:
        with config.main_process_first(local=False, desc="clearing the earlier run"):
            if config.process_index == 0:
                _clear_earlier_run(config.output_dir)

    model, processor = _load(script, config, task.answer_words, _taught_calls(script, config, task))
    tools = {}
    if script.tools:  # one environment per rollout, over its row's image (vlm_grpo.tools)
        from ..tools import image_tools

        tools["environment_factory"] = image_tools(script.tools)
    # Before the trainer, whose KL reference is the model it is given; on a resumed run too, for the same reference.
    if script.warm_start:
        _warm_start(script, config, model, processor, task, tools.get("environment_factory"))
    # Greedy decoding for accuracy: what a user of the trained model gets; the task's accuracy reward decides it. The
    # prompts rendered as the rollouts render them (e.g. `{"enable_thinking": false}`).
    score = {"max_new_tokens": script.eval_max_new_tokens or config.max_completion_length,
             "min_pixels": config.min_pixels, "max_pixels": config.max_pixels,
             "chat_template_kwargs": config.chat_template_kwargs,
             **{k: getattr(config, k) for k in VIDEO_SETTINGS}}  # fmt: skip
    before: dict[str, float] = {}
    if task.test is not None:
        before = evaluate(model, processor, task.test, task.eval_funcs, **score)
        print(f"held-out accuracy before training: {before['accuracy']:.3f}  ({task.name}, {len(task.test)} prompts)"
              f"{_chance(task)}{ONE_TURN if script.tools else ''}", flush=True)  # fmt: skip
    if script.tools and script.model.startswith(TINY_PREFIX) and not script.warm_start:
        print(f"{PROG}: note: a {TINY_PREFIX} model starts from random weights and does not call tools by itself: this "
              "run checks the tool loop, not tool use (--warm_start N teaches the call first; a pretrained --model "
              "learns more: examples/recipes/qwen2_5_vl_3b_zoom_tools.yaml).", file=sys.stderr, flush=True)  # fmt: skip

    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    # TRL's notice that `environment_factory` is experimental is for authors of environments, not for this command.
    with library_bars_off(), warnings.catch_warnings():  # TRL loads the KL reference model again: a second bar
        warnings.filterwarnings("ignore", "You are using 'environment_factory'", UserWarning)
        trainer = VLMGRPOTrainer(model=model, reward_funcs=task.reward_funcs, args=config, train_dataset=task.train,
                                 processing_class=processor, **tools)  # fmt: skip
    if task.test is not None and script.tools:
        before |= with_tools(trainer, task, "before training", config.seed)
    _show_progress(trainer, metrics_path, reward_name(task.accuracy))
    try:
        with stops_as(trainer, config.output_dir, trained=False):  # Ctrl-C: main says where it stopped, in one line
            trainer.train(resume_from_checkpoint=resume)
    finally:  # a run stopped by an error says so in one line, after the bar
        close_progress_bars(trainer)
    with stops_as(trainer, config.output_dir, trained=True):
        return finish(script, config, task, trainer, processor, before, score)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `vlm-grpo`: the exit status (0 success, or stopped by SIGTERM with a checkpoint to
    resume from; 2 bad arguments; 130 stopped by Ctrl-C; a fault the run names has its own, `cli.stop.EXIT_STATUS`:
    74 a checkpoint not written, 70 a reward function that failed, 65 non-finite steps or no reward signal, 75
    preempted before any checkpoint; 1 non-finite accuracy)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config = None
    try:
        if "--help-all" in argv:
            build_parser().print_help()
            return 0
        if "-h" in argv or "--help" in argv:
            print(short_help(), end="")
            return 0
        script, config = parse_args(argv)
        results = run(script, config)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line, and the shell's status for it (128 + SIGINT)
        print(f"{PROG}: {stopped_line(interrupt if isinstance(interrupt, Stopped) else None)}", file=sys.stderr)
        return 130
    except Exception as error:
        status = stopped_on_fault(error, argv, getattr(config, "output_dir", None))
        if status is None:
            raise
        return status
    if not all(math.isfinite(v) for k, v in results.items() if k.endswith("accuracy")):
        print(f"{PROG}: held-out accuracy is not a number: {results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

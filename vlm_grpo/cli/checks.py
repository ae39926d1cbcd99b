"""The `vlm-grpo` command's checks that need no model or data, made before anything is written: each failure is a
`UsageError` (one line naming the fix, exit status 2). `resume_checkpoint` decides which checkpoint a run continues
from, and refuses a run that would overwrite an earlier one's."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..families import model_types
from .args import AUTO, TINY_PREFIX, ScriptArguments, UsageError

__all__ = ["check_args", "check_clips_family", "check_hub_model", "resolve_rewards", "resume_checkpoint"]


def resolve_rewards(names: list[str] | None) -> list[Any]:
    """`--reward_funcs` names -> functions (`vlm_grpo.rewards.resolve_reward`); an unknown one is a `UsageError`."""
    from ..rewards import resolve_reward

    try:
        return [resolve_reward(name) for name in names or []]
    except ValueError as error:
        raise UsageError(str(error)) from error


def _check_video_task(script: ScriptArguments) -> None:
    """A video task on a tiny family that takes no video is refused before anything is built."""
    from ..data.tasks import TASK_SPECS
    from ..families import FAMILIES

    family = FAMILIES.get(script.model[len(TINY_PREFIX) :]) if script.model.startswith(TINY_PREFIX) else None
    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    if spec is not None and spec.video and family is not None and not family.trains_on_clips:
        raise UsageError(
            f"--task {script.task} is a video task and {script.model} takes no video; use one of "
            f"{', '.join(TINY_PREFIX + t for t in model_types(lambda f: f.trains_on_clips and f.tiny))}."
        )


# A tool call (the template's wrapper, the tool's name and its arguments) and the tool's image tokens are part of the
# completion: below this neither fits, and every rollout would end mid-call.
MIN_TOOL_COMPLETION = 128


def _check_tools(script: ScriptArguments, config: Any) -> None:
    """`--tools`: known tool names, a family that writes tool calls, room in the completion, no clips; else refused
    before anything is built."""
    from ..data.tasks import TASK_SPECS
    from ..tiny import tool_families
    from ..tools import image_tools

    if not script.tools:
        return
    try:
        image_tools(script.tools)
    except ValueError as error:
        raise UsageError(f"--tools {script.tools}: {error}") from error
    tiny = script.model[len(TINY_PREFIX) :] if script.model.startswith(TINY_PREFIX) else None
    if tiny is not None and tiny not in tool_families():
        raise UsageError(f"--tools: {script.model} cannot write tool calls; use one of "
                         f"{', '.join(TINY_PREFIX + f for f in tool_families())}.")  # fmt: skip
    if config.max_completion_length < MIN_TOOL_COMPLETION:
        raise UsageError(f"--tools needs --max_completion_length {MIN_TOOL_COMPLETION} or more (got "
                         f"{config.max_completion_length}): the calls and the tools' images are part of the "
                         "completion. 256 fits a call and a zoomed image on a tiny model.")  # fmt: skip
    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    if (spec is not None and spec.video) or script.video_column:
        raise UsageError("--tools with clips is not supported: the tool loop takes images only.")


def _check_warm_start(script: ScriptArguments) -> None:
    """`--warm_start`: a count, image rows; with tools, traces that zoom on the mark need a zoom task (its rows hold
    the mark's box)."""
    from ..data.tasks import TASK_SPECS

    if script.warm_start < 0:
        raise UsageError(f"--warm_start is a number of steps >= 0, got {script.warm_start}.")
    spec = TASK_SPECS.get(script.task) if script.dataset is None else None
    if script.warm_start and ((spec is not None and spec.video) or script.video_column):
        raise UsageError("--warm_start makes traces of image rows, not clips; leave it out for a video task.")
    if script.warm_start and script.tools and (spec is None or spec.zoom is None):
        zoom_tasks = " or ".join(f"--task {name}" for name, s in TASK_SPECS.items() if s.zoom is not None)
        raise UsageError(f"--warm_start with --tools shows a zoom on the mark, which only the zoom tasks' rows locate; "
                         f"use {zoom_tasks}, or leave out --warm_start.")  # fmt: skip
    if script.warm_start and script.tools and "zoom" not in [t.strip() for t in script.tools.split(",")]:
        raise UsageError("--warm_start with --tools calls zoom: add it, e.g. --tools zoom.")


def check_clips_family(script: ScriptArguments, train: Any) -> None:
    """A dataset with clips for a model whose family takes none, refused before the model loads (the trainer would
    refuse it only after). The family comes from the tiny name or the model's config (cheap: no weights)."""
    from ..families import FAMILIES
    from ..media.processing import holds_clips

    columns = set(getattr(train, "column_names", None) or [])
    if not ({"video", "videos"} & columns or holds_clips(train[: min(len(train), 8)]["prompt"])):
        return
    if script.model.startswith(TINY_PREFIX):
        model_type = script.model[len(TINY_PREFIX) :]
    else:
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(script.model).model_type
    family = FAMILIES.get(model_type)
    if family is not None and not family.trains_on_clips:
        raise UsageError(
            f"--dataset {script.dataset} has clips and {script.model} ({model_type}) takes no video here; use a "
            f"model of a family that does ({', '.join(model_types(lambda f: f.trains_on_clips))}), or drop the clips."
        )


def check_args(script: ScriptArguments, config: Any) -> None:
    """Every check that needs no model or data, before anything is written; raises `UsageError`."""
    from ..data import DIFFICULTIES, TASKS
    from ..models.loader import check_quantization
    from ..tiny import TINY_FAMILIES

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
    elif script.test_size is not None and script.eval_split is not None:  # else --test_size is silently not used
        raise UsageError("--eval_split and --test_size both choose the held-out rows; give one.")
    if script.model.startswith(TINY_PREFIX) and script.model[len(TINY_PREFIX) :] not in TINY_FAMILIES:
        raise UsageError(
            f"Unknown tiny family {script.model[len(TINY_PREFIX) :]!r}; choose one of {', '.join(TINY_FAMILIES)}."
        )
    _check_video_task(script)
    _check_tools(script, config)
    _check_warm_start(script)
    if script.model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(script.model)):
        raise UsageError(f"--model {script.model}: no such directory.")
    # The model first: a GPU recipe run where the Hub is out of reach needs `tiny:` more than it needs bitsandbytes.
    if not script.model.startswith(TINY_PREFIX) and not os.path.exists(os.path.expanduser(script.model)):
        quantized = [f"--load_in_{bits}bit false" for bits in (4, 8) if getattr(script, f"load_in_{bits}bit")]
        check_hub_model(script.model, " ".join(quantized) if config.use_cpu else "")
    try:
        check_quantization(script.load_in_4bit, script.load_in_8bit)
    except (ValueError, RuntimeError, ImportError) as error:
        raise UsageError(f"--load_in_{'4' if script.load_in_4bit else '8'}bit: {error}") from error
    if (script.load_in_4bit or script.load_in_8bit) and config.use_cpu:
        raise UsageError(f"--load_in_{'4' if script.load_in_4bit else '8'}bit trains on a CUDA GPU only (bitsandbytes' "
                         "CPU backend fails in training); on this machine leave it out.")  # fmt: skip
    _check_training_values(config)
    funcs = resolve_rewards(script.reward_funcs)
    resolve_rewards([script.accuracy_reward] if script.accuracy_reward else [])
    if config.reward_weights is not None and len(config.reward_weights) != max(len(funcs), 1):
        raise UsageError(
            f"--reward_weights has {len(config.reward_weights)} value(s) for {max(len(funcs), 1)} reward function(s)."
        )


def check_hub_model(model: str, tiny_flags: str = "") -> None:
    """A Hub model id that is cached, or reachable on the Hub, passes; otherwise one `UsageError` naming the model,
    the reason and the way forward, before anything is written (transformers would retry five times, print a
    76-line traceback and leave an empty output directory). `tiny_flags` go with the offline tiny model the message
    offers (`--load_in_4bit false` where a recipe's quantization cannot run)."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    offline_set = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        if not offline_set and not _hub_reachable(model):
            # Cached but the Hub unreachable: transformers would retry every file for minutes before using the cache.
            _go_offline()
            print(f"{model}: the Hugging Face Hub is unreachable; using the cached copy (HF_HUB_OFFLINE=1).",
                  flush=True)  # fmt: skip
        return
    offline = f" offline tiny model (--model tiny:qwen2_5_vl{' ' + tiny_flags if tiny_flags else ''})"
    if offline_set:
        raise UsageError(f"--model {model}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download "
                         f"it where there is internet (hf download {model}) or train the{offline}.")  # fmt: skip
    try:
        HfApi().model_info(model, timeout=10)
    except GatedRepoError as error:
        raise UsageError(f"--model {model}: a gated model; accept its terms on its Hub page and log in "
                         "(hf auth login).") from error  # fmt: skip
    except RepositoryNotFoundError as error:
        raise UsageError(f"--model {model}: no such model on the Hugging Face Hub (a private one needs hf auth "
                         "login); a local folder is named by its path (./my-model).") from error  # fmt: skip
    except Exception as error:  # no network, DNS, proxy, timeout: each library names them differently
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"--model {model}: cannot reach the Hugging Face Hub ({reason}) and it is not in the "
                         f"local cache: download it where there is internet (hf download {model}; then HF_HUB_OFFLINE=1 "
                         f"loads the cached copy without the Hub), or train the{offline}.") from error  # fmt: skip


def resume_checkpoint(script: ScriptArguments, config: Any) -> str | None:
    """The checkpoint the run continues from (None: a new run), once --output_dir is known to take this run without
    mixing it with another: a new run into a directory holding checkpoints, or a finished run's `final/`, is refused
    unless `--overwrite_output_dir`. `--resume_from_checkpoint` with no value (`auto`, or `true` from YAML) is the newest
    complete checkpoint (`vlm_grpo.training.checkpoints`), or a new run where there is no checkpoint at all. Raises
    `UsageError`; writes nothing."""
    from ..training.checkpoints import checkpoint_dirs, incomplete_reason, newest_complete_checkpoint

    requested = config.resume_from_checkpoint
    requested = None if requested in (False, None, "") else requested
    existing = checkpoint_dirs(config.output_dir)
    if requested is not None and script.overwrite_output_dir:
        raise UsageError("--resume_from_checkpoint continues the run in --output_dir, --overwrite_output_dir starts "
                         "it over; choose one.")  # fmt: skip
    if requested is None:
        if existing and not script.overwrite_output_dir:
            names = ", ".join(os.path.basename(c) for c in existing[-3:])
            raise UsageError(f"--output_dir {config.output_dir} holds checkpoints of an earlier run ({names}): continue "
                             "it with --resume_from_checkpoint, or start over with --overwrite_output_dir.")  # fmt: skip
        _refuse_a_finished_run(script, config)
        return None
    if requested is True or str(requested).lower() in (AUTO, "true"):
        if not existing:
            _refuse_a_finished_run(script, config)  # nothing to resume, and a new run would overwrite its model
            print(f"--resume_from_checkpoint: no checkpoint in {config.output_dir}, starting a new run", flush=True)
            return None
        checkpoint = newest_complete_checkpoint(config.output_dir)
        if checkpoint is None:
            raise UsageError(f"--resume_from_checkpoint: no checkpoint in {config.output_dir} is complete ("
                             f"{os.path.basename(existing[-1])}: {incomplete_reason(existing[-1])}); name one, or start "
                             "over with --overwrite_output_dir.")  # fmt: skip
    else:
        checkpoint = os.path.expanduser(str(requested))
        if not os.path.isdir(checkpoint):
            raise UsageError(f"--resume_from_checkpoint {requested}: no such directory (a checkpoint-N directory, or "
                             f"`{AUTO}` for the newest complete one in --output_dir).")  # fmt: skip
        if reason := incomplete_reason(checkpoint):
            raise UsageError(f"--resume_from_checkpoint {requested} is not a complete checkpoint: {reason}.")
    print(f"resuming from {checkpoint}", flush=True)
    _note_generation_batch_split(config, checkpoint)
    return checkpoint


def _refuse_a_finished_run(script: ScriptArguments, config: Any) -> None:
    """A new run into a directory holding a finished run's `final/` (a run that kept no checkpoints) would overwrite
    its trained model, and one into a run stopped before its first checkpoint would overwrite its `metrics.jsonl`:
    both refused unless `--overwrite_output_dir`."""
    if script.overwrite_output_dir:
        return
    final = os.path.join(config.output_dir, "final")
    if os.path.lexists(final):
        raise UsageError(f"--output_dir {config.output_dir} holds an earlier run's trained model ({final}): choose "
                         "another --output_dir, or replace it with --overwrite_output_dir.")  # fmt: skip
    steps = _recorded_steps(os.path.join(config.output_dir, "metrics.jsonl"))
    if steps:
        raise UsageError(f"--output_dir {config.output_dir} holds an earlier run's metrics.jsonl (up to step "
                         f"{max(steps)}) and no checkpoint to resume from: start over with --overwrite_output_dir "
                         "(it deletes them), or choose another --output_dir.")  # fmt: skip


def _recorded_steps(path: str) -> list[int]:
    """The steps a metrics.jsonl holds records of ([] for none, or no file); a line cut short is not one."""
    import json

    steps = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError, AttributeError):
                    steps.append(int(json.loads(line).get("step", 0)))
    return steps


def _note_generation_batch_split(config: Any, checkpoint: str) -> None:
    """Say so when the checkpoint falls inside a generation batch: TRL keeps the batch's completions in memory only
    (`_buffered_inputs`), so the resumed run generates new ones there and does not repeat the interrupted run."""
    import json

    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        micro_steps = json.load(f)["global_step"] * config.gradient_accumulation_steps
    shared = (config.steps_per_generation or 1) * config.num_iterations  # micro-steps one generation batch serves
    if micro_steps % shared:
        print(f"note: {os.path.basename(checkpoint)} falls inside a generation batch ({shared} micro-steps share one): "
              "the resumed steps train on newly generated completions. Saving every multiple of "
              "steps_per_generation x num_iterations / gradient_accumulation_steps steps avoids this.", flush=True)  # fmt: skip


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


def _hub_reachable(model: str) -> bool:
    """Whether the Hub answers for `model` within a few seconds (any answer, even "not found", is reachable)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().model_info(model, timeout=5)
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001  (no network, DNS, proxy, timeout: each library names them differently)
        return False
    return True


def _go_offline() -> None:
    """Offline mode for the rest of this process, as HF_HUB_OFFLINE=1 at start would have set it."""
    import huggingface_hub.constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True

"""`evaluate`: mean reward, accuracy and pass@k of a VLM on a dataset, with the trainer's row handling; and
`evaluate_with_tools`: the accuracy of a trainer's model rolled out with its tools, multi-turn, as training rolls out."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..data.rows import add_image_sizes, check_dataset, dataset_row, name_failing_row, prepare_row, row_images
from ..data.thinking import THINKING_COLUMN, prompts_open_thinking
from ..media.columns import video_column
from ..media.pixel_budget import pixel_budget_for_call
from ..media.processing import holds_clips, process_prompts
from ..media.video_budget import video_budget_for_call
from ..models.modes import generating
from ..rewards.checks import RewardFunctionError, checked_reward_func, reward_name

__all__ = ["evaluate", "evaluate_with_tools", "pass_at_k", "sample_completions"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(
    model: Any,
    processor: Any,
    dataset: Any,
    reward_funcs: Callable | Sequence[Callable],
    num_generations: int = 1,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    batch_size: int = 16,
    correct_threshold: float = 1.0,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    seed: int = 0,
    chat_template_kwargs: dict[str, Any] | None = None,
    **video: Any,
) -> dict[str, float]:
    """Generate for every row and score with `reward_funcs`.

    Args:
        model, processor: a VLM and its processor (e.g. from `FastBaseVisionModel.from_pretrained`).
        dataset: rows as for `VLMGRPOTrainer` (`prompt`, `image`/`images`, answer columns).
        reward_funcs: TRL-style reward functions. The first one decides correctness (`accuracy`, pass@k): a
            completion is correct when its reward is >= `correct_threshold`.
        num_generations: samples per prompt. 1 decodes greedily; more samples at `temperature`, for pass@k.
        max_new_tokens: completion length limit.
        min_pixels / max_pixels: image pixel budget for this call (None: the processor's own, which is the training
            budget after `VLMGRPOTrainer`). A Qwen-VL processor gets it for the call and its own back afterwards;
            for other processors images are fitted to it first (see `vlm_grpo.media.pixel_budget`).
        video: the video budget for rows with clips, as `VLMGRPOConfig` names it (`video_fps`, `video_max_frames`,
            `video_num_frames`, `video_min_pixels`, `video_max_pixels`); unset ones are the defaults, or the
            processor's own pixel budget (`vlm_grpo.media.video_budget`), which it gets back afterwards.
        chat_template_kwargs: passed to the chat template, as the trainer's config passes them (e.g.
            `{"enable_thinking": False}`), so held-out prompts read as the training prompts do.

    Returns:
        `{"mean_reward": ..., "accuracy": ..., "reward/<name>": ..., "pass@k": ...}` with pass@k for k = 1, 2, 4, ...
        up to `num_generations`. `accuracy` is the mean correctness over all samples (pass@1).
    """
    funcs = _check_funcs(reward_funcs)
    if num_generations < 1:
        raise ValueError("num_generations must be at least 1.")
    rewards: dict[str, list[float]] = {reward_name(f): [] for f in funcs}
    correct_per_row: list[int] = []
    batches = _scored_batches(model, processor, dataset, funcs, num_generations, max_new_tokens, temperature,
                              batch_size, min_pixels, max_pixels, seed, video, chat_template_kwargs)  # fmt: skip
    for _, scores in batches:
        for name, values in scores.items():
            rewards[name].extend(float("nan") if v is None else float(v) for v in values)
        first = scores[reward_name(funcs[0])]
        for i in range(0, len(first), num_generations):
            correct_per_row.append(
                sum(1 for s in first[i : i + num_generations] if s is not None and s >= correct_threshold)
            )

    result: dict[str, float] = {}
    for name, values in rewards.items():
        valid = [v for v in values if not math.isnan(v)]
        result[f"reward/{name}"] = sum(valid) / len(valid) if valid else float("nan")
    result["mean_reward"] = sum(result[f"reward/{reward_name(f)}"] for f in funcs) / len(funcs)
    result["accuracy"] = sum(correct_per_row) / (len(correct_per_row) * num_generations)
    k = 1
    while k <= num_generations:
        result[f"pass@{k}"] = sum(pass_at_k(num_generations, c, k) for c in correct_per_row) / len(correct_per_row)
        k *= 2
    return result


@torch.no_grad()
def evaluate_with_tools(
    trainer: Any,
    dataset: Any,
    reward_funcs: Callable | Sequence[Callable],
    *,
    batch_size: int = 16,
    correct_threshold: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """Roll out every row of `dataset` once with `trainer`'s tools and score it: held-out accuracy with tools.

    The rollouts are the training ones (`trainer._generate_and_score_completions` in eval mode: TRL's tool loop over
    the trainer's environments, each turn on the fast generator, the tools' images in the conversation), decoded
    greedily, as `evaluate` decodes, up to `max_completion_length` and `max_tool_calling_iterations`.

    Args:
        trainer: a `VLMGRPOTrainer` given `tools` or an `environment_factory`.
        dataset: rows as for the trainer (`prompt`, `image`, the answer columns).
        reward_funcs: as for `evaluate`; the first decides correctness (>= `correct_threshold`).
        batch_size: rows rolled out together.
        seed: the random stream for the call (the trainer's and the GPU's given back as they were).

    Returns:
        `{"accuracy", "mean_reward", "reward/<name>", "tools/call_frequency", "tools/failure_frequency"}`: tool calls
        per rollout, and the share of them the tools refused, as TRL's training metrics count them.
    """
    funcs = _check_funcs(reward_funcs)
    if not (trainer.tools or trainer.environment_factories):
        raise ValueError("evaluate_with_tools needs a trainer given tools or an environment_factory; use evaluate.")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1.")
    dataset, _ = check_dataset(dataset, "dataset", check_images=False)
    rewards: dict[str, list[float]] = {reward_name(f): [] for f in funcs}
    calls = failures = 0
    saved = trainer.generation_config, trainer.num_generations_eval
    greedy = copy.deepcopy(trainer.generation_config)
    greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p = False, None, None, None, None
    device = trainer.accelerator.device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), generating(trainer.model):
            torch.manual_seed(seed)
            # One rollout per row: groups of one (TRL's eval mode groups `num_generations_eval` rollouts).
            trainer.generation_config, trainer.num_generations_eval = greedy, 1
            for start in range(0, len(dataset), batch_size):
                rows = [dict(r) for r in dataset.select(range(start, min(start + batch_size, len(dataset))))]
                trainer._generate_and_score_completions(rows)
                inputs, prompts, completions = trainer._rewarded
                columns = {k: [row.get(k) for row in inputs] for k in inputs[0] if k not in ("prompt",)}
                for func in funcs:
                    scores = func(prompts=prompts, completions=completions, **columns)
                    rewards[reward_name(func)].extend(float("nan") if v is None else float(v) for v in scores)
                messages = [m for c in completions if isinstance(c, list) for m in c]
                calls += sum(len(m.get("tool_calls") or []) for m in messages)
                # TRL answers a call that failed (a refused box, an unknown tool) with `{'error': ...}` as text.
                failures += sum(
                    m.get("role") == "tool" and str(m.get("content")).startswith("{'error'") for m in messages
                )
    finally:
        trainer.generation_config, trainer.num_generations_eval = saved
        trainer._metrics["eval"].clear()  # TRL's eval-mode metrics of these rollouts: not the training run's
    first = rewards[reward_name(funcs[0])]
    result = {f"reward/{name}": _nan_mean(values) for name, values in rewards.items()}
    result["mean_reward"] = sum(result[f"reward/{reward_name(f)}"] for f in funcs) / len(funcs)
    result["accuracy"] = sum(1 for v in first if v >= correct_threshold) / len(first)
    result["tools/call_frequency"] = calls / len(first)
    result["tools/failure_frequency"] = failures / calls if calls else 0.0
    return result


def _nan_mean(values: list[float]) -> float:
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else float("nan")


def sample_completions(
    model: Any,
    processor: Any,
    dataset: Any,
    reward_funcs: Callable | Sequence[Callable] = (),
    *,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    **video: Any,
) -> list[dict[str, Any]]:
    """The model's greedy completion for every row of `dataset`, with each reward function's score.

    Returns one dict per row: `{"completion": text, "<reward name>": score, ...}` (a score is None where the reward
    could not score the row). Rows are handled as in `evaluate` (and the trainer; `video` and `chat_template_kwargs` as
    there); e.g. to show what a model answers before and after training with
    `vlm_grpo.training.display.CompletionTable`.
    """
    funcs = _check_funcs(reward_funcs, allow_none=True)
    samples: list[dict[str, Any]] = []
    batches = _scored_batches(model, processor, dataset, funcs, 1, max_new_tokens, 1.0, batch_size, min_pixels,
                              max_pixels, 0, video, chat_template_kwargs)  # fmt: skip
    for completions, scores in batches:
        for i, completion in enumerate(completions):
            samples.append({"completion": completion, **{name: values[i] for name, values in scores.items()}})
    return samples


def _check_funcs(reward_funcs: Callable | Sequence[Callable], allow_none: bool = False) -> list[Callable]:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs and not allow_none:
        raise ValueError("evaluate needs at least one reward function (the first decides correctness).")
    return [checked_reward_func(f) for f in funcs]  # a raise or a bad value named with its row, as in training


def _scored_batches(model, processor, dataset, funcs, num_generations, max_new_tokens, temperature, batch_size,
                    min_pixels, max_pixels, seed, video, template_kwargs=None) -> Iterator[tuple[list[str], dict[str, list[float | None]]]]:  # fmt: skip
    """Generate for the rows of `dataset` batch by batch (inference mode, seeded); yield each batch's completions
    (`num_generations` per row, in row order) and every reward function's scores of them."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1.")
    dataset, _ = check_dataset(dataset, "dataset", check_images=False)
    if video_column(dataset.column_names):
        from ..media.processing import check_video_support

        check_video_support(processor, model)
    tokenizer = getattr(processor, "tokenizer", processor)
    padding_side = tokenizer.padding_side
    device = next(model.parameters()).device
    # Seeded for the call, and every random generator it touches (the CPU's, the model's GPU's) given back as it was:
    # an evaluation during training must not change the training run's random stream. Inference mode for the call,
    # then the model's own mode back exactly (train/eval, checkpointing and its kwargs): an evaluation before training
    # must not change how the trainer trains.
    gpus = [device] if device.type == "cuda" else []
    try:
        with (
            torch.random.fork_rng(devices=gpus),
            generating(model),
            pixel_budget_for_call(processor, min_pixels, max_pixels) as budget,
            video_budget_for_call(processor, **video) as clip_budget,
        ):
            torch.manual_seed(seed)
            tokenizer.padding_side = "left"
            yield from _batches(model, processor, dataset, funcs, num_generations, max_new_tokens, temperature,
                                batch_size, (budget, clip_budget), device, template_kwargs or {})  # fmt: skip
    finally:
        tokenizer.padding_side = padding_side


def _batches(model, processor, dataset, funcs, num_generations, max_new_tokens, temperature, batch_size, budget,
             device, template_kwargs) -> Iterator[tuple[list[str], dict[str, list[float | None]]]]:  # fmt: skip
    for start in range(0, len(dataset), batch_size):
        raw = [dict(r) for r in dataset.select(range(start, min(start + batch_size, len(dataset))))]
        rows = add_image_sizes([prepare_row(r, *budget) for r in raw], processor)
        completions, opened = _generate(
            model, processor, rows, num_generations, max_new_tokens, temperature, device, template_kwargs
        )
        expanded = [dataset_row(row) for row in rows for _ in range(num_generations)]
        # Every column but the prompt, the image too, as training gives them (TRL passes every column of the row):
        # a reward reading `image` scores held-out rows as it scores training rows.
        columns = {k: [row.get(k) for row in expanded] for k in expanded[0] if k != "prompt"}
        columns[THINKING_COLUMN] = opened  # as the trainer marks its rows (`data.thinking`)
        prompts = [row["prompt"] for row in expanded]
        try:
            scores = {reward_name(f): list(f(prompts=prompts, completions=completions, **columns)) for f in funcs}
        except RewardFunctionError as error:  # the row named by its file and line, where the dataset kept them
            name_failing_row(error, [row for row in rows for _ in range(num_generations)])
            raise
        yield completions, scores


def _generate(
    model, processor, rows, num_generations, max_new_tokens, temperature, device, template_kwargs
) -> tuple[list[str], list[bool]]:
    """Each row's `num_generations` completions, and for each whether its prompt opened the thinking."""
    from trl.data_utils import prepare_multimodal_messages

    if holds_clips([row["prompt"] for row in rows]):  # images and clips already placed (prepare_row)
        inputs = process_prompts(
            processor,
            [row["prompt"] for row in rows],
            template_kwargs=template_kwargs,
            return_tensors="pt",
            padding=True,
        )
        inputs = {k: v for k, v in inputs.items() if k not in ("num_images", "num_videos")}
    else:
        images = []
        prompts = []
        for row in rows:
            images_of_row = row_images(row)
            prompt = row["prompt"]
            if isinstance(prompt, list):
                prompt = prepare_multimodal_messages(prompt, images=images_of_row)
            prompts.append(prompt)
            images.append(images_of_row)
        if isinstance(prompts[0], list):
            # The config's template arguments, as TRL renders the training prompts with them.
            text = processor.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False, **template_kwargs)
        else:
            text = prompts
        has_images = any(images)
        inputs = processor(text=text, images=images if has_images else None, return_tensors="pt", padding=True)
    inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    sampling = num_generations > 1
    # As in TRL's rollouts: a sampled image (or video) placeholder token would have no features behind it, and since
    # training never lets the model emit it, its logit is untrained and can win under greedy decoding.
    config = getattr(model, "config", None)
    image_token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    suppressed = [t for t in (image_token, getattr(config, "video_token_id", None)) if t is not None]
    outputs = model.generate(
        suppress_tokens=suppressed or None,
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=None,
        top_k=None,
        num_return_sequences=num_generations,
    )
    completion_ids = outputs[:, inputs["input_ids"].shape[1] :]
    opened = [flag for flag in prompts_open_thinking(processor, inputs["input_ids"]) for _ in range(num_generations)]
    return processor.batch_decode(completion_ids, skip_special_tokens=True), opened

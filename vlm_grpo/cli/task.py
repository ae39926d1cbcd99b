"""A task: what to train on and how it is scored, bundled so a script says it once.

Shaped like an environment of willccbb/verifiers (a dataset, an eval dataset and a rubric): a `Task` holds the
training rows, the held-out rows, the reward functions (TRL's signature, `(prompts, completions, **columns) ->
list[float | None]`), the one reward reported as held-out accuracy, and the answer columns those rewards read.
The `vlm-grpo` command, `examples/image_reasoning_grpo.py` and the notebook all build one:

    task = synthetic_task("count", difficulty=2)              # vlm_grpo.data's scenes, with the task's own reward
    task = dataset_task("data/train.jsonl", reward_funcs=[think_answer_format, answer_accuracy])   # your data
    trainer = VLMGRPOTrainer(model, task.reward_funcs, args=config, train_dataset=task.train, processing_class=processor)
    evaluate(model, processor, task.test, task.eval_funcs)    # the accuracy reward first: it decides correctness

This module sits above `vlm_grpo.data` (rows) and `vlm_grpo.rewards` (scoring) and imports both, so neither has to
know the other; it is `vlm_grpo.cli.task`, one task object, beside `vlm_grpo.data.tasks`, the scene generators.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data import answer_words, make_visual_reasoning_dataset
from ..data.load import DatasetError, load_dataset_rows
from ..data.prompts import apply_template, with_system
from ..data.tasks import check_task
from ..rewards import (
    BatchReward,
    FromAnswers,
    RewardFunc,
    answer_accuracy,
    closed_vocabulary,
    counting,
    iou,
    make_answer_choice_reward,
    make_choice_reward,
    reward_columns,
)
from ..rewards.checks import reward_name
from .demo import DEMO

__all__ = ["SYNTHETIC_REWARDS", "Task", "data_words", "dataset_task", "default_accuracy", "synthetic_task"]


@dataclass
class Task:
    """Training rows, held-out rows and the rewards that score them.

    Attributes:
        name: how logs and plots name it, e.g. `synthetic task 'color'` or `train.jsonl`.
        train: the training rows (`prompt`, `image`/`images`, the answer columns).
        test: held-out rows for the accuracy before and after training, or None.
        reward_funcs: the training rewards, TRL's signature.
        accuracy: the reward reported as held-out accuracy (a completion is correct when it scores >= 1). Chosen by
            the constructor, not guessed from names; it need not be among `reward_funcs` (then it is only evaluated).
        reward_weights: one weight per training reward, or None (all 1.0), as `VLMGRPOConfig.reward_weights`.
        answer_words: the words a tiny model's tokenizer needs (`build_tiny_vlm(words=...)`): a synthetic task's
            answers, or every word of your data's prompts and answers (so an offline smoke run can learn on it).
        answer_values: the answer column's distinct values when they are a closed vocabulary
            (`vlm_grpo.rewards.closed_vocabulary`: a few short answers, repeated), else None; they set `chance`.
        source_columns: your data's column for each role (`prompt`, `image`, `video`, `answer`); empty for a
            synthetic task.
        image_found_by_content: True when no image column was named and the one holding images was found by its
            values (`vlm_grpo.data.image_columns`), so the command says which it is.
    """

    name: str
    train: Any
    test: Any | None
    reward_funcs: list[RewardFunc]
    accuracy: RewardFunc
    reward_weights: list[float] | None = None
    answer_words: list[str] | None = None
    answer_values: list[str] | None = None
    source_columns: dict[str, str] = field(default_factory=dict)
    image_found_by_content: bool = False

    def __post_init__(self) -> None:
        self.reward_funcs = list(self.reward_funcs)
        if not self.reward_funcs or not all(callable(f) for f in [*self.reward_funcs, self.accuracy]):
            raise ValueError("a task needs at least one reward function, and every reward (accuracy too) callable.")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"{len(self.reward_weights)} reward weight(s) for {len(self.reward_funcs)} reward function(s)."
            )

    @property
    def chance(self) -> float | None:
        """The held-out accuracy of guessing one of `answer_values` at random: 1 / their number; None for a task
        without a closed vocabulary of answers."""
        return 1 / len(self.answer_values) if self.answer_values else None

    @property
    def eval_funcs(self) -> list[RewardFunc]:
        """The rewards for `vlm_grpo.evaluate`: the accuracy reward first (evaluate's first reward decides
        correctness), then the other training rewards."""
        return [self.accuracy] + [f for f in self.reward_funcs if f is not self.accuracy]

    @property
    def answer_columns(self) -> dict[str, tuple[str, ...]]:
        """Each reward's gold-answer columns, by reward name (`vlm_grpo.rewards.reward_columns`: what a `BatchReward`
        declares, or a plain function's required column parameters); rewards that read none are left out."""
        return {reward_name(f): reward_columns(f) for f in self.eval_funcs if reward_columns(f)}

    def check_columns(self) -> None:
        """Raise `DatasetError` when a split lacks the answer columns a reward reads, naming the reward and the
        columns; TRL would otherwise fail at the first reward call, after the model has loaded."""
        for split, rows in (("training", self.train), ("held-out", self.test)):
            if rows is None:
                continue
            present = set(rows.column_names)
            lacking = [f for f in self.eval_funcs if _lacks_columns(f, present)]
            if lacking:
                needs = "; ".join(f"{reward_name(f)} reads {_columns_text(f)}" for f in lacking)
                hint = (
                    "; name yours with --answer_column" if any("answer" in reward_columns(f) for f in lacking) else ""
                )
                raise DatasetError(
                    f"{needs}, which the {split} rows lack (columns: {', '.join(sorted(present))}){hint}."
                )

    def with_reward(self, func: RewardFunc, weight: float = 1.0) -> Task:
        """This task with one more training reward, weighted against the others (1.0 each unless weighted), e.g. a
        format reward worth half: `task.with_reward(think_answer_format, 0.5)`. The accuracy reward stays."""
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        return dataclasses.replace(self, reward_funcs=[*self.reward_funcs, func], reward_weights=[*weights, weight])


def _columns_text(func: RewardFunc) -> str:
    # A BatchReward reads one of its gold columns; a plain function needs every column it names.
    joiner = " or " if isinstance(func, BatchReward) else " and "
    return joiner.join(f"`{c}`" for c in reward_columns(func))


def _lacks_columns(func: RewardFunc, present: set[str]) -> bool:
    columns = reward_columns(func)
    if isinstance(func, BatchReward):  # it reads the first of its gold columns that is present
        return bool(columns) and not present & set(columns)
    return not set(columns) <= present  # a plain function's column parameters are all required


def default_accuracy(reward_funcs: Sequence[RewardFunc]) -> RewardFunc:
    """The reward reported as accuracy when none is named: the first that reads a gold answer column (a format
    reward, which reads none, would count a well-formatted wrong answer as correct); else the first."""
    return next((f for f in reward_funcs if reward_columns(f)), reward_funcs[0])


def _choice(task: str) -> Callable[[int], RewardFunc]:
    # Closed vocabulary: 1.0 when the completion names exactly one of the task's answers, the right one.
    return lambda difficulty: make_choice_reward(answer_words(task, difficulty))


#: Each synthetic task's own reward, made for a difficulty (which sets the answer vocabulary).
SYNTHETIC_REWARDS: dict[str, Callable[[int], RewardFunc]] = {
    "color": _choice("color"),
    # Counts and sums: one committed number, in digits or words ("three"; "none" for 0), no hedge ("about 3", "3+").
    "count": lambda difficulty: counting,
    "spatial": _choice("spatial"),
    "arithmetic": lambda difficulty: counting,
    "locate": lambda difficulty: iou,  # a box: its IoU with the gold box, in the image's pixels
    "position": _choice("position"),
    "motion": _choice("motion"),  # video tasks: which way the shape moves, what colour it ends up
    "color_change": _choice("color_change"),
    "zoom": _choice("zoom"),  # the small mark's shape: made for image tools (`--tools zoom`)
    "zoom_color": _choice("zoom_color"),  # the centre dot's colour, which only a zoom shows
}


def synthetic_task(
    name: str = DEMO.task,
    *,
    difficulty: int = DEMO.difficulty,
    train_size: int = DEMO.train_size,
    test_size: int = DEMO.test_size,
    image_size: int | None = None,
    seed: int = DEMO.seed,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    reward_funcs: Sequence[RewardFunc] | None = None,
    accuracy: RewardFunc | None = None,
) -> Task:
    """A procedural task of `vlm_grpo.data` (`color`, `count`, `spatial`, `arithmetic`, `locate`, `position`, and the
    video tasks `motion` and `color_change`) with its own reward (`SYNTHETIC_REWARDS`) as training reward and accuracy.

    Args:
        name, difficulty, image_size, seed: as `make_visual_reasoning_dataset`; train and test images are disjoint.
        train_size, test_size: rows of each split (`test_size` 0: no held-out rows).
        system_prompt: a system message before every question.
        prompt_template: the question's text with `{prompt}` replaced by it, e.g. `"{prompt} Think first."`.
        reward_funcs: other training rewards instead of the task's own.
        accuracy: the reward reported as accuracy; default the task's own reward, or with `reward_funcs` given,
            `default_accuracy(reward_funcs)`.

    Raises:
        ValueError: an unknown task or difficulty, a template without `{prompt}`, or rewards whose answer columns
            the rows lack (`DatasetError`).
    """
    image_size = check_task(name).image_size if image_size is None else image_size
    if prompt_template is not None and "{prompt}" not in prompt_template:
        raise ValueError("prompt_template must contain {prompt}, where the question goes.")
    own = SYNTHETIC_REWARDS[name](difficulty)
    funcs = list(reward_funcs) if reward_funcs else [own]
    make = {"seed": seed, "image_size": image_size, "difficulty": difficulty}
    train = make_visual_reasoning_dataset(name, train_size, split="train", **make)
    test = make_visual_reasoning_dataset(name, test_size, split="test", **make) if test_size else None
    if system_prompt or prompt_template:
        train, test = (_edit_prompts(d, system_prompt, prompt_template) for d in (train, test))
    answers = _answers(train, test)
    funcs, accuracy = _built(funcs, accuracy, answers)
    if accuracy is None:
        accuracy = default_accuracy(funcs) if reward_funcs else own
    words = answer_words(name, difficulty, image_size=image_size)
    values = closed_vocabulary(answers)
    task = Task(f"synthetic task '{name}'", train, test, funcs, accuracy, answer_words=words, answer_values=values)
    task.check_columns()
    return task


def _edit_prompts(dataset: Any, system_prompt: str | None, template: str | None) -> Any:
    """A system prompt and a template on synthetic rows (chat prompts of one user message with string content)."""
    if dataset is None:
        return None
    import datasets

    def edit(row: dict[str, Any]) -> dict[str, Any]:
        messages = [dict(m) for m in row["prompt"]]
        messages[-1]["content"] = apply_template(messages[-1]["content"], template)
        return {"prompt": with_system(messages, system_prompt)}

    datasets.disable_progress_bars()  # a quick map of generated rows is not worth a bar
    try:
        return dataset.map(edit)
    finally:
        datasets.enable_progress_bars()


def dataset_task(
    source: str,
    split: str = "train",
    *,
    reward_funcs: Sequence[RewardFunc] | None = None,
    accuracy: RewardFunc | None = None,
    reward_weights: Sequence[float] | None = None,
    test_size: float = 0.1,
    seed: int = 0,
    **load_kwargs: Any,
) -> Task:
    """Your own data (`vlm_grpo.data.load.load_grpo_dataset`: a Hub id, a `save_to_disk` directory, a JSONL / CSV /
    Parquet file, an image folder or a video folder) with your rewards.

    Args:
        source, split: what to load and the split to train on.
        reward_funcs: training rewards (`vlm_grpo.rewards.resolve_reward` turns names into them; `answer_choice` is
            built from the answer column here). Default: `answer_choice` when the answers are a closed vocabulary of
            words (`closed_vocabulary(answers, numbers=False)`: 2 to 20 short answers, repeated), else
            `answer_accuracy`; both need an `answer` column.
        accuracy: the reward reported as accuracy; default `default_accuracy(reward_funcs)`.
        reward_weights: one weight per training reward.
        test_size: held-out rows when no `eval_split` is given: a fraction (< 1) or a count; 0: none.
        seed: the held-out rows' shuffle.
        load_kwargs: the rest of `load_grpo_dataset`'s options: `name` (Hub configuration), `eval_split`,
            `prompt_column`, `image_column`, `video_column`, `answer_column`, `system_prompt`, `prompt_template`.

    Raises:
        DatasetError: rows that cannot be used as given, or that lack a reward's answer columns (the message names
            the fix); `OSError` for a source that cannot be read or fetched.
    """
    from ..data.rows import check_dataset

    loaded = load_dataset_rows(source, split, test_size=test_size, seed=seed, **load_kwargs)
    train, test = loaded.train, loaded.test
    check_dataset(train, "dataset", check_images=False)  # rows the trainer would refuse, before a model loads
    if not reward_funcs:
        if "answer" not in train.column_names:
            raise DatasetError(f"no answer column (columns: {', '.join(train.column_names)}): name it with "
                               "--answer_column, or give --reward_funcs.")  # fmt: skip
        words = closed_vocabulary(_answers(train, test), numbers=False)
        reward_funcs = [make_answer_choice_reward(words)] if words else [answer_accuracy]
    funcs = list(reward_funcs)
    gold = _gold_column(accuracy or default_accuracy(funcs), train)
    answers = _answers(train, test, column=gold)
    funcs, accuracy = _built(funcs, accuracy, _answers(train, test))
    weights = list(reward_weights) if reward_weights is not None else None
    name = os.path.basename(source.rstrip("/")) or source
    accuracy = default_accuracy(funcs) if accuracy is None else accuracy
    # The tiny model must be able to say every gold answer a reward reads, whatever the column is called.
    read = {c for f in [*funcs, accuracy] for c in reward_columns(f)} & set(train.column_names)
    task = Task(name, train, test, funcs, accuracy, reward_weights=weights,
                answer_words=data_words(train, test, columns=("answer", *sorted(read))),
                answer_values=closed_vocabulary(answers), source_columns=loaded.columns,
                image_found_by_content=loaded.image_found_by_content)  # fmt: skip
    task.check_columns()
    return task


def _gold_column(func: RewardFunc, rows: Any) -> str:
    """The column `func` reads its gold answers from in `rows` (the first it names that the rows have), else
    `answer`: its values set the chance level."""
    return next((c for c in reward_columns(func) if c in rows.column_names), "answer")


def _answers(*splits: Any, column: str = "answer") -> list[Any]:
    """The `column` (gold answers) of the splits given (rows of a split without one: none)."""
    return [a for rows in splits if rows is not None and column in rows.column_names for a in rows[column]]


def _built(
    funcs: list[RewardFunc], accuracy: RewardFunc | None, answers: list[Any]
) -> tuple[list[RewardFunc], RewardFunc | None]:
    """Rewards named before the data was loaded (`FromAnswers`, e.g. `answer_choice`) built from its answers, one
    object where the same one is named twice (training reward and accuracy)."""
    built: dict[int, RewardFunc] = {}

    def build(func: RewardFunc) -> RewardFunc:
        if not isinstance(func, FromAnswers):
            return func
        if not answers:
            raise DatasetError(f"{func.__name__} is made from the answer column, which the rows lack; name yours "
                               "with --answer_column.")  # fmt: skip
        if id(func) not in built:
            built[id(func)] = func.build(answers)
        return built[id(func)]

    return [build(f) for f in funcs], None if accuracy is None else build(accuracy)


def data_words(*datasets: Any, columns: Sequence[str] = ("answer",)) -> list[str]:
    """Every word of the rows' prompts (all messages' text) and gold `columns` (default `answer`; give every column
    your rewards read), split as the tiny tokenizers split text (`vlm_grpo.tiny.split_words`), sorted: the
    vocabulary a tiny model needs to read your data and say its answers. Images are not read."""
    from ..tiny import split_words

    texts: list[str] = []
    for rows in (d for d in datasets if d is not None):
        golds = [c for c in dict.fromkeys(columns) if c in rows.column_names and c != "prompt"]
        for row in rows.select_columns([c for c in ("prompt", *golds) if c in rows.column_names]):
            texts.extend(_prompt_texts(row.get("prompt")))
            for answer in (row[c] for c in golds):
                values = answer if isinstance(answer, (list, tuple)) else [answer]
                texts.extend(str(a) for a in values if isinstance(a, (str, int, float)))  # words, not images
    return sorted({word for text in texts for word in split_words(text)})


def _prompt_texts(prompt: Any) -> list[str]:
    """The text of a prompt: the string, or every text part of its chat messages."""
    if isinstance(prompt, str):
        return [prompt]
    texts = []
    for message in prompt or []:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            texts.extend(block.get("text") or "" for block in content or [])
    return texts

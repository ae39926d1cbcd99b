"""A reward that pays nothing at the start of training, said once with its likely cause.

GRPO learns from the differences between a prompt's completions: a reward that pays 0 for every completion of the
first steps gives no signal, and the run goes on quietly learning nothing (issue 46: a tiny model built without the
answers' words scored 0.0 at every step). `ZeroRewardNote` watches the first logged steps and says, once, which
reward paid nothing and the likely cause: the model cannot write the gold answers (its vocabulary lacks them), every
completion was cut at `max_completion_length`, or the completions never hold the gold answer the reward reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

__all__ = ["ZeroRewardNote", "unwritable_answers"]


def unwritable_answers(tokenizer: Any, answers: list[Any]) -> list[str]:
    """The answers among `answers` that `tokenizer` cannot write: encoding them needs its unknown token (a word-level
    vocabulary without them, as a tiny model built for other words has)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    texts = dict.fromkeys(str(a) for a in answers if isinstance(a, (str, int, float)))
    return [t for t in texts if unk in tokenizer(t, add_special_tokens=False)["input_ids"]]


class ZeroRewardNote(TrainerCallback):
    """Say once, after the first `steps` logged training records (or at the end of a shorter run), which reward paid 0
    for every completion of all of them, and the likely cause (`say` prints it; main process only).

    Args:
        trainer: the trainer (its processor, training rows, reward functions and sampled completions are read).
        say: how the line is shown (e.g. `tqdm.write`, above a progress bar).
        steps: the logged training records watched.
    """

    def __init__(self, trainer: Any, say: Callable[[str], None], steps: int = 5) -> None:
        self.trainer, self.say, self.steps = trainer, say, steps
        self.records: list[dict[str, Any]] = []
        self.done = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Keep the training records of the first steps; judge them once there are `steps`."""
        if self.done or not logs or "reward" not in logs or not state.is_world_process_zero:
            return
        self.records.append(dict(logs))
        if len(self.records) >= self.steps:
            self._judge()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A run shorter than `steps` records is judged on what it logged."""
        if not self.done and self.records and state.is_world_process_zero:
            self._judge()

    def _judge(self) -> None:
        self.done = True
        names = [k[len("rewards/") : -len("/mean")] for k in self.records[0] if k.startswith("rewards/") and
                 k.endswith("/mean")]  # fmt: skip
        silent = [n for n in names if all(_zero(r.get(f"rewards/{n}/mean")) and _zero(r.get(f"rewards/{n}/std"))
                                          for r in self.records)]  # fmt: skip
        if silent:
            shown = ", ".join(f"`{n}`" for n in silent)
            self.say(f"note: {'reward' if len(silent) == 1 else 'rewards'} {shown} paid 0 for every completion of the "
                     f"first {len(self.records)} logged steps, so GRPO has nothing to learn from there; likely cause: "
                     f"{self._cause(silent[0])}")  # fmt: skip

    def _cause(self, name: str) -> str:
        from ..rewards import reward_columns

        trainer = self.trainer
        func = dict(zip(trainer.reward_func_names, trainer.reward_funcs)).get(name)
        columns = [c for c in (reward_columns(func) if func is not None else ()) if c in _columns(trainer)]
        answers = list(trainer.train_dataset[columns[0]][:200]) if columns else []
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        missing = unwritable_answers(tokenizer, answers)
        if missing:
            return (f"the model's vocabulary lacks {len(missing)} of the gold answers in `{columns[0]}` (e.g. "
                    f"{missing[0]!r}), so it cannot write them; build the tiny model with those words "
                    "(build_tiny_vlm(words=...); vlm-grpo does for the columns your rewards read) or use a pretrained "
                    "model.")  # fmt: skip
        # Cut before the end, where the budget is more than a word or two: the answer may never have been reached.
        clipped = all(r.get("completions/clipped_ratio") == 1 for r in self.records)
        if clipped and trainer.args.max_completion_length > 8:
            length = trainer.args.max_completion_length
            return (f"every completion was cut at max_completion_length ({length} tokens) before it ended; give the "
                    "answer room with a larger one.")  # fmt: skip
        where = f" in `{columns[0]}`" if columns else ""
        return (f"the completions never hold the gold answer{where} as the reward reads it (see the samples in "
                "metrics.jsonl); a model this new says other words first: a pretrained model, or a reward that pays "
                "for the answer named first (answer_choice), gives a signal sooner.")  # fmt: skip


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value == 0


def _columns(trainer: Any) -> list[str]:
    return list(getattr(trainer.train_dataset, "column_names", None) or [])

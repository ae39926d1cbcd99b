"""Non-finite steps: a step whose loss or gradient norm is NaN / inf never reaches the weights or a checkpoint.

One NaN step (bf16 overflow, a batch that breaks the model, rewards whose group mean overflows float32) goes through
AdamW's moments into every weight and cannot be undone; transformers applies it all the same (its
`logging_nan_inf_filter` only hides it from the logged loss). `NonFiniteGuard` reads each micro-batch's loss (from the
trainer's loss) and the gradient norm transformers computes before every optimizer step (`Trainer._get_grad_norm`,
clipping or not), and when either is not finite it drops the gradients before the optimizer sees them: torch's
optimizers skip a parameter without a gradient, so the weights, AdamW's moments and step count, and weight decay stay
as they were. The step still counts (the step number and the learning-rate schedule go on).

Each skipped step is logged with a warning and counted in the training records as `nonfinite_steps` (the run's count
so far, from the first skip on; trackers show it as `train/nonfinite_steps`); the count rides in each checkpoint's
`trainer_state.json`. Once `max_nonfinite_steps` steps in a row were skipped the cause is persistent, and the run
stops with `NonFiniteTraining`: one line naming the steps, the values and, where the rewards explain it, which reward.

Weights can also turn non-finite from finite gradients (a learning rate that overflows, `adam_epsilon=0`): after
every optimizer step the updated weights are checked (one fused norm), and a non-finite one stops the run before
generation samples from them or a checkpoint holds them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..processes import any_process

__all__ = ["NonFiniteGuard", "NonFiniteTraining", "reward_overflow"]

logger = logging.getLogger(__name__)

METRIC = "nonfinite_steps"
_FLOAT32_MAX = torch.finfo(torch.float32).max


class NonFiniteTraining(RuntimeError):
    """Training stopped: too many steps in a row had a NaN / inf loss or gradient norm, or the weights turned
    non-finite; the message names the steps and the likely cause."""


def reward_overflow(rewards_per_func: Any, names: list[str], num_generations: int) -> str:
    """A sentence naming the reward whose values overflow float32 in TRL's group mean (TRL keeps rewards as float32
    and sums a group's before dividing), or "" when the rewards of the last batch cannot explain a NaN."""
    if not isinstance(rewards_per_func, torch.Tensor) or rewards_per_func.numel() == 0:
        return ""
    largest = rewards_per_func.detach().double().abs().nan_to_num(nan=0.0).amax(dim=0)
    for name, value in zip(names, largest.tolist()):
        if value * max(num_generations, 1) >= _FLOAT32_MAX:
            return (f"The rewards of {name} reach {value:.3g}: a group of {num_generations} sums past float32's "
                    f"{_FLOAT32_MAX:.3g} (TRL keeps rewards as float32); scale the reward down.")  # fmt: skip
    return ""


class NonFiniteGuard(TrainerCallback, ExportableState):
    """Skips optimizer steps whose loss or gradient norm is not finite, counts them and stops the run after
    `trainer.args.max_nonfinite_steps` in a row. `VLMGRPOTrainer` adds one and feeds it `note_loss` (each
    micro-batch's loss) and `note_grad_norm` (transformers' norm, before each optimizer step)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.limit = int(getattr(trainer.args, "max_nonfinite_steps", 5))
        self.skipped = 0  # steps skipped in this run, resumed runs included
        self.in_a_row = 0
        self._losses: list[torch.Tensor] = []
        self._grad_norm: Any = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (transformers saves `ExportableState` callbacks in `trainer_state.json`)."""
        return {"args": {}, "attributes": {"skipped": self.skipped, "in_a_row": self.in_a_row}}

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember a training micro-batch's loss (no host sync: it is checked with the gradient norm)."""
        self._losses.append(loss.detach().float().reshape(-1)[:1])

    def note_grad_norm(self, grad_norm: Any) -> Any:
        """Remember the step's gradient norm (returned unchanged, for the caller to pass on)."""
        self._grad_norm = grad_norm
        return grad_norm

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start counting, or go on from the count a resumed checkpoint kept."""
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step else None
        attributes = (saved or {}).get("attributes", {})
        self.skipped, self.in_a_row = int(attributes.get("skipped", 0)), int(attributes.get("in_a_row", 0))
        self._losses, self._grad_norm = [], None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        """Drop the gradients of a step whose loss or gradient norm is not finite; stop after too many in a row."""
        losses, norm = self._losses, self._grad_norm
        self._losses, self._grad_norm = [], None
        checked = list(losses)
        if norm is not None:
            device = losses[0].device if losses else None
            checked.append(torch.as_tensor(norm, dtype=torch.float32, device=device).reshape(1))
        local_bad = bool(checked) and not bool(torch.isfinite(torch.cat(checked)).all())  # the step's one host sync
        if not any_process(local_bad, args):  # every rank skips the same steps, or their weights drift apart
            self.in_a_row = 0
            self._count()
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # skipped by the optimizer: no update, no moment, no weight decay
        self.skipped += 1
        self.in_a_row += 1
        self._count()
        step = state.global_step + 1
        loss = torch.cat(losses).sum().item() if losses else float("nan")
        seen = f"loss {loss:.3g}, gradient norm {float(norm) if norm is not None else float('nan'):.3g}"
        if self.in_a_row < self.limit:
            logger.warning("Step %d skipped: %s (not applied to the weights; %d in a row, the run stops at %d).",
                           step, seen, self.in_a_row, self.limit)  # fmt: skip
            return
        steps = f"step {step}" if self.in_a_row == 1 else f"steps {step - self.in_a_row + 1}-{step}"
        hint = reward_overflow(getattr(self.trainer, "_last_rewards_per_func", None),
                               list(self.trainer.reward_func_names), self.trainer.num_generations)  # fmt: skip
        raise NonFiniteTraining(
            f"{self.in_a_row} step(s) in a row had a non-finite loss or gradient norm ({steps}; the last: {seen}) and "
            f"were skipped, so training stops (--max_nonfinite_steps {self.limit}). "
            + (hint or "Lower --learning_rate, look for rows that break the model, or train without --fp16.")
        )

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        """Stop before anything reads or saves weights that the update just made non-finite from finite gradients."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # a sharded weight: this rank's part
        # One fused L1 norm per tensor (public `get_total_norm`), summed: NaN or inf if any weight is; the sum of
        # finite weights overflows only past 3.4e38, which no trained model's weights reach.
        total = torch.nn.utils.get_total_norm([p.detach() for p in local], norm_type=1.0) if local else None
        bad = total is not None and not bool(torch.isfinite(total))
        if any_process(bad, args):
            raise NonFiniteTraining(
                f"The weights turned non-finite in step {state.global_step + 1}'s optimizer update, from finite "
                "gradients: the learning rate (or adam_epsilon 0) overflows it; lower --learning_rate. Nothing of "
                "this step was saved."
            )

    def _count(self) -> None:
        """Put the run's count in the next training record, once there is something to count (TRL averages each
        key of `_metrics` over a logging window and clears it: one value, replaced every step, is logged as is)."""
        if self.skipped:
            self.trainer._metrics["train"][METRIC] = [float(self.skipped)]

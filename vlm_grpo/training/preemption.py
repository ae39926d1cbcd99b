"""Preemption: SIGTERM ends training at the end of the optimizer step in progress, with a complete checkpoint.

Cloud schedulers, Kubernetes, Slurm and `torchrun` send SIGTERM before they take a machine and SIGKILL a grace
period later (30 s to a few minutes). Python's default is to die at once, losing every step since the last
checkpoint. `PreemptionCallback` turns the signal into transformers' own stop: the handler only sets a flag; at the
end of the step in progress the callback asks the `TrainerControl` for a log record, a checkpoint and a stop, so
transformers writes `checkpoint-N` exactly as a scheduled save would (`save_strategy="no"` included) and its training
loop ends normally. `VLMGRPOTrainer.train` then raises `TrainingPreempted`, naming the checkpoint, instead of
returning as if training had finished: code after `train()` (a final save, an evaluation) would otherwise run on a
model that has not finished training, inside the grace period. The `vlm-grpo` command prints one line saying how to
resume and exits 0.

The time from the signal to the exit is the rest of the step in progress plus one checkpoint save. A second SIGTERM
changes nothing (launchers such as `torchrun` forward the signal their process group already got, so one preemption
can arrive twice); the scheduler's SIGKILL still ends a save that overruns its grace period. Outside
`train()` (loading, the held-out evaluations) SIGTERM keeps its default: nothing is lost there that a checkpoint
holds. Under several processes the flag is agreed on at every step (one all-reduce of a scalar), so every rank stops
and saves at the same step even when only some received the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..processes import any_process
from .checkpoints import incomplete_reason

__all__ = ["PreemptionCallback", "TrainingPreempted"]

logger = logging.getLogger(__name__)


class TrainingPreempted(Exception):
    """Training stopped at a signal (SIGTERM) after writing a complete checkpoint; resume from `checkpoint`."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None, seconds: float) -> None:
        self.signal_name, self.step, self.checkpoint, self.seconds = signal_name, step, checkpoint, seconds
        where = f"checkpoint {checkpoint} is complete" if checkpoint else "no complete checkpoint could be written"
        super().__init__(f"stopped by {signal_name} at step {step} ({seconds:.2f} s after it): {where}")


class PreemptionCallback(TrainerCallback):
    """Turns SIGTERM (or `signals`) during `Trainer.train` into a checkpoint and a stop at the end of the step.

    `received` is the signal's name once one arrived (None otherwise) and `seconds` how long the stop took, for the
    caller that raises `TrainingPreempted` after `train()` returns. `VLMGRPOTrainer` adds one.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: str | None = None
        self._since: float | None = None
        self._previous: dict[int, Any] = {}

    @property
    def seconds(self) -> float:
        """Seconds since the signal arrived (0 if none did)."""
        return 0.0 if self._since is None else time.monotonic() - self._since

    def _handle(self, signum: int, frame: Any) -> None:
        # Only a flag and a time: a signal handler runs between two bytecodes of whatever the main thread was doing,
        # where printing or saving could re-enter a half-done write.
        if self.received is None:
            self.received, self._since = signal.Signals(signum).name, time.monotonic()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Install the handler (the main thread only can; elsewhere the signal keeps its default)."""
        self.received, self._since = None, None
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Training runs outside the main thread: SIGTERM will end it without a checkpoint.")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After a signal: log, save and stop at this step (transformers' loop does each, in that order)."""
        # Every rank must save and stop at the same step, or those that go on wait for the others at their next
        # collective.
        if not any_process(self.received is not None, args):
            return
        self.received = self.received or "SIGTERM"  # another rank's signal
        logger.warning("%s received: saving a checkpoint at step %d and stopping.", self.received, state.global_step)
        control.should_log = control.should_save = control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Give the signals back their handlers (a signal from now on acts as it did before training)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def raise_if_stopped(self, output_dir: str, step: int) -> None:
        """Raise `TrainingPreempted` if training stopped at a signal, naming the checkpoint written at `step` (None
        if it is not complete: then only the checkpoints before it can be resumed from)."""
        if self.received is None:
            return
        checkpoint = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        complete = os.path.isdir(checkpoint) and incomplete_reason(checkpoint) is None
        raise TrainingPreempted(self.received, step, checkpoint if complete else None, self.seconds)

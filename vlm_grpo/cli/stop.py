"""How a `vlm-grpo` run that stops early ends: where it stopped, what it left and how to go on, in one line.

- Ctrl-C: `stops_as` turns a KeyboardInterrupt (SIGINT) during training, or after it, into `Stopped`, with the step
  reached; `main` prints `stopped_line` and exits with 130, the shell's status for SIGINT, instead of a ~60-line
  traceback.
- SIGTERM (a preempted machine) and the faults a run names (a reward that failed, non-finite steps, a checkpoint that
  could not be written, no reward signal): `stopped_on_fault` prints the line and gives the exit status, one per kind
  of fault so that a scheduler can tell whether to retry (`EXIT_STATUS`; the numbers are BSD's sysexits.h): 0 for a
  preemption with a checkpoint to resume from (with `resume_command`), 75 for one without (retry), 74 for a
  checkpoint that could not be written (free space, then resume), 70 for a reward function that failed (a bug in it),
  65 for non-finite training or no reward signal (the settings or data give nothing to learn: not a retry).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["EXIT_STATUS", "Stopped", "resume_command", "stopped_line", "stopped_on_fault", "stops_as"]

# The exit status of each way a run stops on its own (sysexits.h): whether running it again can help.
EXIT_STATUS = {
    "preempted": 0,  # a complete checkpoint written: resume
    "preempted_before_a_checkpoint": 75,  # EX_TEMPFAIL: nothing lost but the run: start it again
    "checkpoint_not_written": 74,  # EX_IOERR: free space (or raise the file-size limit), then resume
    "reward_failed": 70,  # EX_SOFTWARE: the reward function raised or returned the wrong thing: fix it, then resume
    "nothing_to_learn": 65,  # EX_DATAERR: non-finite steps, or a reward that never varies: change the settings
}

_PROG = "vlm-grpo"


class Stopped(KeyboardInterrupt):
    """Ctrl-C at `step` of `max_steps` of the run in `output_dir`: during training, or once it had ended (`trained`:
    `final/` saved or being saved)."""

    def __init__(self, step: int, max_steps: int, output_dir: str, trained: bool = False) -> None:
        super().__init__(step, max_steps, output_dir, trained)
        self.step, self.max_steps, self.output_dir, self.trained = step, max_steps, output_dir, trained


@contextlib.contextmanager
def stops_as(trainer: Any, output_dir: str, trained: bool) -> Iterator[None]:
    """A KeyboardInterrupt inside the block raised as `Stopped`, the progress bar's line ended first (so the line
    printed next starts a line of its own)."""
    from transformers import ProgressCallback

    from .ctrl_c import remembered

    try:
        with remembered(trainer):  # a Ctrl-C swallowed inside a step (a reward's bare `except:`) raised at its end
            yield
    except KeyboardInterrupt as interrupt:
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
        state = trainer.state
        raise Stopped(state.global_step, state.max_steps, output_dir, trained) from interrupt


def stopped_line(stopped: Stopped | None) -> str:
    """The one line a Ctrl-C ends with: the step, the checkpoints there are and the command that goes on from the
    newest, or how to start over without mixing the runs (None: stopped before training began)."""
    from ..training.checkpoints import newest_complete_checkpoint

    if stopped is None:  # loading, the held-out evaluation before training: nothing was trained
        return "stopped before training began; nothing was trained."
    where = f"stopped at step {stopped.step} of {stopped.max_steps}"
    final = os.path.join(stopped.output_dir, "final")
    if stopped.trained:
        saved = f"the trained model is in {final}" if os.path.isdir(final) else f"{final} was not written"
        return f"{where}, after training: {saved}; the held-out accuracy after, eval.json and the plot were not."
    checkpoint = newest_complete_checkpoint(stopped.output_dir)
    if checkpoint is not None:
        return f"{where}; checkpoints: newest {checkpoint}; resume with the same command plus --resume_from_checkpoint."
    return (f"{where}; checkpoints: none (--save_strategy steps --save_steps N keeps them); start over with the "
            "same command plus --overwrite_output_dir.")  # fmt: skip


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: `argv` with `--resume_from_checkpoint` (no value: the newest
    complete checkpoint) instead of any checkpoint it named, and without `--overwrite_output_dir`."""
    import shlex

    kept, skip_value = [], False
    for arg in argv:
        if skip_value and not arg.startswith("--"):  # the checkpoint the first run was resumed from
            skip_value = False
            continue
        skip_value = arg == "--resume_from_checkpoint"
        if not (skip_value or arg.startswith(("--resume_from_checkpoint=", "--overwrite_output_dir"))):
            kept.append(arg)
    return shlex.join([_PROG, *kept, "--resume_from_checkpoint"])


def stopped_on_fault(error: Exception, argv: list[str], output_dir: str | None) -> int | None:
    """One line and the exit status (`EXIT_STATUS`) for a run that stopped on purpose (0: preempted, resumable) or on
    a fault it names; None for any other error, which is raised as it is."""
    from ..rewards.checks import RewardFunctionError
    from ..training.checkpoint_writes import CheckpointWriteError
    from ..training.checkpoints import newest_complete_checkpoint
    from ..training.dynamic_sampling import NoRewardVariance
    from ..training.nonfinite import NonFiniteTraining
    from ..training.preemption import TrainingPreempted

    if isinstance(error, TrainingPreempted):
        if error.checkpoint is None:
            print(f"{_PROG}: {error}; nothing to resume from after this run's start", file=sys.stderr, flush=True)
            return EXIT_STATUS["preempted_before_a_checkpoint"]
        print(f"{_PROG}: {error}; resume with: {resume_command(argv)}", flush=True)
        return EXIT_STATUS["preempted"]
    if isinstance(error, (NoRewardVariance, CheckpointWriteError)):  # each names what is left and how to go on
        print(f"{_PROG}: error: {error}", file=sys.stderr, flush=True)
        return EXIT_STATUS["checkpoint_not_written" if isinstance(error, CheckpointWriteError) else "nothing_to_learn"]
    if not isinstance(error, (NonFiniteTraining, RewardFunctionError)):
        return None
    newest = newest_complete_checkpoint(output_dir) if output_dir else None
    left = (f" The newest complete checkpoint, {newest}, is intact: fix this, then resume with "
            "--resume_from_checkpoint." if newest else "")  # fmt: skip
    print(f"{_PROG}: error: {error}{left}", file=sys.stderr, flush=True)
    return EXIT_STATUS["reward_failed" if isinstance(error, RewardFunctionError) else "nothing_to_learn"]

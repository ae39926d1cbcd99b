"""Ctrl-C in the `vlm-grpo` command: where the run stopped, what it left and how to go on, in one line.

`stops_as` turns a KeyboardInterrupt (SIGINT) during training, or after it, into `Stopped`, with the step reached;
`main` prints `stopped_line` and exits with 130, the shell's status for SIGINT, instead of a ~60-line traceback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["Stopped", "stopped_line", "stops_as"]


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

    try:
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
    from .checkpoints import newest_complete_checkpoint

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

"""A Ctrl-C that code inside a training step swallowed still stops the run, at the end of that step.

Why: Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is. Inside a reward function with a
bare `except:` (or `except BaseException`), a `__del__` or a weakref callback, that exception is caught or printed as
"Exception ignored" and lost, and the run trains on as if Ctrl-C had not been pressed.

How: while `remembered` is active, SIGINT's handler notes the press before raising KeyboardInterrupt as Python's own
does, and a trainer callback raises it again at the end of the step (and at each log and evaluation) where it was
lost, so `stops_as` still ends the run with its one line. A process started with SIGINT ignored (a background job of
a script) keeps ignoring it, as its shell asked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["remembered"]


class _Pressed:
    """Whether Ctrl-C was pressed while the handler was installed; a `TrainerCallback` that raises it again."""

    def __init__(self) -> None:
        self.pressed = False

    def handle(self, signum: int, frame: Any) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def raise_if_pressed(self, *args: Any, **kwargs: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt("Ctrl-C, caught inside the step and raised again at its end")


@contextlib.contextmanager
def remembered(trainer: Any) -> Iterator[None]:
    """Inside the block, a Ctrl-C that the step swallowed is raised again by `trainer`'s callbacks at the step's end
    (main thread only: elsewhere, and where SIGINT is ignored or handled by someone else, nothing changes)."""
    from transformers import TrainerCallback

    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed = _Pressed()
    callback = TrainerCallback()  # the events at which a swallowed Ctrl-C is raised again: this instance's own
    for event in ("on_step_end", "on_log", "on_evaluate", "on_save"):
        setattr(callback, event, pressed.raise_if_pressed)
    previous = signal.signal(signal.SIGINT, pressed.handle)
    trainer.add_callback(callback)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        trainer.remove_callback(callback)

import os
import signal

import pytest
import torch
from transformers import Trainer, TrainingArguments

from vlm_grpo.cli.ctrl_c import remembered


def _trainer(tmp_path) -> Trainer:
    return Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))


def test_a_swallowed_ctrl_c_is_raised_again_at_the_next_event_and_everything_is_put_back(tmp_path):
    trainer = _trainer(tmp_path)
    before = list(trainer.callback_handler.callbacks)
    with remembered(trainer):
        handler = trainer.callback_handler.callbacks[-1]
        handler.on_step_end(None, None, None)  # nothing pressed: nothing raised
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, caught where it landed
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt, match="raised again"):
            handler.on_step_end(None, None, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert trainer.callback_handler.callbacks == before


def test_a_process_that_ignores_sigint_keeps_ignoring_it(tmp_path):
    trainer = _trainer(tmp_path)
    before = list(trainer.callback_handler.callbacks)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with remembered(trainer):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing raised
            assert trainer.callback_handler.callbacks == before  # nor at the step's end
    finally:
        signal.signal(signal.SIGINT, previous)

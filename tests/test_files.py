"""vlm_grpo.files: what the package writes follows the umask, checkpoints included (safetensors writes 0600)."""

import os
import stat

import torch
from safetensors.torch import save_file
from transformers import TrainerControl, TrainerState, TrainingArguments

from vlm_grpo.files import CheckpointModesCallback, follow_umask


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_follow_umask_gives_a_file_or_a_tree_the_modes_of_a_plain_write(tmp_path):
    old = os.umask(0o027)
    try:
        weights = tmp_path / "tree" / "sub" / "model.safetensors"
        weights.parent.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(weights))
        script = tmp_path / "tree" / "run.sh"
        script.write_text("#!/bin/sh\n")
        os.chmod(script, 0o700)
        os.chmod(tmp_path / "tree", 0o700)
        assert _mode(weights) == 0o600  # what safetensors does, whatever the umask
        follow_umask(tmp_path / "tree")
        assert (_mode(tmp_path / "tree"), _mode(weights), _mode(script)) == (0o750, 0o640, 0o750)
        single = tmp_path / "single.safetensors"
        save_file({"w": torch.zeros(2)}, str(single))
        follow_umask(single)
        assert _mode(single) == 0o640
    finally:
        os.umask(old)


def test_checkpoint_callback_fixes_the_checkpoint_just_saved(tmp_path):
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    save_file({"w": torch.zeros(2)}, str(checkpoint / "adapter_model.safetensors"))
    state = TrainerState()
    state.global_step = 7
    old = os.umask(0o022)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
        CheckpointModesCallback().on_save(args, state, TrainerControl())
    finally:
        os.umask(old)
    assert _mode(checkpoint / "adapter_model.safetensors") == 0o644

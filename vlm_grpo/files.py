"""Files the package writes get the modes the user's umask gives any file they write.

safetensors writes weights 0600 (through a private temporary file) and `tempfile.mkdtemp` makes directories 0700,
so checkpoints, adapters and the tiny demo model would otherwise be private to their owner whatever the umask says,
unlike the configs and tokenizers beside them.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = ["CheckpointModesCallback", "follow_umask"]


def follow_umask(root: str | os.PathLike) -> None:
    """Give `root` (a file, or a directory and everything in it) the modes a plain `open` / `mkdir` would have under
    the current umask (executable files stay executable); symbolic links are left alone."""
    umask = os.umask(0)
    os.umask(umask)
    if os.path.isfile(root) and not os.path.islink(root):
        os.chmod(root, (0o777 if os.stat(root).st_mode & 0o111 else 0o666) & ~umask)
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o777 & ~umask)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~umask)


class CheckpointModesCallback(TrainerCallback):
    """After each checkpoint is written, its files follow the umask (`follow_umask`), so `checkpoint-*/` reads like
    the rest of the output directory. `VLMGRPOTrainer` adds it."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Fix the modes of the checkpoint just written (by the processes that write checkpoints)."""
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and os.path.isdir(checkpoint):
            follow_umask(checkpoint)

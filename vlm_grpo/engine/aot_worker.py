"""The compile process of `engine.background_compile`: `python -m vlm_grpo.engine.aot_worker JOB_FILE` compiles the
job's layer ahead of time (`engine.aot_layers.compile_entry`) and saves it where the trainer's process looks for it.

Exit status 0: saved. 2: this process computes another signature key than the trainer's (a patch or setting the
trainer's process made at run time that a new process does not have), or cannot take the global state the trainer's
compiled functions are guarded on, so nothing is compiled and the trainer compiles the layer itself. Anything else: the
compile failed (its last line says why; the trainer logs it).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from .aot_keys import signature_key
from .aot_layers import compile_entry
from .background_compile import apply_state

__all__ = ["compile_job"]


def compile_job(job_file: str) -> int:
    """Compile and save the layer of `job_file` (written by `BackgroundCompiles.start`, then removed); the exit
    status (module docstring)."""
    job = torch.load(job_file, weights_only=False)  # our own file, written by the trainer's process just now
    with contextlib.suppress(OSError):
        os.remove(job_file)
    differs = apply_state(job["state"])
    if differs is not None:  # its function's guards would refuse every call of the trainer's
        print(f"this process cannot take the trainer's guarded global state ({differs} differ)", flush=True)
        return 2
    module, args, kwargs = job["module"], job["args"], job["kwargs"]
    key = signature_key(module, args, kwargs)
    if key != job["key"]:
        print(f"this process computes another signature key ({key} against {job['key']}): the trainer's process has "
              "a layer, patch or setting a new process does not", flush=True)  # fmt: skip
        return 2
    entry = compile_entry(module, args, kwargs, job["dynamic"], job["mark"])
    entry.save_compiled_function(job["path"])
    return 0


if __name__ == "__main__":
    sys.exit(compile_job(sys.argv[1]))

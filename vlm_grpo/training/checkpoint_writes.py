"""A checkpoint that cannot be written (a full disk, a quota, the file-size limit) stops the run with one line.

transformers writes `checkpoint-N` file by file; a write that fails surfaces as whatever the writer raises, and the
three writers differ: `OSError` from `json` (with its errno), `SafetensorError` from safetensors ("os error 28" in
its text) and a bare `RuntimeError` from `torch.save`'s zip writer ("unexpected pos 576 vs 534": no errno at all).
`writing_checkpoint` wraps the save: on any failure it removes the checkpoint it left incomplete (it frees what it
took on a full disk, and `vlm_grpo.training.checkpoints` would skip it anyway), and raises `CheckpointWriteError` with one
line naming the path, the cause found from the errno or, without one, from the disk's free space and the process's
file-size limit (`ulimit -f`), what a checkpoint needs (the size of the last complete one, else an estimate from the
model), and the previous complete checkpoint, which is never touched: transformers deletes older checkpoints only
after a new one is whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

from .checkpoints import incomplete_reason, newest_complete_checkpoint

__all__ = [
    "CheckpointWriteError",
    "checkpoint_need",
    "explain_write_failure",
    "final_write_error",
    "writing_checkpoint",
]


class CheckpointWriteError(RuntimeError):
    """A checkpoint (or the final model) could not be written; the message names the path, the cause and the fix."""


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _errno(error: BaseException) -> int | None:
    """The errno behind `error` or the errors it was raised from (safetensors has it only in its text)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        if match := re.search(r"os error (\d+)", str(seen)):
            return int(match.group(1))
        seen = seen.__cause__ or seen.__context__
    return None


def _file_size_limit() -> int | None:
    """The soft `RLIMIT_FSIZE` in bytes (None: unlimited, or no such limit on this system)."""
    try:
        import resource
    except ImportError:  # pragma: no cover  (Windows)
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def checkpoint_need(output_dir: str | os.PathLike, model: Any = None) -> tuple[int, int, str]:
    """`(total bytes, largest file's bytes, what they are)` a checkpoint of this run needs: the newest complete
    checkpoint's sizes, else an estimate from `model` (its saved weights, the adapter's for PEFT, and AdamW's two
    float32 moments per trainable weight); `(0, 0, "")` when neither is known."""
    previous = newest_complete_checkpoint(output_dir)
    if previous is not None:
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(previous) for f in files]
        return sum(sizes), max(sizes, default=0), f"the size of {os.path.basename(previous)}"
    if model is None:
        return 0, 0, ""
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = trainable if hasattr(model, "peft_config") else list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in saved)
    optimizer = 8 * sum(p.numel() for p in trainable)
    return weights + optimizer, max(weights, optimizer), "estimated from the model's weights and AdamW's state"


def explain_write_failure(error: BaseException, path: str, need: tuple[int, int, str]) -> str:
    """Why writing `path` failed, in one sentence with the fix: the file-size limit, a full disk, or the error."""
    total, largest, basis = need
    code, limit = _errno(error), _file_size_limit()
    needs = f" (about {_size(largest)} for its largest file, {basis})" if largest else ""
    if code == errno.EFBIG or (code is None and limit is not None and largest > limit):
        return (f"a file would exceed this process's file-size limit (ulimit -f: {_size(limit or 0)}){needs}; raise "
                "the limit (ulimit -f unlimited) or ask the scheduler for a larger one")  # fmt: skip
    directory = os.path.dirname(os.path.normpath(path)) or "."
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free is not None and free < total):
        room = f"{_size(free)} free" if free is not None else "no space"
        wanted = f"; a checkpoint needs about {_size(total)} ({basis})" if total else ""
        return f"the disk holding {directory} is full ({room}{wanted}): free space or use a larger --output_dir"
    return " ".join(f"{type(error).__name__}: {error}".split())  # the writer's own words, on one line


@contextlib.contextmanager
def writing_checkpoint(checkpoint: str, output_dir: str, model: Any = None, writes: bool = True) -> Iterator[None]:
    """Run a checkpoint save; on a failure remove `checkpoint` if the failure left it incomplete (only on a process
    that `writes` checkpoints), and raise `CheckpointWriteError`: the path, why, what it needs, and the previous
    complete checkpoint to resume from."""
    try:
        yield
    except Exception as error:
        left = incomplete_reason(checkpoint) if os.path.isdir(checkpoint) else None
        if writes and left is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)
        need = checkpoint_need(output_dir, model)
        why = explain_write_failure(error, checkpoint, need)
        if os.path.isdir(checkpoint) and left is None:
            done = f"{checkpoint} was written, but the save failed after it: {why}."
        else:
            done = f"could not write checkpoint {checkpoint}: {why}. The incomplete checkpoint was removed."
        previous = newest_complete_checkpoint(output_dir)
        resume = (f" The newest complete checkpoint, {previous}, is intact: resume from it with "
                  "--resume_from_checkpoint." if previous else " No earlier checkpoint exists.")  # fmt: skip
        raise CheckpointWriteError(done + resume) from error


def final_write_error(error: BaseException, final: str, output_dir: str, model: Any) -> CheckpointWriteError:
    """The error for a trained model that could not be written to `final` (written atomically: nothing half-written
    is left), naming the newest complete checkpoint, which holds the same training up to its step."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    why = explain_write_failure(error, final, (weights, weights, "the model's weights"))
    previous = newest_complete_checkpoint(output_dir)
    resume = f" The newest complete checkpoint is {previous}." if previous else ""
    return CheckpointWriteError(f"could not write the trained model to {final}: {why}.{resume}")

"""Decisions every training process must take together.

A process that stops, skips an optimizer step or refuses a save on its own leaves the others waiting at their next
collective (an all-reduce of gradients, a barrier before a save) until the job's timeout. Each such decision goes
through `any_process`: one all-reduce of a scalar, only when several processes train.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["any_process"]


def any_process(flag: bool, args: Any) -> bool:
    """True if `flag` is True on any training process (`args`: the `TrainingArguments`, for the world size and
    the device the collective runs on); `flag` itself with one process."""
    if getattr(args, "world_size", 1) <= 1 or not torch.distributed.is_initialized():
        return flag
    value = torch.tensor([float(flag)], device=args.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())

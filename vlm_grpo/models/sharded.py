"""Sharded models (FSDP2, DeepSpeed ZeRO-3): every weight resident on each rank for a generation or an export.

Training shards the weights; a rollout of hundreds of one-token forwards must not all-gather every layer at every
token (what FSDP2 does when `model.generate` runs through its per-layer hooks), and a merged export needs the whole
model. `full_weights` gathers once for the whole block and gives the shards back after:

- FSDP2 (`fully_shard`, accelerate's `fsdp_version: 2`): each FSDP unit is unsharded with resharding after
  forward switched off, so the hooks that still run inside the block find the weights in place; on exit every
  unit is resharded and its resharding setting put back. The root's lazy initialisation runs first: a forward
  that reaches an inner unit before the root has ever run would otherwise make that unit the root.
- DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters` over all parameters (read-only: changes made inside the
  block, such as a LoRA merge that is undone anyway, are not written back to the shards).

FSDP1 (`FullyShardedDataParallel`) keeps flat parameters that this module does not unshard; `unsupported_reason`
says so, and the trainer then generates on TRL's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["full_weights", "is_main_process", "sharding", "unsupported_reason", "whole"]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole on this rank: an FSDP2 (DTensor) shard gathered, a collective every rank takes; a plain tensor
    as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fsdp2_units(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 not public
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def sharding(model: nn.Module) -> str | None:
    """How `model`'s weights are sharded: "fsdp2", "fsdp1", "zero3", or None (every weight on every rank)."""
    if _fsdp2_units(model):
        return "fsdp2"
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp1"
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # DeepSpeed ZeRO-3 partitions carry a ds_id
        return "zero3"
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `full_weights` cannot gather this model (None when it can)."""
    if sharding(model) == "fsdp1":
        return "FSDP1 models are not gathered for fast generation; use FSDP2 (fsdp_version: 2 in the accelerate config)"
    return None


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # a list in recent torch, one optional group before
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


@contextlib.contextmanager
def _fsdp2_unsharded(units: list[nn.Module]) -> Iterator[None]:
    root = units[0]  # model.modules() is pre-order: the first unit is the outermost
    root._get_fsdp_state()._lazy_init()
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        groups = _param_groups(state)
        # Private fields, read back as they were: set_reshard_after_forward has no getter.
        auto = getattr(state, "_auto_reshard_after_forward", None)  # torch >= 2.8
        saved.append((state, auto, [g.post_forward_mesh_info for g in groups]))
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, (state, auto, infos) in zip(units, saved):
            unit.reshard()
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for group, info in zip(_param_groups(state), infos):
                group.post_forward_mesh_info = info


@contextlib.contextmanager
def full_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Every weight of `model` whole on this rank inside the block (a no-op for unsharded models).

    A collective: under FSDP2 / ZeRO-3 every rank must enter the block together.
    """
    kind = sharding(model)
    if kind == "fsdp1":
        raise RuntimeError(unsupported_reason(model))
    if kind == "fsdp2":
        with _fsdp2_unsharded(_fsdp2_units(model)), torch.no_grad():
            yield model
    elif kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield model
    else:
        yield model


def is_main_process() -> bool:
    """Rank 0 of the default process group, or True when none is initialised (the rank that writes files)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

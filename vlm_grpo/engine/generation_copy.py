"""An unsharded copy of an FSDP2 model for the fast generator, refreshed from the shards once per optimizer step.

Under FSDP2 each rank holds a shard of every weight. Generating through FSDP's hooks all-gathers every layer for
every token; gathering the whole model once per rollout (`engine.sharded.full_weights`) avoids that, but the gathered
weights land in fresh memory each time, so a CUDA graph recorded on one step's addresses is stale at the next and
decoding runs eagerly (2 H100s, Qwen2.5-VL-3B, LoRA: 7.30 s per step against DDP's 2.00).

The peers (TRL's `_sync_fsdp2_params_to_vllm`, verl's rollout mode, slime) stream `param.full_tensor()` into an
unsharded inference copy once per step. `GenerationCopy` does that for our own engine:

- `prepare(model)`, before accelerate shards the model (`VLMGRPOTrainer.train` calls it before TRL's `train`):
  a deep copy of the whole model (its LoRA layers included), in the dtype the sharded forward computes in, on the
  rank's device. It is never trained; its weights are graph inputs at fixed addresses.
- `refreshed(model, step)`: once per optimizer step, each trainable parameter of the sharded model is gathered
  (`full_tensor()`, a collective every rank takes in the same order) and copied into the copy's tensor in place.
  Frozen weights (a LoRA model's base) are copied once, at `prepare`: for LoRA a refresh moves only the adapters.

The fast generator then runs on the copy as on one GPU: compiled, recorded as CUDA graphs, LoRA merged with the
base restored bit for bit. It costs one unsharded copy of the model per rank (`fsdp_generation_copy=False` gathers
the shards for each rollout instead: less memory, eager decoding).

For LoRA that copy would hold the frozen base a second time beside its shards (2 H100s, Qwen2.5-VL-3B: 18.0 GiB per
GPU against DDP's 8.8). So a frozen weight already on the rank's device in the generation dtype is *shared*, not
copied: the copy's module holds the model's own tensor, and `shared_modules` lists the model's modules made only of
such weights, which FSDP2 is then told to leave alone (`ignored_params`): they stay whole on every rank, as under
DDP, and only the adapters (their gradients, their optimizer state) are sharded. The base is never all-gathered in
the forward or backward either. While generating, the LoRA merge writes into those shared weights and restores them
bit for bit before returning (never deferred), so training never sees a merged base.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from ..models.sharded import whole

__all__ = ["GenerationCopy", "copy_unfit_reason"]

logger = logging.getLogger(__name__)


def _same_device(a: torch.device, b: torch.device | str) -> bool:
    """`a` and `b` are one device ("cpu:0" is "cpu"; a GPU by its index)."""
    b = torch.device(b)
    return a.type == b.type and (a.type == "cpu" or a.index == b.index)


def _whole_modules(model: nn.Module, weights: set[int]) -> list[nn.Module]:
    """The modules of `model` whose every parameter, children's included, is in `weights` (ids)."""
    return [m for m in model.modules() if (ps := list(m.parameters())) and all(id(p) in weights for p in ps)]


def _shareable(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> set[int]:
    """Ids of the weights a copy of `model` can share rather than copy: frozen, on `device` in the generation dtype,
    and held only by modules made wholly of such weights. A frozen weight beside a trainable one in a module FSDP2
    shards (a linear-attention layer's `A_log` next to its LoRA projections, a trainable bias) is copied: sharing it
    would keep the whole tensor alive beside FSDP2's shard, and ignoring its module would leave the trainable weights
    under it unsynchronised across ranks."""
    frozen = set()
    for param in model.parameters():
        cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
        if not param.requires_grad and _same_device(param.device, device) and param.dtype == cast:
            frozen.add(id(param))
    return {id(p) for m in _whole_modules(model, frozen) for p in m.parameters()}


class GenerationCopy:
    """An unsharded copy of a model for generation, kept at fixed addresses and refreshed once per step."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.step: int | None = None
        self.refreshes = 0  # how many times the trainable weights were copied in (once per optimizer step)
        self.shared: set[int] = set()  # ids of the model's frozen weights the copy holds as they are, not copied
        self.declined: str | None = None  # why no copy was made (it would not fit): the shards are gathered instead

    def prepare(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype | None = None, share_frozen: bool = True
    ) -> None:
        """Copy `model` (not yet sharded) to `device`, floating-point weights in `dtype` (None: as they are: the
        dtype the sharded forward computes in, when mixed precision keeps fp32 master weights). With `share_frozen`,
        a frozen weight already on `device` in that dtype is the model's own tensor (see `shared_modules`)."""
        # Each weight copied once, straight into the dtype and device it generates in (a deepcopy then a cast would
        # hold a second full-precision copy of the model for a moment); tied weights stay one tensor.
        memo: dict[int, Any] = {}
        self.shared = _shareable(model, device, dtype) if share_frozen else set()
        for param in model.parameters():
            if id(param) in self.shared:
                memo[id(param)] = param  # the base as it is: FSDP2 leaves it whole (`shared_modules`)
            elif id(param) not in memo:
                cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
                value = param.detach().to(device=device, dtype=cast, copy=True)  # never the sharded model's storage
                memo[id(param)] = nn.Parameter(value, requires_grad=False)
        replica = copy.deepcopy(model, memo)
        for module in replica.modules():
            # A forward set on the instance wraps the one it replaced (TRL's fused LM head keeps the model's bound
            # forward in a closure): copied, it still calls the original module, which FSDP is about to shard. The
            # class's forward serves generation (the fused head only changes the loss's forward).
            if "forward" in vars(module):
                del module.forward
        replica.to(device)  # the buffers (rotary frequencies), in their own dtype
        self.model = replica.eval()
        self.step = None
        own = sum(p.numel() * p.element_size() for p in replica.parameters() if id(p) not in self.shared) / 2**30
        shared = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in self.shared) / 2**30
        logger.info("Generation copy of the model for the fast generator under FSDP2: %.2f GiB of its own on %s, "
                    "%.2f GiB of frozen weights shared with the model (left unsharded).", own, device, shared)  # fmt: skip

    @staticmethod
    def own_bytes(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> int:
        """Bytes the copy of `model` would allocate on `device` (`prepare`'s arguments): every weight it cannot share."""
        shared = _shareable(model, device, dtype)
        return sum(param.numel() * (dtype if dtype is not None and param.is_floating_point() else param.dtype).itemsize
                   for param in model.parameters() if id(param) not in shared)  # fmt: skip

    def shared_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of `model` whose every weight, its children's included, is shared with the copy (a LoRA layer's
        base, a norm, the embeddings): what FSDP2 must leave unsharded (accelerate's `ignored_modules`, which takes each
        module's weights with its children's), or it would replace them."""
        return _whole_modules(model, self.shared)

    @property
    def shares_weights(self) -> bool:
        """Whether the copy holds some of the model's own weights (then a LoRA merge into them is never deferred)."""
        return bool(self.shared)

    def refreshed(self, sharded: nn.Module, step: int) -> nn.Module:
        """The copy with `sharded`'s trainable weights as of optimizer step `step` (gathered once per step). A
        collective: every rank calls it at the same point."""
        if self.model is None:
            raise RuntimeError("GenerationCopy.refreshed before prepare")
        if step == self.step:
            return self.model
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in sharded.named_parameters():
                if not param.requires_grad:
                    continue
                target = own.get(name.replace("_checkpoint_wrapped_module.", ""))  # FSDP's activation checkpointing
                if target is None:
                    raise RuntimeError(f"The generation copy has no parameter {name!r}: the sharded model changed "
                                       "after the copy was made (fsdp_generation_copy=False to gather instead).")  # fmt: skip
                target.copy_(whole(param))
        self.step = step
        self.refreshes += 1
        return self.model

    def stats(self) -> dict[str, Any]:
        """What the copy did: whether it exists, and how many refreshes it took."""
        stats = {"copy": self.model is not None, "refreshes": self.refreshes, "shared_weights": len(self.shared)}
        return stats | ({"declined": self.declined} if self.declined else {})


def copy_unfit_reason(needed: int, free: int, fraction: float = 0.8) -> str | None:
    """Why a generation copy of `needed` bytes should not be made with `free` bytes free on the GPU (None: it fits
    in `fraction` of them, leaving the rest to the KV cache and the training step)."""
    if needed <= fraction * free:
        return None
    return (f"the generation copy needs {needed / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free on this GPU: the "
            "shards are gathered for each rollout instead (eager decoding); for a model this large, generate "
            "through vLLM with tensor parallelism (use_vllm=True, vllm_tensor_parallel_size)")  # fmt: skip

"""The q, k and v projections of each decoder attention layer as one GEMM while generating.

A decode step multiplies a handful of rows by every weight once, so each projection costs about the time its weight
takes to read, plus a fixed cost per kernel. Qwen2.5-VL-3B's k and v weights are 0.5 MB each: as three GEMMs the
q/k/v projections take 15.8 us per layer on an H100 with 16 rows, as one GEMM over the stacked weight 5.5 us
(`benchmarks/decode_kernels.py`; 24.2 against 8.8 us for the 7B), ~0.4 ms of every decode step.

`FusedQKV` keeps, per layer, one `[q; k; v]` weight (and bias) holding the LoRA-merged weights. It is refilled at the
start of every generation from the layers as they are (base weight plus each active adapter's `scaling * B @ A`, as
`merged_lora` merges), so these layers need no merge into, nor restore of, their own weights; and it is allocated once,
so a recorded CUDA graph (`engine.decode_graph`) keeps reading the same memory. Inside `swapped()` the three
projections are stand-ins: whichever is called first computes the stacked GEMM for its input, and the other two take
their slices of it when called on the same input tensor (otherwise they compute their own slice), so the attention
code runs unchanged, in any order. Costs one extra copy of the q/k/v weights in GPU memory (0.37 GiB for the 3B,
0.86 GiB for the 7B).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .quantized_generation import is_quantized_linear

__all__ = ["FusedQKV", "fusable_sites", "merges_as_a_delta"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class _Stacked:
    """One attention layer's stacked weight, and the last input it was applied to (until all three parts took theirs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight, self.bias = weight, bias
        self.bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        self.last: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (input, stacked output, parts served)


class _Part(nn.Module):
    """Stands in for one of q_proj / k_proj / v_proj: its slice of the stacked projection of its input."""

    def __init__(self, stacked: _Stacked, index: int) -> None:
        super().__init__()
        self.stacked, self.index = stacked, index
        if index == 0:  # registered once, so `DecodeGraphs.begin` sees the memory a recording reads
            self.register_buffer("stacked_weight", stacked.weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = self.stacked
        start, end = stacked.bounds[self.index]
        last = stacked.last
        if last is not None and last[0] is x:
            out, served = last[1], last[2] + 1
        else:
            out, served = F.linear(x, stacked.weight, stacked.bias), 1
        # Forget the input once all three parts took their slice: nothing is kept alive between layers or steps.
        stacked.last = None if served == len(stacked.bounds) else (x, out, served)
        return out[..., start:end]


@dataclass
class _Site:
    attention: nn.Module
    originals: tuple[nn.Module, ...]
    stacked: _Stacked
    parts: tuple[_Part, ...]


class FusedQKV:
    """Stacked, merged q/k/v weights for the decoder's attention layers (`fusable_sites`), and their stand-ins."""

    def __init__(self, model: nn.Module) -> None:
        self.sites: list[_Site] = []
        for attention, projections in fusable_sites(model):
            weights = [_base(p).weight for p in projections]
            biases = [_base(p).bias for p in projections]
            first = weights[0]
            weight = torch.empty((sum(w.shape[0] for w in weights), first.shape[1]), dtype=first.dtype,
                                 device=first.device)  # fmt: skip
            bias = None if biases[0] is None else torch.empty(weight.shape[0], dtype=first.dtype, device=first.device)
            stacked = _Stacked(weight, bias, [w.shape[0] for w in weights])
            parts = tuple(_Part(stacked, i) for i in range(len(PROJECTIONS)))
            self.sites.append(_Site(attention, tuple(projections), stacked, parts))

    def covers(self) -> set[int]:
        """`id`s of the projection modules served here: `merged_lora` leaves them unmerged."""
        return {id(p) for site in self.sites for p in site.originals}

    def matches(self, model: nn.Module) -> bool:
        """Whether the model still has the projection modules this was built from (else build a new one)."""
        current = [(attention, tuple(projections)) for attention, projections in fusable_sites(model)]
        return [(id(a), tuple(map(id, p))) for a, p in current] == [
            (id(s.attention), tuple(map(id, s.originals))) for s in self.sites
        ]

    @torch.no_grad()
    def fill(self) -> None:
        """Write each layer's merged weights (base + active adapters) and biases into the stacked buffers."""
        for site in self.sites:
            stacked = site.stacked
            for projection, (start, end) in zip(site.originals, stacked.bounds):
                base = _base(projection)
                rows = stacked.weight[start:end]
                rows.copy_(base.weight)
                for name in _active_adapters(projection):  # PEFT's delta for a Linear base, as `merged_lora` adds it
                    lora_a, lora_b = projection.lora_A[name].weight, projection.lora_B[name].weight
                    rows.addmm_(lora_b.to(rows.dtype), lora_a.to(rows.dtype), alpha=projection.scaling[name])
                if stacked.bias is not None:
                    stacked.bias[start:end].copy_(base.bias)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block each layer's q/k/v projections are the stand-ins (fill first)."""
        try:
            for site in self.sites:
                for name, part in zip(PROJECTIONS, site.parts):
                    setattr(site.attention, name, part)
            yield
        finally:
            for site in self.sites:
                site.stacked.last = None
                for name, original in zip(PROJECTIONS, site.originals):
                    setattr(site.attention, name, original)


def fusable_sites(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Decoder attention layers (transformers' text attention modules carry `layer_idx`) whose q, k and v projections
    are plain 16/32-bit Linear layers, or LoRA layers over one that merge as a delta, on one device and dtype, with
    biases on all three or none."""
    sites = []
    for module in model.modules():
        if not hasattr(module, "layer_idx") or not all(hasattr(module, name) for name in PROJECTIONS):
            continue
        projections = [getattr(module, name) for name in PROJECTIONS]
        bases = [_base(p) for p in projections]
        if not all(type(b) is nn.Linear and not is_quantized_linear(b) for b in bases):
            continue
        if not all(_mergeable(p) for p in projections):
            continue
        weights = [b.weight for b in bases]
        if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or len({b.bias is None for b in bases}) != 1:
            continue
        sites.append((module, projections))
    return sites


def _base(projection: nn.Module) -> nn.Module:
    return projection.get_base_layer() if hasattr(projection, "get_base_layer") else projection


def _active_adapters(projection: nn.Module) -> list[str]:
    if not hasattr(projection, "lora_A") or projection.disable_adapters:
        return []
    return [name for name in projection.active_adapters if name in projection.lora_A]


def _mergeable(projection: nn.Module) -> bool:
    if not hasattr(projection, "lora_A"):
        return type(projection) is nn.Linear
    # An adapter PEFT merged already (`merge_adapter`) is in the base weight: PEFT's forward owns that state.
    return hasattr(projection, "get_base_layer") and merges_as_a_delta(projection) and not projection.merged


def merges_as_a_delta(layer: nn.Module) -> bool:
    """Whether a LoRA layer is a plain Linear whose adapters are exactly `W + scaling * B @ A`: not DoRA or another
    variant, no LoRA bias (it would be lost with the adapters disabled), no transposed (fan-in/fan-out) weight."""
    extras = (getattr(layer, "use_dora", {}), getattr(layer, "lora_bias", {}), getattr(layer, "lora_variant", {}))
    return (
        type(layer.get_base_layer()) is nn.Linear
        and not getattr(layer, "fan_in_fan_out", False)
        and not any(any(extra.values()) for extra in extras)
    )

"""The decode loop's caches and buffers: one set per (batch, length), reused across generations, filled from a prefill.

A recorded CUDA graph (`engine.decode_graph`) replays only on the addresses it was recorded on, so a fresh cache per
generation would record the graph again every step: caches are kept per shape (at most two, the training and the
evaluation batch's) and reset between generations, and the graphs recorded on a dropped cache are forgotten with it.
A call whose rows fit a longer kept cache of the same batch decodes in that one (`fitting_length`): a tool rollout's
turns grow by a bucket or two each, and with a cache per length three turns would take turns evicting each other's
cache and graph, allocating and recording again in every turn of every step. The extra slots are masked, as the
bucket's are.
The prompt is prefilled once per group into a dynamic cache and copied into every row of its group, layer by layer
according to its kind (`engine.cache_kinds.copy_prefill`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .decode_graph import DecodeGraphs
from .token_loop import DecodeBuffers

__all__ = ["DecodeCaches"]


class DecodeCaches:
    """transformers' `StaticCache`s by (batch, length), at most two alive; `graphs` forgets what was recorded on one
    that is dropped."""

    def __init__(self, graphs: DecodeGraphs, keep: int = 2) -> None:
        self.graphs, self.keep = graphs, keep
        self.caches: dict[tuple[int, int], Any] = {}
        self.decode_buffers: dict[tuple[int, int], DecodeBuffers] = {}

    def _make_room(self, kept: dict) -> None:
        for old in list(kept)[: max(len(kept) - self.keep + 1, 0)]:
            self.graphs.forget(kept.pop(old))

    def clear(self) -> None:
        """Drop every kept cache and set of buffers, and the recordings made on them: their memory is freed."""
        self.caches.clear()
        self.decode_buffers.clear()
        self.graphs.clear()

    def fitting_length(self, batch: int, needed: int, bucket: int, headroom: int = 0) -> int:
        """The cache length to decode `batch` rows needing `needed` slots in: the shortest kept cache of that batch
        that holds them, else `needed + headroom` rounded up to a multiple of `bucket` (a new cache)."""
        kept = [length for b, length in self.caches if b == batch and length >= needed]
        return min(kept, default=-(-(needed + headroom) // bucket) * bucket)

    def get(self, model: nn.Module, batch: int, cache_len: int) -> Any:
        """An empty static cache for (batch, cache_len): the one kept for that shape, reset, or a new one. The one
        used last is evicted last."""
        from transformers import StaticCache

        cache = self.caches.pop((batch, cache_len), None)
        if cache is None:
            self._make_room(self.caches)
            cache = StaticCache(config=model.config, max_cache_len=cache_len)
        else:
            cache.reset()
        self.caches[(batch, cache_len)] = cache
        return cache

    def buffers(
        self, batch: int, cache_len: int, position_shape: tuple[int, ...], device: torch.device
    ) -> DecodeBuffers:
        """The decode loop's buffers (`engine.token_loop`) for this shape, reused across calls, kept like the caches."""
        buffers = self.decode_buffers.pop((batch, cache_len), None)
        if buffers is None or not buffers.fits(batch, cache_len, position_shape, device):
            if buffers is not None:
                self.graphs.forget(buffers)
            self._make_room(self.decode_buffers)
            buffers = DecodeBuffers.allocate(batch, cache_len, position_shape, device)
        self.decode_buffers[(batch, cache_len)] = buffers
        return buffers

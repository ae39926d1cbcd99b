"""`Example`, one sampled task instance before rendering, and `retry`, which samples a fresh scene when a layout does
not fit: shared by every task generator (`vlm_grpo.data.tasks`, `vlm_grpo.data.zoom_task`)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .scene import Item

__all__ = ["Example", "Redraw", "retry"]


@dataclass(frozen=True)
class Example:
    """One sampled task instance, before rendering: one scene, or one per frame of a clip (`frames`)."""

    items: tuple[Item, ...]
    question: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    frames: tuple[tuple[Item, ...], ...] = ()


class Redraw(Exception):
    """The sampled layout did not fit; the caller samples a fresh scene."""


def retry(generate: Callable[[random.Random, int, int], Example]) -> Callable[..., Example]:
    """`generate(rng, image_size, difficulty)` called again (same rng, so still deterministic) while it raises
    `Redraw`; a `RuntimeError` after 1000 tries."""

    @functools.wraps(generate)
    def wrapper(rng: random.Random, image_size: int, difficulty: int) -> Example:
        for _ in range(1000):
            try:
                return generate(rng, image_size, difficulty)
            except Redraw:
                continue
        raise RuntimeError(f"{generate.__name__}: could not lay out a scene at {image_size}px")

    return wrapper

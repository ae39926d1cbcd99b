"""Offline procedural visual-reasoning datasets (shapes, digits) drawn with PIL.

Example::

    from vlm_grpo.data import make_visual_reasoning_dataset, answer_words
    train = make_visual_reasoning_dataset("color", 1000, seed=0, split="train")
    test = make_visual_reasoning_dataset("color", 200, seed=0, split="test")
"""

from .dataset import SPLITS, make_visual_reasoning_dataset, split_of
from .scene import BACKGROUND, COLORS, SHAPES
from .tasks import DIFFICULTIES, TASKS, VIDEO_TASKS, answer_words

__all__ = [
    "BACKGROUND",
    "COLORS",
    "DIFFICULTIES",
    "SHAPES",
    "SPLITS",
    "TASKS",
    "VIDEO_TASKS",
    "answer_words",
    "make_visual_reasoning_dataset",
    "split_of",
]

"""Build ``datasets.Dataset`` objects from the procedural tasks, with leak-free splits."""

from __future__ import annotations

import hashlib
import random

from datasets import Dataset, Features, List, Value
from datasets import Image as ImageFeature
from PIL import Image

from ..validation import is_int
from .example import Example
from .scene import render
from .tasks import TaskSpec, check_difficulty, check_task

SPLITS = ("train", "test")
MIN_IMAGE_SIZE = 28
_TEST_BUCKETS = 5  # 1 in 5 possible images belongs to the test split
_MAX_ATTEMPTS = 10_000


def make_visual_reasoning_dataset(
    task: str,
    n: int,
    *,
    seed: int = 0,
    image_size: int | None = None,
    difficulty: int = 1,
    split: str = "train",
) -> Dataset:
    """Generate ``n`` rendered examples of ``task`` as a conversational VLM dataset.

    Args:
        task: One of :data:`vlm_grpo.data.TASKS`.
        n: Number of rows (> 0).
        seed: Same (task, n, seed, image_size, difficulty, split) gives byte-identical rows.
        image_size: Side of the square images in pixels (>= 28; tasks are designed to
            be legible from 56 up, e.g. 448). None: the task's own (56; ``"zoom"``: 448; ``"zoom_color"``: 1024).
        difficulty: 1 (easiest) to 3; controls colours, shape kinds, object counts,
            object sizes and distractors.
        split: ``"train"`` or ``"test"`` (about 80/20 of all possible images). Every
            image is assigned to exactly one split by a hash of its pixels, so the
            splits never share an image, whatever the seeds or difficulties.

    Returns:
        A Dataset with ``prompt`` (``[{"role": "user", "content": question}]``, content a
        plain string), ``image`` (``datasets.Image``, PNG bytes) and ``answer`` (str);
        ``"locate"`` adds ``bbox`` ([x1, y1, x2, y2] floats in pixels, x2/y2
        exclusive) and ``image_size`` ([width, height]); the zoom tasks (``"zoom"``, ``"zoom_color"``) add ``bbox``, the mark's box. A video task
        (``"motion"``) has
        ``video`` (a list of ``datasets.Image`` frames) instead of ``image``.

    Raises:
        ValueError: unknown task, split or difficulty, ``n <= 0``, or ``image_size`` too small.
    """
    spec = check_task(task)
    check_difficulty(difficulty)
    image_size = spec.image_size if image_size is None else image_size
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if not is_int(n) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not is_int(image_size) or image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be an int >= {MIN_IMAGE_SIZE}, got {image_size!r}")

    samples = [_sample_in_split(spec, task, seed, split, i, image_size, difficulty) for i in range(n)]
    examples = [example for example, _ in samples]
    media = "video" if spec.video else "image"
    columns: dict[str, list] = {
        "prompt": [[{"role": "user", "content": ex.question}] for ex in examples],
        media: [image for _, image in samples],
        "answer": [ex.answer for ex in examples],
    }
    features = {
        "prompt": List({"role": Value("string"), "content": Value("string")}),
        media: List(ImageFeature()) if spec.video else ImageFeature(),
        "answer": Value("string"),
    }
    if task == "locate":
        columns["bbox"] = [ex.extra["bbox"] for ex in examples]
        columns["image_size"] = [ex.extra["image_size"] for ex in examples]
        features["bbox"] = List(Value("float64"))
        features["image_size"] = List(Value("int64"))
    if spec.zoom is not None:  # the mark's box, for a demonstrated zoom (`vlm_grpo.tools.warm_start`) and for tests
        columns["bbox"] = [[float(v) for v in ex.extra["bbox"]] for ex in examples]
        features["bbox"] = List(Value("float64"))
    return Dataset.from_dict(columns, features=Features(features))


def split_of(image: Image.Image | list[Image.Image]) -> str:
    """The split that owns a rendered ``image`` (or clip, a list of frames): a stable hash of its pixels.

    Hashing pixels rather than sampling parameters means no image can ever appear
    in both splits, even if two parameter sets (or two tasks, seeds or
    difficulties) happen to draw the same picture.
    """
    frames = image if isinstance(image, list) else [image]
    key = b"".join(f"{im.mode}:{im.size}:".encode() + im.tobytes() for im in frames)
    digest = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return "test" if digest % _TEST_BUCKETS == 0 else "train"


def _sample_in_split(
    spec: TaskSpec, task: str, seed: int, split: str, index: int, image_size: int, difficulty: int
) -> tuple[Example, Image.Image | list[Image.Image]]:
    # A string seed is hashed by `random` with SHA-512, so it is stable across
    # processes (unlike hash()) and independent per example.
    rng = random.Random(f"{task}-{difficulty}-{image_size}-{seed}-{split}-{index}")
    for _ in range(_MAX_ATTEMPTS):
        example = spec.generate(rng, image_size, difficulty)
        image = [render(f, image_size) for f in example.frames] if spec.video else render(example.items, image_size)
        if split_of(image) == split:
            return example, image
    raise RuntimeError(f"no {split} example for task {task!r} after {_MAX_ATTEMPTS} draws")

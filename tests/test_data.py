"""Tests for vlm_grpo.data: schema, determinism, split hygiene and that drawings match answers."""

from __future__ import annotations

import functools
import itertools
import json
import re

import numpy as np
import pytest
from datasets import Dataset, List
from datasets import Image as ImageFeature
from PIL import Image

from vlm_grpo.data import (
    BACKGROUND,
    COLORS,
    TASKS,
    VIDEO_TASKS,
    answer_words,
    make_visual_reasoning_dataset,
)
from vlm_grpo.data.scene import shapes_for
from vlm_grpo.data.tasks import TASK_SPECS

DIFFICULTIES = (1, 2, 3)


@functools.cache
def _build(task: str, n: int, difficulty: int = 1, split: str = "train") -> Dataset:
    # Cached: several tests inspect the same datasets and building dominates runtime.
    return make_visual_reasoning_dataset(task, n, difficulty=difficulty, split=split)


def _image_bytes(ds: Dataset) -> list[bytes]:
    """Each row's encoded image, or its clip's frames joined (video tasks)."""
    if "video" in ds.column_names:
        clips = ds.cast_column("video", List(ImageFeature(decode=False)))["video"]
        return [b"".join(frame["bytes"] for frame in clip) for clip in clips]
    return [row["bytes"] for row in ds.cast_column("image", ImageFeature(decode=False))["image"]]


def _first_image(row: dict) -> Image.Image:
    return row["video"][0] if "video" in row else row["image"]


def _pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


def _mask(img: Image.Image, color: str) -> np.ndarray:
    return np.all(_pixels(img) == COLORS[color], axis=-1)


def _count_blobs(mask: np.ndarray) -> int:
    """Number of 8-connected components in a boolean mask."""
    seen = np.zeros_like(mask)
    blobs = 0
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        blobs += 1
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for dy, dx in itertools.product((-1, 0, 1), repeat=2):
                ny, nx = y + dy, x + dx
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return blobs


def _tokens(answer: str) -> list[str]:
    return re.findall(r"\d+|[^\d\s]+", answer)


# ------------------------------------------------------------------------ schema


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_every_task_builds_with_schema(task: str, difficulty: int) -> None:
    ds = _build(task, 20, difficulty=difficulty)
    assert len(ds) == 20
    media = "video" if task in VIDEO_TASKS else "image"
    expected = {"prompt", media, "answer"}
    if task == "locate":
        expected |= {"bbox", "image_size"}
    if TASK_SPECS[task].zoom is not None:
        expected |= {"bbox"}  # the mark's box: a demonstrated zoom (vlm_grpo.tools.warm_start) aims at it
    assert set(ds.column_names) == expected
    feature = ds.features[media]
    assert isinstance(feature.feature if task in VIDEO_TASKS else feature, ImageFeature)
    words = set(answer_words(task, difficulty))
    for row in ds:
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert isinstance(message["content"], str) and message["content"].endswith(".")
        for image in row["video"] if task in VIDEO_TASKS else [row["image"]]:
            assert isinstance(image, Image.Image)
            side = TASK_SPECS[task].image_size  # the task's own canvas: 56, the zoom task's 448, zoom_color's 1024
            assert image.size == (side, side) and image.mode == "RGB"
        assert isinstance(row["answer"], str)
        assert set(_tokens(row["answer"])) <= words, row["answer"]


@pytest.mark.parametrize("task", TASKS)
def test_scales_to_other_sizes(task: str) -> None:
    for size in (28, 448):
        ds = make_visual_reasoning_dataset(task, 3, image_size=size, difficulty=3)
        assert _first_image(ds[0]).size == (size, size)


def test_answer_words_nested_and_single_tokens() -> None:
    assert answer_words("color", 1) == ["red", "green", "blue", "yellow"]
    assert set(answer_words("spatial")) == {"left", "right", "above", "below"}
    assert "18" in answer_words("arithmetic") and "0" in answer_words("count")
    assert answer_words("locate", image_size=448)[-1] == "448"
    for task in TASKS:
        for low, high in itertools.pairwise(DIFFICULTIES):
            assert set(answer_words(task, low)) <= set(answer_words(task, high))
        assert all(" " not in w for w in answer_words(task))


def test_colours_clearly_distinct() -> None:
    colours = [*list(COLORS.values()), BACKGROUND]
    distances = [np.linalg.norm(np.subtract(a, b)) for a, b in itertools.combinations(colours, 2)]
    assert min(distances) >= 100


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(task: str) -> None:
    first = make_visual_reasoning_dataset(task, 20, seed=7, difficulty=2)
    second = make_visual_reasoning_dataset(task, 20, seed=7, difficulty=2)
    other = make_visual_reasoning_dataset(task, 20, seed=8, difficulty=2)
    assert _image_bytes(first) == _image_bytes(second)
    assert first["answer"] == second["answer"] and first["prompt"] == second["prompt"]
    assert _image_bytes(first) != _image_bytes(other)


@pytest.mark.parametrize("task", TASKS)
def test_train_and_test_never_share_images(task: str) -> None:
    train = set(_image_bytes(_build(task, 200, split="train")))
    test = set(_image_bytes(_build(task, 200, split="test")))
    assert len(test) > 100  # the test split is not degenerate
    assert not train & test


def test_answers_roughly_balanced() -> None:
    answers = _build("color", 200)["answer"]
    counts = {c: answers.count(c) for c in ("red", "green", "blue", "yellow")}
    assert sum(counts.values()) == 200
    assert min(counts.values()) >= 30, counts


# ------------------------------------------------------------ drawings vs answers


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_color_pixel_at_shape_centre(difficulty: int) -> None:
    ds = _build("color", 20, difficulty=difficulty)
    if difficulty == 1:
        assert set(ds["answer"]) <= {"red", "green", "blue", "yellow"}
    for row in ds:
        pixels = _pixels(row["image"])
        ys, xs = np.nonzero(np.any(pixels != BACKGROUND, axis=-1))
        centre = pixels[round(ys.mean()), round(xs.mean())]
        assert tuple(centre) == COLORS[row["answer"]]
        # One shape, one colour: every non-background pixel is the answer colour.
        assert np.all(pixels[ys, xs] == COLORS[row["answer"]])


@pytest.mark.parametrize("difficulty", [1, 2])
def test_count_matches_blobs(difficulty: int) -> None:
    for row in _build("count", 20, difficulty=difficulty):
        colour = re.search(r"How many (\w+) shapes", row["prompt"][0]["content"]).group(1)
        assert _count_blobs(_mask(row["image"], colour)) == int(row["answer"])


def test_count_level3_bounds() -> None:
    for row in _build("count", 20, difficulty=3):
        colour = re.search(r"How many (\w+) (\w+)s are", row["prompt"][0]["content"]).group(1)
        assert 0 <= int(row["answer"]) <= _count_blobs(_mask(row["image"], colour))


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_locate_bbox_is_tight_around_named_shape(difficulty: int) -> None:
    for row in _build("locate", 20, difficulty=difficulty):
        x1, y1, x2, y2 = (int(v) for v in row["bbox"])
        assert json.loads(row["answer"]) == [x1, y1, x2, y2]
        assert row["image_size"] == [56, 56]
        assert 0 <= x1 < x2 <= 56 and 0 <= y1 < y2 <= 56
        colour = re.search(r"Where is the (\w+) ", row["prompt"][0]["content"]).group(1)
        crop = _pixels(row["image"])[y1:y2, x1:x2]
        target = np.all(crop == COLORS[colour], axis=-1)
        background = np.all(crop == BACKGROUND, axis=-1)
        assert np.all(target | background)  # nothing else inside the box
        assert target.mean() >= 0.4
        # Tight: the shape touches all four sides of its box.
        assert target[0].any() and target[-1].any() and target[:, 0].any() and target[:, -1].any()


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_spatial_relation_matches_drawing(difficulty: int) -> None:
    for row in _build("spatial", 20, difficulty=difficulty):
        question = row["prompt"][0]["content"]
        first, second = re.search(r"the (\w+) shape relative to the (\w+) shape", question).groups()
        centres = [np.argwhere(_mask(row["image"], c)).mean(axis=0) for c in (first, second)]
        (ay, ax), (by, bx) = centres
        dx, dy = ax - bx, ay - by
        if abs(dx) > abs(dy):
            expected = "left" if dx < 0 else "right"
        else:
            expected = "above" if dy < 0 else "below"
        assert row["answer"] == expected


def test_position_dot_in_answer_third() -> None:
    for row in _build("position", 20, difficulty=3):
        xs = np.nonzero(np.any(_pixels(row["image"]) != BACKGROUND, axis=-1))[1]
        thirds = {int(x * 3 // 56) for x in xs}
        assert thirds == {["left", "middle", "right"].index(row["answer"])}


def test_arithmetic_draws_two_digits() -> None:
    for row in _build("arithmetic", 20, difficulty=1):
        ink = np.all(_pixels(row["image"]) < 64, axis=-1)  # dark digit strokes
        assert ink[:, :28].any() and ink[:, 28:].any()
        assert 0 <= int(row["answer"]) <= 8


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "colour"}, "valid tasks: color, count"),
        ({"split": "val"}, "valid splits: train, test"),
        ({"n": 0}, "n must be a positive int"),
        ({"n": -3}, "n must be a positive int"),
        ({"difficulty": 4}, r"difficulty must be one of \(1, 2, 3\)"),
        ({"image_size": 10}, "image_size must be an int >= 28"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args = {"task": "color", "n": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        make_visual_reasoning_dataset(args.pop("task"), args.pop("n"), **args)


def test_answer_words_bad_arguments() -> None:
    with pytest.raises(ValueError, match="valid tasks"):
        answer_words("nope")
    with pytest.raises(ValueError, match="difficulty"):
        answer_words("color", 0)


# ------------------------------------------------------------------------ video


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_color_change_answer_is_the_colour_of_the_last_frames(difficulty: int) -> None:
    ds = _build("color_change", 40, difficulty=difficulty)
    for row in ds:
        first, last = (set(map(tuple, _pixels(f).reshape(-1, 3))) - {BACKGROUND} for f in (row["video"][0],
                                                                                          row["video"][-1]))  # fmt: skip
        assert last == {COLORS[row["answer"]]} and first != last  # both colours are in the clip: order decides
    assert set(ds["answer"]) == set(answer_words("color_change", difficulty))


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_motion_answer_is_the_way_the_shape_moves(difficulty: int) -> None:
    ds = _build("motion", 40, difficulty=difficulty)
    for row in ds:
        frames = [_pixels(f) for f in row["video"]]
        moving = np.any(frames[0] != frames[-1], axis=-1)  # where the moving shape was or went: still ones cancel
        columns = np.nonzero(moving.any(axis=0))[0]
        start = np.nonzero(np.any(frames[0] != BACKGROUND, axis=-1)[:, columns].any(axis=0))[0].mean()
        end = np.nonzero(np.any(frames[-1] != BACKGROUND, axis=-1)[:, columns].any(axis=0))[0].mean()
        assert ("right" if end > start else "left") == row["answer"]
    assert set(ds["answer"]) == {"left", "right"}


# ------------------------------------------------------------------------ zoom


def _mark_widths(image: Image.Image) -> int:
    """Columns of `image` that hold any pixel off the background: the mark's width."""
    return int(np.any(np.abs(_pixels(image).astype(int) - BACKGROUND).sum(-1) > 24, axis=0).sum())


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_zoom_task_is_a_small_mark_of_each_kind_on_a_large_canvas(difficulty: int) -> None:
    ds = make_visual_reasoning_dataset("zoom", 60, difficulty=difficulty)  # the task's own canvas, 448
    assert {row["image"].size for row in ds} == {(448, 448)}
    assert set(ds["answer"]) == set(answer_words("zoom", difficulty)) == set(shapes_for(difficulty))
    widths = [_mark_widths(row["image"]) for row in ds]
    assert 6 <= min(widths) and max(widths) <= 12 and max(widths) >= 1.3 * min(widths)  # sizes vary: area says little
    # At a 112 x 112 budget (tiny Qwen2.5-VL's) the prompt's image keeps 1 pixel in 16: the mark is 2-3 px wide.
    fitted = [_mark_widths(row["image"].resize((112, 112), Image.Resampling.BICUBIC)) for row in ds]
    assert max(fitted) <= 4
    for row in ds:  # `bbox` is the mark's box: every pixel off the background inside it
        x1, y1, x2, y2 = map(int, row["bbox"])
        off = np.abs(_pixels(row["image"]).astype(int) - BACKGROUND).sum(-1) > 24
        assert off[y1:y2, x1:x2].sum() == off.sum() > 0


# ------------------------------------------------------------------------ zoom_color


def test_zoom_color_is_a_dot_at_the_centre_among_shapes_of_its_colours() -> None:
    ds = _build("zoom_color", 24)
    assert {row["image"].size for row in ds} == {(1024, 1024)}
    assert set(ds["answer"]) == set(answer_words("zoom_color", 1)) == {"red", "green", "blue", "yellow"}
    for row in ds:
        assert row["bbox"] == [509.0, 509.0, 515.0, 515.0]  # 6 px, in the middle of the canvas
        pixels = _pixels(row["image"])
        assert (pixels[509:515, 509:515] == COLORS[row["answer"]]).all()
        # The centre quarter holds the dot and its rings only: the zoom's box (the centre eighth) shows nothing else.
        quarter = pixels[384:640, 384:640]
        assert np.any(quarter != BACKGROUND, axis=-1).sum() == 14 * 14
        assert np.any(pixels != BACKGROUND, axis=-1).sum() > 2 * 50 * 50  # and 2-4 large shapes around it
    assert "centre" in ds[0]["prompt"][0]["content"] and "Zoom in" in ds[0]["prompt"][0]["content"]


@pytest.mark.parametrize("family, side", [("qwen3_vl", 128), ("qwen2_5_vl", 112)])
def test_zoom_color_dot_is_gone_at_the_prompts_budget_and_the_demonstrated_zoom_shows_it(family: str, side: int):
    """The prompt's image, fitted to the tiny model's budget by its own processor's resize, is the same pixel for
    pixel whatever the dot's colour (so nothing, no classifier either, can read it there), while the zoom the warm
    start demonstrates shows the dot in its colour."""
    import random

    from vlm_grpo.data.scene import colors_for, render
    from vlm_grpo.data.zoom_task import centre_dot, zoom_color_example
    from vlm_grpo.media.pixel_budget import apply_pixel_budget
    from vlm_grpo.tiny.build import tiny_image_processor
    from vlm_grpo.tools import zoom_image
    from vlm_grpo.tools.warm_start import demonstration_call

    budget = apply_pixel_budget(tiny_image_processor(family), log=False)
    for seed in range(6):
        scene = zoom_color_example(random.Random(seed), 1024, 3)  # 8 colours
        prompts, zooms = [], []
        for name in colors_for(3):
            canvas = render(scene.items[:-3] + centre_dot(COLORS[name], 1024), 1024)
            prompt = budget.fit(canvas)
            call = demonstration_call(scene.extra["bbox"], canvas.size, prompt.size, 8)["arguments"]
            assert prompt.size == (side, side) and call["factor"] == 8
            prompts.append(_pixels(prompt))
            zooms.append(_pixels(zoom_image(prompt, **call, source=canvas)))
            # The dot's middle, nearest its own colour of the palette (at 112 the zoom is the canvas at 7/8: resampled).
            middle = zooms[-1][zooms[-1].shape[0] // 2 - 2, zooms[-1].shape[1] // 2 - 2].astype(int)
            assert min(COLORS, key=lambda c: np.abs(middle - COLORS[c]).sum()) == name, (name, middle)
        assert all(np.array_equal(prompts[0], p) for p in prompts[1:])
        # Any two colours' zooms differ by far more than a pixel's rounding.
        assert min(np.abs(a.astype(int) - b).max() for a, b in itertools.combinations(zooms, 2)) > 60

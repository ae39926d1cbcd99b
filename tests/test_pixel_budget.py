"""vlm_grpo.media.pixel_budget: the processor's own budget is the one budget (Qwen-VL), images are resized once."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_grpo.media.pixel_budget import (
    PixelBudget,
    apply_pixel_budget,
    fed_size,
    pixel_budget_for_call,
    processor_pixel_budget,
    set_processor_pixel_budget,
)
from vlm_grpo.media.processor import load_processor

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _noise(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_fed_size_is_the_processors_grid(tiny_dir) -> None:
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    ip = processor.image_processor
    for width, height in [(640, 480), (1920, 1080), (57, 300)]:
        grid = ip(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert fed_size(ip, width, height) == (int(grid[2]) * ip.patch_size, int(grid[1]) * ip.patch_size)
    assert fed_size(load_processor(tiny_dir("gemma3"), "gemma3").image_processor, 640, 480) is None


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("width, height", [(517, 333), (9, 40)])  # over the budget, under it
def test_qwen_images_are_resized_once_to_what_the_processor_alone_feeds(tiny_dir, family, width, height) -> None:
    processor = load_processor(tiny_dir(family), family)
    budget = apply_pixel_budget(processor, min_pixels=32 * 32, max_pixels=200 * 200)
    image = _noise(width, height)
    alone = processor.image_processor(images=[image], return_tensors="pt")
    fitted = budget.fit(image)
    fed = processor.image_processor(images=[fitted], return_tensors="pt")
    # Bit-identical: our resize is the processor's own (its smart_resize size, its filter), and it resizes no more.
    assert torch.equal(fed["image_grid_thw"], alone["image_grid_thw"])
    assert torch.equal(fed["pixel_values"], alone["pixel_values"])
    patch = processor.image_processor.patch_size
    _, h, w = fed["image_grid_thw"][0].tolist()
    assert fitted.size == (w * patch, h * patch) and 32 * 32 <= fitted.width * fitted.height <= 200 * 200


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_processors_without_a_budget_get_images_fitted_to_ours(tiny_dir, family) -> None:
    processor = load_processor(tiny_dir(family), family)
    assert processor_pixel_budget(processor) is None
    budget = apply_pixel_budget(processor, max_pixels=40 * 40)
    assert budget == PixelBudget(None, 40 * 40)
    fitted = budget.fit(_noise(400, 200))
    assert fitted.width * fitted.height <= 40 * 40 and abs(fitted.width / fitted.height - 2) < 0.1
    with pytest.raises(ValueError, match=r"has no pixel budget.*VLMGRPOConfig\(min_pixels"):
        set_processor_pixel_budget(processor, max_pixels=40 * 40)


def test_setting_the_budget_keeps_unset_bounds_and_refuses_a_conflict(tiny_dir) -> None:
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    low, high = processor_pixel_budget(processor)
    assert set_processor_pixel_budget(processor, max_pixels=high * 2) == {"max_pixels": (high, high * 2)}
    assert processor_pixel_budget(processor) == (low, high * 2)
    assert processor.image_processor.size["longest_edge"] == high * 2  # in the processor's own settings, saved with it
    with pytest.raises(ValueError, match=rf"max_pixels \({low - 1}\).*processor's own budget"):
        set_processor_pixel_budget(processor, max_pixels=low - 1)
    assert processor_pixel_budget(processor) == (low, high * 2)  # a refused budget changes nothing


def test_a_replaced_value_is_logged(tiny_dir, caplog) -> None:
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    low, high = processor_pixel_budget(processor)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.media.pixel_budget"):
        budget = apply_pixel_budget(processor, max_pixels=high // 2)
        apply_pixel_budget(processor, max_pixels=high // 2)  # nothing replaced the second time: nothing logged
    assert budget.max_pixels == high // 2 and processor_pixel_budget(processor) == (low, high // 2)
    [record] = caplog.records
    assert f"VLMGRPOConfig.max_pixels={high // 2} replaces the processor's max_pixels={high}" in record.getMessage()


def test_a_budget_for_one_call_is_put_back(tiny_dir) -> None:
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    before = processor_pixel_budget(processor)
    with pixel_budget_for_call(processor, max_pixels=before[0] * 4) as budget:
        assert processor_pixel_budget(processor) == (before[0], before[0] * 4) == (budget.min_pixels, budget.max_pixels)
    assert processor_pixel_budget(processor) == before


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_images_the_processor_refuses_are_skipped_before_training(tiny_dir, family, caplog) -> None:
    # Qwen-VL's and GLM-4V's smart_resize raise for an aspect ratio over 200:1; found at a batch, it would end the run
    # there. GLM-4V's budget is ours (its smart_resize budgets frames x area), its refusal its processor's.
    from datasets import Dataset

    from vlm_grpo.data.rows import check_dataset

    processor = load_processor(tiny_dir(family), family)
    budget = apply_pixel_budget(processor, log=False)
    if family == "glm4v":
        assert budget.image_processor is None and budget.max_aspect_ratio == 200
        with pytest.raises(ValueError, match="aspect ratio"):  # the real processor, as a batch would meet it
            processor.image_processor(images=[Image.new("RGB", (20000, 50))])
        processor.image_processor(images=[Image.new("RGB", (300, 66))])
    sizes = [(64, 64), (20000, 50), (64, 64), (300, 20000 // 300)]  # the last, 300x66, is a fine elongated image
    dataset = Dataset.from_dict({"prompt": ["q"] * 4, "image": [Image.new("RGB", size) for size in sizes]})
    with caplog.at_level("WARNING"):
        checked, skipped = check_dataset(dataset, pixel_budget=budget)
    assert len(checked) == 3 and skipped.indices == [1]
    assert "20000x50" in skipped.reasons[0] and "aspect ratio" in skipped.reasons[0] and "crop" in skipped.reasons[0]
    assert all(budget.fit(image).size for image in checked["image"])  # what is left, the processor takes
    # A budget of our own (Gemma 3, Idefics3) refuses nothing: those processors take any shape.
    assert len(check_dataset(dataset, pixel_budget=PixelBudget(max_pixels=40 * 40))[0]) == 4

"""add_image_sizes: the fed size is what the real processor feeds, so Qwen2.5-VL boxes map back exactly."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from vlm_grpo.data.rows import add_image_sizes, prepare_row
from vlm_grpo.media.pixel_budget import PixelBudget, apply_pixel_budget
from vlm_grpo.media.processor import load_processor
from vlm_grpo.rewards import make_iou_reward


def test_rows_get_source_and_fed_sizes_and_the_reward_maps_back(tiny_dir) -> None:
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    budget = apply_pixel_budget(processor, max_pixels=200704)
    raw = [{"prompt": "where?", "image": Image.new("RGB", (640, 480)), "bbox": [160, 120, 480, 360]},
           {"prompt": "no image", "images": []}]  # fmt: skip
    rows = add_image_sizes([prepare_row(r, budget) for r in raw], processor)
    assert rows[0]["source_image_size"] == (640, 480) and rows[1]["fed_image_size"] is None
    assert rows[0]["fed_image_size"] == rows[0]["images"][0].size  # fitted once, to what the processor feeds
    fed_w, fed_h = rows[0]["fed_image_size"]
    assert (fed_w, fed_h) != (640, 480)  # the budget shrank it: without mapping back the box would be misread
    pred = f"[{fed_w / 4}, {fed_h / 4}, {3 * fed_w / 4}, {3 * fed_h / 4}]"
    reward = make_iou_reward(coordinate_frame="qwen2_5_vl")
    columns = {k: [rows[0][k]] for k in ("bbox", "source_image_size", "fed_image_size")}
    assert reward(None, [pred], **columns)[0] > 0.999


def test_source_size_is_the_datasets_even_when_the_image_was_fitted_first(tiny_dir) -> None:
    # Gemma 3 has no pixel budget of its own, so the image is shrunk before the processor; the source size must
    # still be the dataset image's (upright: EXIF orientation 6 turns 64x32 into 32x64), recorded when it was loaded.
    processor = load_processor(tiny_dir("gemma3"), "gemma3")
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (64, 32)).save(buffer, "JPEG", exif=exif)
    image = {"bytes": buffer.getvalue(), "path": None}
    row = prepare_row({"prompt": "where?", "image": image}, PixelBudget(max_pixels=512))
    [fitted] = row["images"]
    assert fitted.width * fitted.height <= 512
    [sized] = add_image_sizes([row], processor)
    assert sized["source_image_size"] == (32, 64) and sized["fed_image_size"] is None


@pytest.mark.trains
def test_trainer_hands_the_sizes_to_reward_functions(tiny_dir, tmp_path) -> None:
    from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    model, processor = FastVisionModel.from_pretrained(
        tiny_dir("qwen2_5_vl", words=answer_words("color", 1)), full_finetuning=True
    )
    seen = []

    def spy(prompts, completions, source_image_size, fed_image_size, **kwargs):
        seen.extend(zip(source_image_size, fed_image_size, strict=True))
        return [0.0] * len(completions)

    config = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=2,
        max_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    dataset = make_visual_reasoning_dataset("color", 4, image_size=60)  # 60 px is fed as 56 (a multiple of 28)
    VLMGRPOTrainer(
        model=model, reward_funcs=[spy], args=config, train_dataset=dataset, processing_class=processor
    ).train()
    assert seen and set(seen) == {((60, 60), (56, 56))}

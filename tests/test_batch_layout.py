"""`vlm_grpo.media.batch_layout`: each family's processor outputs split over rows, and the groups of a batch.

The check is the processor itself: the outputs `select_rows` cuts out of a batch must equal what the processor
gives for those rows alone, on every tiny family (each lays its vision tensors out its own way).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_grpo.families import family_of
from vlm_grpo.media.batch_layout import ImageLayout, LayoutUnknown, distinct_prompts, group_rows, select_rows
from vlm_grpo.media.processor import load_processor

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "llava_onevision", "glm4v", "glm46v", "internvl",
            "smolvlm", "mistral3"]  # fmt: skip


def _image(seed: int, size: int = 32) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _process(processor, rows: list[list[Image.Image]]) -> dict:
    """Processor outputs for one prompt per row, with an image placeholder per image (none for a text row)."""
    messages = [[{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": "hi"}]}]
                for images in rows]  # fmt: skip
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = rows if any(rows) else None
    out = processor(text=text, images=images, return_tensors="pt", padding=True)
    return {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}


@pytest.mark.parametrize("family", FAMILIES)
def test_selected_rows_are_what_the_processor_gives_for_those_rows_alone(tiny_dir, family):
    processor = load_processor(tiny_dir(family), family)
    # One image, two images of different sizes, one image again: three rows with their own ranges.
    rows = [[_image(0)], [_image(1), _image(2, 48)], [_image(3)]]
    batch = _process(processor, rows)
    for subset in ([2, 0], [1], [0, 1, 2]):
        expected = _process(processor, [rows[r] for r in subset])
        selected = select_rows(batch, [len(r) for r in rows], subset)
        for key in ("pixel_values", "image_grid_thw", "pixel_attention_mask"):
            if key in expected:
                # Padded to the batch's most images per row (Idefics3, SmolVLM) or views per image (LLaVA-OneVision).
                if family in ("idefics3", "smolvlm", "llava_onevision") and key != "image_grid_thw":
                    n = expected[key].shape[1]
                    assert torch.equal(selected[key][:, :n], expected[key]), (family, key, subset)
                else:
                    assert torch.equal(selected[key], expected[key]), (family, key, subset)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "idefics3"])
def test_groups_are_rows_with_the_same_prompt_and_the_same_pixels(tiny_dir, family):
    processor = load_processor(tiny_dir(family), family)
    a, b = _image(0), _image(0)  # equal pixels, distinct objects (as TRL's sampler gives them)
    rows = [[a], [_image(1)], [b], [a], [_image(1)]]
    fields = _process(processor, rows)
    layout = ImageLayout.of(fields, [1] * 5)
    # Same prompt for all: the images decide. Shuffled rows of one group are found wherever they are.
    assert group_rows(["same prompt"] * 5, layout, fields) == [[0, 2, 3], [1, 4]]
    # Different prompts split a group even with the same images.
    assert group_rows(["p", "p", "q", "p", "p"], layout, fields) == [[0, 3], [1, 4], [2]]


def test_group_rows_without_images_groups_by_prompt():
    assert group_rows([(1, 2), (3,), (1, 2)]) == [[0, 2], [1]]


def test_a_layout_it_cannot_split_is_refused_by_name():
    with pytest.raises(LayoutUnknown, match="not a known layout"):
        ImageLayout.of({"pixel_values": torch.zeros(3, 3, 8, 8)}, [1, 1])  # 3 entries, 2 images, 2 rows


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenising_each_distinct_prompt_once_gives_what_trl_gives_for_every_row(tiny_dir, tmp_path, family):
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.data_utils import prepare_multimodal_messages

    from vlm_grpo.data.rows import prepare_row
    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    if not family_of(family).batched_prompts:
        pytest.skip(
            "TRL's own tokenisation crashes on these prompts of different lengths (tests/test_scoring_fixes.py)"
        )
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
             "images": [_image(seed)]} for seed in (0, 1)]  # fmt: skip
    rows.append({"prompt": [{"role": "user", "content": [{"type": "text", "text": "no image"}]}], "images": []})
    args = VLMGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=9, num_generations=3,
                         max_completion_length=4, report_to="none", use_cpu=True)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [lambda prompts, completions, **kw: [0.0] * len(completions)], args=args,
                             train_dataset=Dataset.from_list(rows), processing_class=processor)  # fmt: skip
    # As TRL's sampler hands them over: each prompt three times, shuffled, with freshly decoded (distinct) images.
    order = [2, 0, 1, 0, 2, 1, 1, 0, 2]
    prepared = [prepare_row({**rows[i], "images": [_image(s) for s in ((0,), (1,), ())[i]]}) for i in order]
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in prepared]
    assert distinct_prompts(prompts) == ([0, 1, 2], [0, 1, 2, 1, 0, 2, 2, 1, 0])  # the processor runs on 3 rows
    ids, images, fields = trainer._tokenize_prompts(prompts)
    trl_ids, trl_images, trl_fields = GRPOTrainer._tokenize_prompts(trainer, prompts)
    assert ids == trl_ids and [len(i or []) for i in images] == [len(i or []) for i in trl_images]
    assert fields.keys() == trl_fields.keys()
    for key, value in fields.items():
        expected = trl_fields[key]
        if key == family_of(family).images_per_row_input:  # TRL's counts only rows with images; ours every row
            expected = [len(i or []) for i in trl_images]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, torch.as_tensor(np.asarray(expected))), key
        else:
            assert value == expected, key

import torch
from PIL import Image

from vlm_grpo.data.rows import prepare_row
from vlm_grpo.media.processing import (
    ROW_VISION_KEYS,
    holds_clips,
    process_prompts,
    row_vision_inputs,
    tokenize_clip_prompts,
)
from vlm_grpo.models.loader import FastVisionModel


def _frames(colour, n=4, side=56):
    return [Image.new("RGB", (side, side), colour) for _ in range(n)]


def _prompts():
    clip = prepare_row({"prompt": "What colour? <video>", "video": _frames((220, 20, 20)), "image": None})
    both = prepare_row({"prompt": "<image> then <video>", "video": _frames((20, 20, 220), 2),
                        "image": Image.new("RGB", (56, 56), (0, 200, 0))})  # fmt: skip
    text = prepare_row({"prompt": "Say red.", "video": None, "image": None})
    # TRL's batch: every prompt repeated for its group of 2.
    return [row["prompt"] for row in (clip, clip, both, both, text, text)]


def test_clip_prompts_are_processed_once_per_group_and_match_processing_every_row(tiny_dir):
    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    prompts = _prompts()
    assert holds_clips(prompts)
    ids, media, fields, rows = tokenize_clip_prompts(processor, prompts)
    everything = process_prompts(processor, prompts)  # every row processed, as TRL would without the grouping
    assert ids == everything["input_ids"]
    assert [len(m) for m in media] == [1, 1, 2, 2, 0, 0]  # images and clips of each row
    assert [(r["num_images"], r["num_videos"]) for r in rows] == [(0, 1), (0, 1), (1, 1), (1, 1), (0, 0), (0, 0)]
    for key in ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"):
        assert torch.equal(fields[key], torch.as_tensor(everything[key])), key
    assert set(rows[0]) <= {*ROW_VISION_KEYS, "num_images", "num_videos"}
    assert rows[0]["pixel_values_videos"] is rows[1]["pixel_values_videos"]  # a group shares its processed clip


def test_row_vision_inputs_mark_image_and_video_tokens_of_the_prompt_only(tiny_dir):
    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    prompts = _prompts()[2:4]  # an image and a clip
    ids, _, _, rows = tokenize_clip_prompts(processor, prompts)
    completion = [[processor.video_token_id, processor.image_token_id]]  # sampled ids are never vision inputs
    input_ids = torch.tensor([row + completion[0] for row in ids])
    inputs = row_vision_inputs(rows, input_ids, logits_to_keep=2, processor=processor)
    types = inputs["mm_token_type_ids"]
    prompt = input_ids[:, :-2]
    assert torch.equal(types[:, :-2] == 1, prompt == processor.image_token_id)
    assert torch.equal(types[:, :-2] == 2, prompt == processor.video_token_id)
    assert int((types == 2).sum()) > 0 and int((types == 1).sum()) > 0 and not types[:, -2:].any()
    assert inputs["num_images"] == [1, 1] and inputs["num_videos"] == [1, 1]
    assert inputs["video_grid_thw"].shape[0] == 2 and inputs["image_grid_thw"].shape[0] == 2

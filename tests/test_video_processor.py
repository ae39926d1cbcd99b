"""`vlm_grpo.media.video_processor`: Qwen-VL's video processor without torchvision, checked against transformers' own code.

transformers' image processor lays out one image as a clip of `temporal_patch_size` copies of it, with the same
patchify as its video processors; so a clip of two identical frames must give exactly the image processor's patches.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_grpo.media.processor import load_processor
from vlm_grpo.media.video_processor import QwenVideoProcessorPil

QWEN_VIDEO = ["qwen2_5_vl", "qwen3_vl"]
SIDE = {"qwen2_5_vl": 56, "qwen3_vl": 64}  # sizes neither budget resizes


def _noise(side: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", QWEN_VIDEO)
def test_a_still_clip_gives_the_image_processors_patches(tiny_dir, family):
    processor = load_processor(tiny_dir(family), family)
    assert isinstance(processor.video_processor, QwenVideoProcessorPil)
    frame = _noise(SIDE[family])
    image = processor.image_processor(images=[frame], return_tensors="pt")
    video = processor.video_processor(videos=[[frame, frame]], return_tensors="pt")
    assert torch.equal(video["video_grid_thw"], image["image_grid_thw"])
    assert torch.allclose(video["pixel_values_videos"], image["pixel_values"], atol=1e-5)


@pytest.mark.parametrize("family", QWEN_VIDEO)
def test_frames_pair_into_temporal_steps_and_the_processor_places_every_token(tiny_dir, family):
    processor = load_processor(tiny_dir(family), family)
    side = SIDE[family]
    frames = [_noise(side, seed) for seed in range(3)]  # odd: the last frame is repeated, as transformers pads
    metadata = [{"total_num_frames": 24, "fps": 8.0, "frames_indices": [0, 8, 16]}]
    messages = [[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "which way?"}]}]]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=text, videos=[frames], video_metadata=metadata, do_sample_frames=False, return_tensors="pt")
    patch = processor.video_processor.patch_size
    assert out["video_grid_thw"].tolist() == [[2, side // patch, side // patch]]
    tokens = (out["input_ids"] == processor.video_token_id).sum()
    assert tokens == out["video_grid_thw"].prod() // 4 == out["pixel_values_videos"].shape[0] // 4
    if family == "qwen2_5_vl":  # seconds per temporal step: 2 frames at the sampled rate (3 of 24 frames at 8 fps)
        assert out["second_per_grid_ts"].tolist() == pytest.approx([2 / (3 / 24 * 8)])
    # The last temporal step is frame 2 twice: its patches equal a still clip of frame 2.
    last = processor.video_processor(videos=[[frames[2], frames[2]]], return_tensors="pt")["pixel_values_videos"]
    assert torch.equal(out["pixel_values_videos"][-last.shape[0] :], last)


def test_it_resizes_by_the_familys_budget_and_refuses_what_it_cannot_do(tiny_dir):
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    video = processor.video_processor(videos=[[Image.new("RGB", (300, 200))] * 2], return_tensors="pt")
    t, h, w = video["video_grid_thw"][0].tolist()
    assert t == 1 and h * w * 14 * 14 <= processor.video_processor.size["longest_edge"]  # per-frame budget
    with pytest.raises(ValueError, match="does not sample frames"):
        processor.video_processor(videos=[[Image.new("RGB", (56, 56))] * 2], do_sample_frames=True)
    with pytest.raises(ValueError, match="not a Qwen-VL video processor"):
        QwenVideoProcessorPil("LlavaVideoProcessor")


@pytest.mark.parametrize("family", QWEN_VIDEO)
def test_checkpoints_keep_the_video_settings_under_the_real_class_name(tiny_dir, tmp_path, family):
    processor = load_processor(tiny_dir(family), family)
    processor.video_processor.size["longest_edge"] = 12345 * 16
    processor.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "processor_config.json")) as f:
        saved = json.load(f)["video_processor"]
    assert saved["video_processor_type"] == {"qwen2_5_vl": "Qwen2VLVideoProcessor",
                                             "qwen3_vl": "Qwen3VLVideoProcessor"}[family]  # fmt: skip
    assert saved["size"]["longest_edge"] == 12345 * 16
    reloaded = load_processor(str(tmp_path), family)
    assert reloaded.video_processor.to_dict() == processor.video_processor.to_dict()

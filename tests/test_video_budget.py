"""`vlm_grpo.media.video_budget`: which frames a clip keeps and the size they are fed at, decided once."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

from vlm_grpo.media.clips import Clip
from vlm_grpo.media.processor import load_processor
from vlm_grpo.media.video_budget import VideoBudget, apply_video_budget, fed_frame_size


class _Pairs:  # a video processor's temporal patch, all frame counting needs
    temporal_patch_size = 2


def test_frames_follow_the_rate_the_cap_and_the_temporal_patch():
    budget = VideoBudget(fps=2.0, max_frames=16, video_processor=_Pairs())
    assert budget.frame_indices(24, 8.0) == [0, 5, 9, 14, 18, 23]  # 3 s at 8 fps: 6 frames at 2 fps, spread evenly
    assert len(budget.frame_indices(800, 8.0)) == 16  # 100 s: capped
    assert budget.frame_indices(5, None) == [0, 1, 3, 4]  # given frames: kept, down to a multiple of 2
    assert budget.frame_indices(1, None) == [0, 0]  # one frame: repeated to one temporal step
    assert len(VideoBudget(num_frames=8, video_processor=_Pairs()).frame_indices(800, 8.0)) == 8
    assert VideoBudget(max_frames=3).frame_indices(10, None) == [0, 4, 9]  # no temporal patch: any count
    for bad in ({"fps": 0}, {"max_frames": 0}, {"num_frames": 2.5}):
        with pytest.raises(ValueError, match="must be a positive"):
            VideoBudget(**bad)


def test_a_clip_shorter_than_num_frames_is_named_once(caplog):
    budget = VideoBudget(num_frames=14, video_processor=_Pairs())
    with caplog.at_level("WARNING"):
        assert len(budget.frame_indices(5, None)) == 14
        budget.frame_indices(4, None)
        budget.frame_indices(40, None)
    assert caplog.text.count("a clip of 5 frames is shown as 14 (video_num_frames=14): its frames repeat") == 1
    assert "clip of 4" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # 5 rounds down to 4 (pairs of frames): a clip of 4 repeats none
        assert VideoBudget(num_frames=5, video_processor=_Pairs()).frame_indices(4, None) == [0, 1, 2, 3]
    assert "repeat" not in caplog.text


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_frames_are_resized_once_to_what_the_processor_would_feed(tiny_dir, family):
    processor = load_processor(tiny_dir(family), family)
    budget = apply_video_budget(processor)
    frames = [Image.new("RGB", (300, 170), (i, i, i)) for i in range(0, 160, 10)]  # 16 frames, over the budget
    clip = budget.load(frames)
    assert len(clip.frames) == 16 and clip.fps == budget.fps  # given frames are taken at the budget's rate
    raw = processor.video_processor(videos=[frames], return_tensors="pt")
    fitted = processor.video_processor(videos=[list(clip.frames)], return_tensors="pt")
    assert fitted["video_grid_thw"].tolist() == raw["video_grid_thw"].tolist()  # the processor's own size ...
    patch = processor.video_processor.patch_size
    _, h, w = fitted["video_grid_thw"][0].tolist()
    assert clip.size == (w * patch, h * patch)  # ... reached before it, so it resizes nothing
    assert fed_frame_size(processor.video_processor, 16, *clip.size) == clip.size
    if family == "qwen3_vl":  # the budget covers frames x area: fewer frames may be bigger
        assert fed_frame_size(processor.video_processor, 2, 300, 170) > clip.size


def test_the_config_budget_is_written_into_the_video_processor_and_logged(tiny_dir, caplog):
    processor = load_processor(tiny_dir("qwen2_5_vl"), "qwen2_5_vl")
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.media.video_budget"):
        budget = apply_video_budget(processor, max_pixels=28 * 28, num_frames=4)
    assert processor.video_processor.size["longest_edge"] == 28 * 28 and "video_max_pixels=784" in caplog.text
    assert budget.load([Image.new("RGB", (200, 200))] * 9).size == (28, 28) and budget.num_frames == 4
    with pytest.raises(ValueError, match="video_min_pixels"):
        apply_video_budget(processor, min_pixels=10**6)
    gemma = load_processor(tiny_dir("gemma3"), "gemma3")
    assert apply_video_budget(gemma).video_processor is None


def test_a_clip_without_a_rate_gets_the_budgets():
    clip = Clip((Image.new("RGB", (8, 8)),) * 2, None, (0, 1), 2)
    assert VideoBudget(fps=4.0).fit(clip).metadata()["fps"] == 4.0

"""`vlm_grpo.media.clips`: every clip layout read into the same frames, and each kind of bad clip a named error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_video
from PIL import Image

from vlm_grpo.media.clips import Clip, VideoError, load_clip, probe_clip


def _frames(n: int = 6, size: tuple[int, int] = (32, 24)) -> list[Image.Image]:
    """Frames whose grey level is 20 x their index, so a kept frame names its own index."""
    return [Image.new("RGB", size, (20 * i,) * 3) for i in range(n)]


def _levels(clip: Clip) -> list[int]:
    return [round(frame.getpixel((3, 3))[0] / 20) for frame in clip.frames]


def test_every_frame_layout_reads_the_same_frames(tmp_path):
    frames = _frames()
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(frames):  # natural order: frame_2 before frame_10, whatever the listing order
        frame.save(folder / f"frame_{i * 5}.png")
    array = np.stack([np.asarray(f) for f in frames])
    layouts = {
        "PIL frames": frames,
        "arrays": [np.asarray(f) for f in frames],
        "T x H x W x C array": array,
        "nested lists (a datasets column)": array.tolist(),
        "folder": str(folder),
        "frames with a rate": {"frames": frames, "fps": 4.0},
    }
    for name, value in layouts.items():
        clip = load_clip(value)
        assert _levels(clip) == list(range(6)), name
        assert clip.size == (32, 24) and clip.indices == tuple(range(6)) and clip.total_frames == 6, name
        assert probe_clip(value) == 6, name
    assert load_clip({"frames": frames, "fps": 4.0}).fps == 4.0 and load_clip(frames).fps is None


def test_a_sampler_picks_the_frames_and_only_those_are_kept():
    clip = load_clip(_frames(), lambda total, fps: [0, 2, 2, 5])
    assert _levels(clip) == [0, 2, 2, 5] and clip.indices == (0, 2, 2, 5) and clip.total_frames == 6
    assert clip.metadata()["frames_indices"] == [0, 2, 2, 5]


def test_a_video_file_is_decoded_with_its_rate_up_to_the_last_frame_needed(tmp_path):
    path = write_video(tmp_path / "clip.mp4", n=10, fps=8)
    seen = []

    def sample(total, fps):
        seen.append((total, fps))
        return [1, 4, 7]

    clip = load_clip(path, sample)
    assert seen == [(10, 8.0)]
    assert clip.fps == 8.0 and clip.total_frames == 10 and clip.indices == (1, 4, 7)
    assert [abs(level - want) <= 1 for level, want in zip(_levels(clip), (1, 4, 7))] == [True] * 3  # lossy codec
    assert all(f.mode == "RGB" and f.size == (32, 32) for f in clip.frames)
    assert probe_clip(path) == 10
    assert probe_clip({"path": path, "bytes": None}) == 10  # datasets' Video(decode=False) form
    with open(path, "rb") as f:
        assert len(load_clip({"bytes": f.read(), "path": None}).frames) == 10


def test_bad_clips_are_named_errors(tmp_path):
    garbage = tmp_path / "broken.mp4"
    garbage.write_bytes(b"\x00not a video at all" * 10)
    empty = tmp_path / "empty"
    empty.mkdir()
    uneven = tmp_path / "uneven"
    uneven.mkdir()
    Image.new("RGB", (16, 16)).save(uneven / "1.png")
    Image.new("RGB", (16, 20)).save(uneven / "2.png")
    cases = {
        "not a readable video": str(garbage),
        "video not found": str(tmp_path / "missing.mp4"),
        "has no frames": str(empty),
        "frame 1 is 16x20 but frame 0 is 16x16": str(uneven),
    }
    for message, value in cases.items():
        with pytest.raises(VideoError, match=message):
            probe_clip(value)
        with pytest.raises(VideoError, match=message):
            load_clip(value)
    with pytest.raises(VideoError, match="has no frames"):
        load_clip([])
    with pytest.raises(VideoError, match="every frame of a clip must have one size"):
        load_clip([Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))])
    with pytest.raises(VideoError, match="frame 1: image file not found"):
        load_clip([Image.new("RGB", (8, 8)), str(tmp_path / "nope.png")])
    with pytest.raises(VideoError, match="cannot read a clip from 'int'"):
        load_clip(3)
    with pytest.raises(VideoError, match='"fps" must be a positive number'):
        load_clip({"frames": _frames(), "fps": 0})

"""`vlm_grpo.media.checks`: an animated image is named in one warning (the model sees its first frame only)."""

from __future__ import annotations

from datasets import Dataset, Features, Image, Value
from PIL import Image as PILImage

from vlm_grpo.media.checks import drop_unreadable_rows


def test_animated_images_are_named_with_their_frames(tmp_path, caplog):
    frames = [PILImage.new("RGB", (8, 8), (60 * i, 0, 0)) for i in range(3)]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:])
    frames[0].save(tmp_path / "still.gif")
    paths = [str(tmp_path / "still.gif"), str(tmp_path / "moving.gif")]
    dataset = Dataset.from_dict(
        {"image": paths, "q": ["a", "b"]}, features=Features({"image": Image(), "q": Value("string")})
    )
    with caplog.at_level("WARNING"):
        kept, skipped = drop_unreadable_rows(dataset, "image", "train.jsonl")
    assert len(kept) == 2 and not skipped
    assert "train.jsonl: 1 animated image(s) (GIF, WebP, APNG; row 1, image 0: 3 frames)" in caplog.text
    caplog.clear()
    frames[0].save(tmp_path / "pages.tiff", save_all=True, append_images=frames[1:])  # pages, not an animation
    assert PILImage.open(tmp_path / "pages.tiff").n_frames == 3
    still = Dataset.from_dict(
        {"image": [paths[0], str(tmp_path / "pages.tiff")]}, features=Features({"image": Image()})
    )
    with caplog.at_level("WARNING"):
        drop_unreadable_rows(still, "image", "train.jsonl")
    assert "animated" not in caplog.text

"""`vlm_grpo.data.prompts`: the one set of rules the trainer's rows, dataset loading and the synthetic tasks share."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlm_grpo.data.load import DatasetError, load_grpo_dataset
from vlm_grpo.data.prompts import apply_template, user_content, with_system
from vlm_grpo.data.rows import prepare_row
from vlm_grpo.media.columns import image_column


def test_placeholders_place_the_images_and_keep_the_text_as_written():
    assert user_content("<image>Find x.") == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert user_content("a <image> b <image>") == [
        {"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": " b "}, {"type": "image"},
    ]  # fmt: skip
    assert user_content("no placeholder", n_images=2) == [{"type": "image"}] * 2 + [
        {"type": "text", "text": "no placeholder"}
    ]
    assert user_content("text only") == "text only"


def test_the_trainer_rows_and_the_loader_build_the_same_user_content(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text(json.dumps({"problem": "Look: <image> how many?", "answer": "1",
                                                  "images": ["a.png"]}) + "\n")  # fmt: skip
    train, _ = load_grpo_dataset(str(tmp_path / "d.jsonl"))
    loaded = [{k: v for k, v in block.items() if v is not None} for block in train[0]["prompt"][0]["content"]]
    prepared = prepare_row({"prompt": "Look: <image> how many?", "images": [Image.new("RGB", (8, 8))]})
    assert loaded == prepared["prompt"][0]["content"]


def test_a_system_prompt_goes_first_once_in_the_messages_style():
    chat = [{"role": "user", "content": "hi"}]
    assert with_system(chat, "Be brief.") == [{"role": "system", "content": "Be brief."}, *chat]
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert with_system(blocks, "Be brief.")[0]["content"] == [{"type": "text", "text": "Be brief."}]
    already = with_system(chat, "first")
    assert with_system(already, "second") == already and with_system(chat, None) == chat
    assert apply_template("2+2?", "{prompt} Answer in <answer></answer>.") == "2+2? Answer in <answer></answer>."


def test_both_image_columns_are_refused_not_guessed(tmp_path):
    with pytest.raises(ValueError, match="both an `image` and an `images` column"):
        image_column(["prompt", "image", "images"])
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "<image>?", "image": "a.png", "images": ["a.png"]}) + "\n")
    with pytest.raises(DatasetError, match="--image_column"):
        load_grpo_dataset(str(tmp_path / "d.jsonl"))
    train, _ = load_grpo_dataset(str(tmp_path / "d.jsonl"), image_column="images")  # named: no guessing needed
    assert len(train[0]["images"]) == 1


def test_video_placeholders_and_blocks_are_placed_like_images():
    from vlm_grpo.data.prompts import place_media
    from vlm_grpo.media.columns import video_column

    assert user_content("<video> then <image>?") == [
        {"type": "video"}, {"type": "text", "text": " then "}, {"type": "image"}, {"type": "text", "text": "?"},
    ]  # fmt: skip
    assert user_content("which way?", n_images=1, n_videos=1) == [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": "which way?"},
    ]  # fmt: skip
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which way <video>?"}]
    placed = place_media(chat, [], ["clip"])
    assert placed[0] == chat[0]
    assert placed[1]["content"] == [
        {"type": "text", "text": "Which way "}, {"type": "video", "video": "clip"}, {"type": "text", "text": "?"},
    ]  # fmt: skip
    with pytest.raises(ValueError, match="1 video block"):
        place_media(chat, [], [])
    with pytest.raises(ValueError, match="both a `video` and a `videos` column"):
        video_column(["prompt", "video", "videos"])
    assert video_column(["prompt", "videos"]) == "videos" and video_column(["prompt"]) is None

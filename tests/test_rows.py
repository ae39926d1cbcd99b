import io

import pytest
from datasets import Dataset
from datasets import Image as ImageFeature
from PIL import Image

from vlm_grpo.data.rows import check_dataset, count_image_placeholders, prepare_row, source_image_sizes
from vlm_grpo.media.pixel_budget import PixelBudget


def _png(size=(20, 10), color=(0, 128, 255)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_prepare_row_normalises_fits_and_wraps_string_prompts():
    rgba = Image.new("RGBA", (200, 100), (255, 0, 0, 0))  # fully transparent -> white after normalising
    row = prepare_row({"prompt": "What colour?", "image": rgba, "answer": "red"}, PixelBudget(max_pixels=50 * 25))
    assert row["prompt"] == [{"role": "user", "content": "What colour?"}]
    [image] = row["images"]  # one `image` becomes an `images` list, as for every row TRL sees
    assert image.mode == "RGB" and image.width * image.height <= 50 * 25 and image.getpixel((0, 0)) == (255, 255, 255)
    several = prepare_row({"prompt": "x", "images": [_png(), {"bytes": _png(), "path": None}]}, PixelBudget(400 * 200))
    assert [im.size for im in several["images"]] == [(400, 200)] * 2
    assert source_image_sizes(several) == [(20, 10)] * 2  # as the dataset holds them, for grounding rewards
    text_only = prepare_row({"prompt": "hi", "images": []})
    assert text_only["images"] == [] and text_only["prompt"] == [{"role": "user", "content": "hi"}]
    plain = prepare_row({"prompt": "no image column"})
    assert plain["prompt"] == "no image column"


def test_count_image_placeholders():
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]}]
    assert count_image_placeholders(prompt) == 2
    assert count_image_placeholders("a string <image>") == 0


def test_check_dataset_skips_unreadable_rows_with_reasons():
    rows = [{"prompt": "q", "image": {"bytes": _png(), "path": None}} for _ in range(3)]
    rows[1]["image"] = {"bytes": _png()[:30], "path": None}  # truncated PNG
    dataset = Dataset.from_list(rows).cast_column("image", ImageFeature())
    checked, skipped = check_dataset(dataset)
    assert len(checked) == 2 and skipped.indices == [1] and "row 1" in skipped.reasons[0]


def test_missing_and_corrupt_images_share_one_policy_skipped_up_to_half_the_rows(tmp_path, caplog):
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(_png()[:30])
    ok, corrupt, missing = (str(tmp_path / n) for n in ("ok.png", "corrupt.png", "missing.png"))

    def rows(*paths):
        return Dataset.from_list([{"prompt": "q", "image": p} for p in paths]).cast_column("image", ImageFeature())

    with caplog.at_level("WARNING"):
        checked, skipped = check_dataset(rows(ok, missing, ok, corrupt))  # 2 of 4: half is still skipped
    assert len(checked) == 2 and skipped.indices == [1, 3]
    assert "not found" in skipped.reasons[0] and "not a readable image" in skipped.reasons[1]
    assert "skipped 2 of 4 rows with missing or unreadable images (skip_bad_rows=False to stop" in caplog.text
    # Without decoding, a missing file is still found (a stat), a corrupt one is left for later.
    assert check_dataset(rows(ok, missing, ok, corrupt), check_images=False)[1].indices == [1]
    with pytest.raises(ValueError, match=r"3 of 4 rows have missing or unreadable images, more than 50%"):
        check_dataset(rows(ok, missing, missing, corrupt))
    with pytest.raises(ValueError, match="row 1, image 0: image file not found"):
        check_dataset(rows(ok, missing), skip_bad_rows=False)


def test_iterable_datasets_are_checked_by_columns_only():
    iterable = Dataset.from_list([{"question": "q"}]).to_iterable_dataset()
    with pytest.raises(ValueError, match="no `prompt` column"):
        check_dataset(iterable)
    ok = Dataset.from_list([{"prompt": "q"}]).to_iterable_dataset()
    assert check_dataset(ok)[0] is ok


def test_non_chat_prompt_objects_are_rejected():
    dataset = Dataset.from_list([{"prompt": [{"text": "no role"}]}])
    with pytest.raises(ValueError, match="chat messages"):
        check_dataset(dataset)


def _img(color=(255, 0, 0)):
    return Image.new("RGB", (28, 28), color)


def test_string_prompt_image_placeholders_place_the_images():
    # LLaVA / EasyR1 / geometry3k `problem` style: the images go where the placeholders are.
    row = prepare_row({"prompt": "<image>Compare with <image>. Which is red?", "images": [_img(), _img((0, 0, 255))]})
    [message] = row["prompt"]
    assert message["role"] == "user"
    assert [part["type"] for part in message["content"]] == ["image", "text", "image", "text"]
    assert message["content"][1]["text"] == "Compare with " and message["content"][3]["text"] == ". Which is red?"
    assert len(row["images"]) == 2


@pytest.mark.parametrize(
    "rows, message",
    [([{"prompt": "<image>What colour?"}], r"row 0: .*no `image` or `images` column"),
     ([{"prompt": "ok", "image": _img()}, {"prompt": "<image> and <image>?", "image": _img()}],
      r"row 1: .*2 <image> placeholder\(s\) but the row has 1 image"),
     ([{"prompt": "<image>?", "images": []}], r"row 0: .*1 <image> placeholder\(s\) but the row has 0 image")],
    ids=["no_image_column", "more_placeholders", "no_images"],
)  # fmt: skip
def test_string_placeholder_problems_raise_naming_the_row(rows, message):
    with pytest.raises(ValueError, match=message):
        check_dataset(Dataset.from_list(rows))


def test_string_placeholders_matching_the_images_pass():
    rows = [{"prompt": "<image>What colour?", "image": _img()}, {"prompt": "Text only.", "image": None}]
    assert len(check_dataset(Dataset.from_list(rows))[0]) == 2


@pytest.mark.parametrize(
    "column, values, target",
    [("img", [_img()], "image"), ("photos", [[_img(), _img()]], "images"),
     ("picture", [{"bytes": _png(), "path": None}], "image"), ("pixel_values", [[[0.0]]], "image"),
     ("scan", [{"bytes": _png(), "path": None}], "image")],
    ids=["pil", "pil_list", "image_dict", "obvious_name", "image_feature"],
)  # fmt: skip
def test_images_under_another_column_name_are_refused(column, values, target):
    dataset = Dataset.from_dict({"prompt": ["What colour?"] * len(values), column: values, "image_size": [(28, 28)]})
    if column == "scan":
        dataset = dataset.cast_column("scan", ImageFeature())
    with pytest.raises(ValueError, match=rf"column `{column}`.*rename_column\('{column}', '{target}'\)"):
        check_dataset(dataset)
    # Streaming datasets are checked by column name / feature only.
    if column in ("img", "scan"):
        with pytest.raises(ValueError, match=f"`{column}`"):
            check_dataset(dataset.to_iterable_dataset())


def test_text_only_dataset_with_other_columns_passes():
    dataset = Dataset.from_dict({"prompt": ["q"], "answer": ["a"], "image_size": [(28, 28)]})
    assert check_dataset(dataset)[0] is dataset


def test_every_row_becomes_an_images_list():
    with_image = prepare_row({"prompt": "q", "image": _img()})
    without = prepare_row({"prompt": "q", "image": None})
    assert len(with_image["images"]) == 1 and without["images"] == [] and "image" not in without
    assert prepare_row({"prompt": "q", "images": None})["images"] == []


def test_rows_for_rewards_give_back_the_dataset_format():
    from vlm_grpo.data.rows import rows_for_rewards

    chat = [{"role": "user", "content": "Chat?"}]
    rows = [prepare_row({"prompt": "<image>Colour?", "image": _img(), "answer": "red"}),
            prepare_row({"prompt": "Text?", "image": None, "answer": "blue"})]  # fmt: skip
    trl_completions = [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}]]
    inputs, prompts, completions = rows_for_rewards(
        rows, [r["prompt"] for r in rows], trl_completions, [[1], [2]], lambda ids: [f"decoded{i[0]}" for i in ids]
    )
    assert prompts == ["<image>Colour?", "Text?"] and completions == ["decoded1", "decoded2"]
    assert [sorted(r) for r in inputs] == [["answer", "image", "prompt"]] * 2 and inputs[1]["image"] is None
    # Chat prompts keep TRL's conversational format (prompt and completion untouched).
    chat_rows = [prepare_row({"prompt": chat, "images": [_img()]})]
    _, prompts, completions = rows_for_rewards(chat_rows, [chat], trl_completions[:1], [[1]], lambda ids: 1 / 0)
    assert prompts == [chat] and completions == trl_completions[:1]


# ----- clips -----


def _clip(n=4, size=(28, 28)):
    return [Image.new("RGB", size, (40 * i, 0, 0)) for i in range(n)]


def test_a_row_with_clips_gets_every_image_and_clip_placed_in_its_prompt():
    from vlm_grpo.data.rows import dataset_row, row_clips, row_images
    from vlm_grpo.media.clips import Clip

    row = {"prompt": "Compare <image> with <video>.", "image": _img(), "video": _clip(), "answer": "left"}
    prepared = prepare_row(row)
    assert "images" not in prepared and "video" not in prepared  # TRL must not process the images without the clips
    [message] = prepared["prompt"]
    assert [part["type"] for part in message["content"]] == ["text", "image", "text", "video", "text"]
    [clip] = row_clips(prepared)
    assert isinstance(clip, Clip) and len(clip.frames) == 4 and len(row_images(prepared)) == 1
    back = dataset_row(prepared)  # what the rewards get: the dataset's own columns
    assert back["prompt"] == row["prompt"] and back["video"] is row["video"] and back["answer"] == "left"
    assert back["image"].size == (28, 28)
    no_clip = prepare_row({"prompt": "Just text.", "video": None, "answer": "x"})
    assert no_clip["prompt"] == [{"role": "user", "content": "Just text."}] and row_clips(no_clip) == []


def test_check_dataset_checks_clips_like_images(tmp_path):
    from conftest import write_video

    from vlm_grpo.media.clips import VideoError

    uneven = _clip(2) + [Image.new("RGB", (30, 28))]
    rows = [{"prompt": "<video> which way?", "video": c} for c in (_clip(), uneven, [], _clip())]
    checked, skipped = check_dataset(Dataset.from_list(rows))
    assert len(checked) == 2 and skipped.indices == [1, 2]
    assert "frame 2 is 30x28" in skipped.reasons[0] and "has no frames" in skipped.reasons[1]
    files = [write_video(tmp_path / "ok.mp4"), str(tmp_path / "missing.mp4")]
    checked, skipped = check_dataset(Dataset.from_list([{"prompt": "<video>?", "video": f} for f in files]))
    assert len(checked) == 1 and skipped.indices == [1] and "video not found" in skipped.reasons[0]
    with pytest.raises(VideoError, match="row 0, clip 0: .*frame 2 is 30x28 but frame 0 is 28x28"):
        check_dataset(Dataset.from_list([{"prompt": "<video>?", "video": uneven}]), skip_bad_rows=False)
    with pytest.raises(ValueError, match="video placeholders but the dataset has no `video` or `videos` column"):
        check_dataset(Dataset.from_list([{"prompt": "What happens in <video>?"}]))
    with pytest.raises(ValueError, match="1 <video> placeholder"):
        check_dataset(Dataset.from_list([{"prompt": "<video>?", "videos": [_clip(), _clip()]}]))
    with pytest.raises(ValueError, match="column `clip` looks like it holds clips"):
        check_dataset(Dataset.from_list([{"prompt": "which way?", "clip": "a.mp4"}]))


def test_a_clip_file_named_by_repeated_rows_is_decoded_once(tmp_path):
    from conftest import write_video

    path = write_video(tmp_path / "a.mp4")
    memo: dict = {}
    rows = [prepare_row({"prompt": "<video>?", "video": path}, clip_memo=memo) for _ in range(4)]
    clips = [row["prompt"][0]["content"][0]["video"] for row in rows]
    assert all(clip is clips[0] for clip in clips) and list(memo) == [path]
    assert prepare_row({"prompt": "<video>?", "video": path})["prompt"][0]["content"][0]["video"] is not clips[0]


def test_an_images_column_of_single_images_counts_one_image_per_row():
    # `Dataset.from_dict({"images": [pil, pil]})` stores one image per row (an `Image` feature, not a list): each row
    # has one image, not the two keys of its undecoded `{"bytes", "path"}` dict.
    dataset = Dataset.from_dict({"prompt": ["<image> What colour?"] * 2, "images": [_img(), _img((0, 0, 255))]})
    assert len(check_dataset(dataset)[0]) == 2
    chat = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]] * 2
    assert len(check_dataset(Dataset.from_dict({"prompt": chat, "images": [_img(), _img()]}))[0]) == 2


def test_image_placeholders_in_chat_message_strings_place_the_images():
    # LLaVA-style conversations: `<image>` written in a message's string content marks where the image goes. Left as
    # text, TRL would put the images before it and the model would read a literal `<image>` (or, for processors whose
    # image token is `<image>`, get one image token too many).
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compare <image> with <image>."}]
    row = prepare_row({"prompt": prompt, "images": [_img(), _img((0, 0, 255))]})
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1]["content"] == [{"type": "text", "text": "Compare "}, {"type": "image"},
                                           {"type": "text", "text": " with "}, {"type": "image"},
                                           {"type": "text", "text": "."}]  # fmt: skip
    assert len(check_dataset(Dataset.from_list([{"prompt": prompt, "images": [_img(), _img()]}]))[0]) == 1
    with pytest.raises(ValueError, match=r"row 0: the prompt has 2 image placeholder\(s\).*but the row has 1 image"):
        check_dataset(Dataset.from_list([{"prompt": prompt, "images": [_img()]}]))
    with pytest.raises(ValueError, match=r"row 0: the prompt has image placeholders but the dataset has no `image`"):
        check_dataset(Dataset.from_list([{"prompt": prompt}]))

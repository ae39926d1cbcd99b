import io

import pytest
from datasets import Dataset
from datasets import Image as ImageFeature
from PIL import Image

from vlm_grpo.rows import check_dataset, count_image_placeholders, prepare_row


def _png(size=(20, 10), color=(0, 128, 255)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_prepare_row_normalises_fits_and_wraps_string_prompts():
    rgba = Image.new("RGBA", (200, 100), (255, 0, 0, 0))  # fully transparent -> white after normalising
    row = prepare_row({"prompt": "What colour?", "image": rgba, "answer": "red"}, max_pixels=50 * 25)
    assert row["prompt"] == [{"role": "user", "content": "What colour?"}]
    [image] = row["images"]  # one `image` becomes an `images` list, as for every row TRL sees
    assert image.mode == "RGB" and image.width * image.height <= 50 * 25 and image.getpixel((0, 0)) == (255, 255, 255)
    several = prepare_row({"prompt": "x", "images": [_png(), {"bytes": _png(), "path": None}]}, min_pixels=400 * 200)
    assert [im.size for im in several["images"]] == [(400, 200)] * 2
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


def test_every_row_unreadable_is_an_error():
    dataset = Dataset.from_list([{"prompt": "q", "image": {"bytes": b"nope", "path": None}}])
    with pytest.raises(ValueError, match="every row has an unreadable image"):
        check_dataset(dataset)


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

"""`vlm_grpo.data.image_columns`: your data's image column found by what it holds, under any name, in every format
the loader reads (paths, URLs, bytes, lists); several, or one named like images that holds none, refused naming
`--image_column`."""

import functools
import http.server
import io
import json
import threading

import pytest
from datasets import Dataset
from PIL import Image

from vlm_grpo.data.load import DatasetError, load_dataset_rows
from vlm_grpo.data.rows import check_dataset
from vlm_grpo.media.columns import holds_images, looks_like_image


def _png(i: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_cell_is_an_image_by_what_it_holds_not_by_its_column_name():
    assert looks_like_image("img/000.jpg") and looks_like_image("https://x.org/a/cat.PNG?size=2")
    assert looks_like_image(_png(1)) and looks_like_image({"bytes": None, "path": "a.png"})
    assert looks_like_image(Image.new("RGB", (2, 2)))
    assert not looks_like_image("What shape is it?") and not looks_like_image(b"plain bytes")
    assert not looks_like_image("clip.mp4") and not looks_like_image(3)
    # A column: every value that is there an image (or a list of them), at least one.
    assert holds_images([None, "a.jpg", ["b.png", "c.webp"]]) and not holds_images([None, []])
    assert not holds_images(["a.jpg", "circle"])


def _rows_file(tmp_path, suffix: str, column: str, values: list) -> str:
    rows = {"question": ["What colour?"] * len(values), column: values, "answer": ["red", "green"] * (len(values) // 2)}
    path = str(tmp_path / f"train{suffix}")
    if suffix == ".parquet":
        Dataset.from_dict(rows).to_parquet(path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps({k: v[i] for k, v in rows.items()}) + "\n" for i in range(len(values)))
    return path


@pytest.mark.parametrize("suffix, column, many", [(".jsonl", "path", True), (".parquet", "src", False)])
def test_paths_lists_and_bytes_are_found_under_any_column_name(tmp_path, suffix, column, many):
    for i in range(4):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    values = [[f"{i}.png"] for i in range(4)] if many else [_png(i) for i in range(4)]
    loaded = load_dataset_rows(_rows_file(tmp_path, suffix, column, values), prompt_column="question")
    assert loaded.image_found_by_content and loaded.columns["image"] == column
    key = "images" if many else "image"
    image = loaded.train[0][key][0] if many else loaded.train[0][key]
    assert image.size == (16, 16)
    assert [b["type"] for b in loaded.train[0]["prompt"][0]["content"]] == ["image", "text"]


def test_image_urls_are_found_and_fetched_once_when_loaded(tmp_path):
    (tmp_path / "www").mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (0, 90 * i, 0)).save(tmp_path / "www" / f"{i}.png")
    handler = functools.partial(_QuietHandler, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/0.png", f"{base}/1.png", f"{base}/0.png", f"{base}/gone.png"]
        loaded = load_dataset_rows(_rows_file(tmp_path, ".jsonl", "url", urls), prompt_column="question")
    finally:
        server.shutdown()
    assert loaded.columns["image"] == "url" and len(loaded.train) == 3  # the missing URL's row skipped
    assert loaded.train[1]["image"].getpixel((0, 0)) == (0, 90, 0)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output is not the place for an access log
        pass


def test_a_python_dataset_with_image_paths_under_another_name_is_refused_not_trained_text_only():
    dataset = Dataset.from_dict({"prompt": ["What colour?"] * 2, "file": ["a.jpg", "b.jpg"], "answer": ["red"] * 2})
    with pytest.raises(ValueError, match=r"column `file` looks like it holds images.*rename_column\('file', 'image'\)"):
        check_dataset(dataset)


def test_a_text_only_dataset_has_no_image_column_and_a_misnamed_one_is_refused(tmp_path):
    loaded = load_dataset_rows(_rows_file(tmp_path, ".jsonl", "note", ["a", "b"]), prompt_column="question")
    assert "image" not in loaded.columns and not loaded.image_found_by_content
    with pytest.raises(DatasetError, match="column `img` is named like an image column .* --image_column img"):
        load_dataset_rows(_rows_file(tmp_path, ".jsonl", "img", ["a", "b"]), prompt_column="question")


def test_a_second_image_column_beside_image_is_named_as_not_shown(tmp_path, caplog):
    """`image` is the model's; another column of images reaches only the rewards, and the log says so."""
    for i in range(2):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": "Same?", "image": f"{i}.png", "reference": f"{1 - i}.png",
                                        "answer": "no"}) + "\n" for i in range(2)))  # fmt: skip
    with caplog.at_level("WARNING"):
        loaded = load_dataset_rows(str(path), prompt_column="question")
    assert loaded.columns["image"] == "image" and not loaded.image_found_by_content
    assert "column(s) `reference` also hold images; the model is shown only `image`'s" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # the model's column named: `image` beside it is the one not shown
        load_dataset_rows(str(path), prompt_column="question", image_column="reference")
    assert "column(s) `image` also hold images; the model is shown only `reference`'s" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_dataset_rows(_rows_file(tmp_path, ".jsonl", "image", ["0.png", "1.png"]), prompt_column="question")
    assert "also hold images" not in caplog.text

"""vlm_grpo.data.load: own datasets on disk -> GRPO rows (the end-to-end runs per format are in test_cli.py)."""

import json
import re

import pytest
from PIL import Image

from vlm_grpo.data.load import DatasetError, load_grpo_dataset, load_split, to_grpo_rows
from vlm_grpo.data.rows import check_dataset


def _jsonl(tmp_path, rows):
    (tmp_path / "img").mkdir(exist_ok=True)
    for i in range(3):
        Image.new("RGB", (16, 16), (80 * i, 0, 0)).save(tmp_path / "img" / f"{i}.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_easyr1_layout_becomes_chat_rows_with_images_where_the_placeholder_is(tmp_path):
    rows = [{"problem": f"Look: <image> How many? {i}", "answer": str(i), "images": [f"img/{i}.png"]} for i in range(3)]
    train, test = load_grpo_dataset(_jsonl(tmp_path, rows), system_prompt="Be brief.",
                                    prompt_template="{prompt} Answer in <answer></answer>.")  # fmt: skip
    # `problem` stays beside `prompt`, as written: rewards may read a column by your name for it.
    assert test is None and sorted(train.column_names) == ["answer", "images", "problem", "prompt"]
    assert train[1]["problem"] == "Look: <image> How many? 1"
    row = train[1]
    assert row["prompt"][0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert row["prompt"][1]["content"] == [
        {"type": "text", "text": "Look: "},
        {"type": "image", "text": None},
        {"type": "text", "text": " How many? 1 Answer in <answer></answer>."},
    ]  # fmt: skip  (the text around a placeholder as written: vlm_grpo.data.prompts, EasyR1's split)
    assert row["images"][0].size == (16, 16) and row["answer"] == "1"
    check_dataset(train)  # what the trainer accepts


def test_column_mapping_and_held_out_count(tmp_path):
    rows = [{"q": "Which colour?", "pic": f"img/{i}.png", "gold": "red", "answer": "unused"} for i in range(3)]
    train, test = load_grpo_dataset(_jsonl(tmp_path, rows), test_size=1, prompt_column="q", image_column="pic",
                                    answer_column="gold")  # fmt: skip
    assert (len(train), len(test)) == (2, 1)
    # Your names stay beside the mapped ones (rewards read `gold` or `answer`); the unmapped `answer` gave way.
    assert sorted(train.column_names) == ["answer", "gold", "image", "prompt", "q"] and train[0]["answer"] == "red"
    assert train[0]["gold"] == "red" and train[0]["q"] == "Which colour?"
    assert train[0]["prompt"][0]["content"][0] == {"type": "image", "text": None}  # images go before the question


@pytest.mark.parametrize(
    "rows, kwargs, message",
    [
        ([{"problem": "<image><image> Two?", "answer": "1", "images": ["img/0.png"]}], {}, "2 <image> placeholder"),
        ([{"problem": "Q", "answer": "1", "images": ["img/missing.png"]}], {}, "not found"),
        ([{"text": "Q", "answer": "1"}], {}, "no prompt column"),
        ([{"problem": "Q", "answer": "1"}], {"prompt_column": "question"}, "--prompt_column 'question'"),
        ([{"problem": "Q", "answer": "1"}], {"prompt_template": "no slot"}, "{prompt}"),
    ],
)
def test_bad_datasets_name_the_fix(tmp_path, rows, kwargs, message):
    with pytest.raises(DatasetError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_grpo_dataset(_jsonl(tmp_path, rows), **kwargs)


def test_missing_paths_and_splits_are_errors_not_hub_lookups(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_split(str(tmp_path / "nope.jsonl"))
    path = _jsonl(tmp_path, [{"prompt": "Q", "answer": "1"}])
    with pytest.raises(DatasetError, match="one split"):
        load_split(path, "test")


def test_chat_prompts_get_the_system_prompt_once():
    from datasets import Dataset

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi?"}]], "answer": ["1"]})
    out = to_grpo_rows(data, system_prompt="Be brief.")
    assert out[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("train.jsonl", '{"prompt": "Q", "answer": "1"}\n\n{"prompt": "Q", "answer": }\n', "line 3: not valid JSON"),
        ("train.jsonl", '{"prompt": "Q"}\n["Q", "1"]\n', "line 2: a row must be a JSON object"),
        ("train.json", '[{"prompt": "Q", "answer": "1"},\n {"prompt": "Q", "answer"}]\n', "line 2: not valid JSON"),
        ("train.jsonl", "", "is empty (0 bytes)"),
        ("train.jsonl", "\n \n", "has no rows"),
        ("train.json", "[]", "has no rows"),
        ("train.csv", "prompt,answer\n", "has no rows"),
    ],
)
def test_malformed_and_empty_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match="^" + re.escape(f"{path} {message}")):
        load_grpo_dataset(str(path))


def test_rows_with_missing_or_corrupt_images_are_skipped_by_their_line_before_the_split(tmp_path, caplog):
    _jsonl(tmp_path, [])  # the images img/0..2.png
    (tmp_path / "img" / "bad.png").write_bytes(b"not a png")
    csv = tmp_path / "train.csv"
    # A quoted question over two lines: the next row starts a line later than its index says.
    csv.write_text('prompt,image,answer\n"Which\ncolour?",img/0.png,red\nQ,img/gone.png,red\n\nQ,img/bad.png,red\n'
                   "Q,img/1.png,red\nQ,img/2.png,red\n")  # fmt: skip
    with caplog.at_level("WARNING"):
        train, test = load_grpo_dataset(str(csv), test_size=1, stop_hint="--no_skip_bad_rows")
    assert len(train) + len(test) == 3
    assert f"{csv}: skipped 2 of 5 rows with missing or unreadable images (--no_skip_bad_rows" in caplog.text
    assert "line 4, image 0: image file not found" in caplog.text and "line 6, image 0: image file" in caplog.text
    with pytest.raises(DatasetError, match="line 4, image 0: image file not found"):
        load_grpo_dataset(str(csv), skip_bad_rows=False)
    # Without decoding every image, a missing file is still found; the corrupt one is left to the trainer's check.
    assert len(load_grpo_dataset(str(csv), check_images=False)[0]) == 4


def test_a_csv_cell_holding_a_json_list_of_paths_is_that_many_images(tmp_path):
    """A CSV has no list type: a cell `["img/0.png", "img/1.png"]` was read as one path and its row skipped as a
    missing file."""
    _jsonl(tmp_path, [])
    csv = tmp_path / "train.csv"
    csv.write_text('prompt,images,answer\nCompare <image> and <image>.,"[""img/0.png"", ""img/1.png""]",red\n'
                   "Look: <image>,img/2.png,blue\nNo image here.,[],green\n")  # fmt: skip
    train, _ = load_grpo_dataset(str(csv))
    assert len(train) == 3 and train[2]["images"] == []  # `[]`: no image, not a file named "[]"
    first, second = train[0]["images"], train[1]["images"]
    assert [im.getpixel((0, 0)) for im in first] == [(0, 0, 0), (80, 0, 0)]
    assert [im.getpixel((0, 0)) for im in second] == [(160, 0, 0)]


# ----- clips: JSONL with paths, Parquet, video folders -----


def _frames_folder(folder, n=4):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(folder / f"frame_{i}.png")
    return folder


def test_jsonl_clip_paths_are_resolved_and_checked(tmp_path):
    from conftest import write_video

    write_video(tmp_path / "a.mp4")
    _frames_folder(tmp_path / "b")
    rows = [
        {"problem": "<video> Which way?", "video": "a.mp4", "answer": "left"},  # a video file
        {"problem": "Which way?", "video": "b", "answer": "right"},  # a folder of frames
        {"problem": "Which way?", "video": None, "answer": "none"},  # a row without a clip
    ]
    train, _ = load_grpo_dataset(_jsonl(tmp_path, rows))
    assert sorted(train.column_names) == ["answer", "problem", "prompt", "video"]
    assert train[0]["video"] == str(tmp_path / "a.mp4") and train[1]["video"] == str(tmp_path / "b")
    assert [b["type"] for b in train[0]["prompt"][0]["content"]] == ["video", "text"]
    assert [b["type"] for b in train[1]["prompt"][0]["content"]] == ["video", "text"]  # before the question
    assert check_dataset(train)[1].indices == []  # the trainer opens every clip: all readable
    # A missing clip is a bad row like a missing image (skipped; here the only row, so refused).
    with pytest.raises(DatasetError, match="1 of 1 rows have missing or unreadable images or clips"):
        load_grpo_dataset(_jsonl(tmp_path, [{"problem": "?", "video": "gone.mp4", "answer": "x"}]))
    with pytest.raises(DatasetError, match="2 <video> placeholder"):
        load_grpo_dataset(_jsonl(tmp_path, [{"problem": "<video><video>", "video": "a.mp4", "answer": "x"}]))


def test_a_named_clip_column_of_frame_paths_is_one_clip_and_of_videos_several(tmp_path):
    from conftest import write_video

    _frames_folder(tmp_path / "f")
    write_video(tmp_path / "a.mp4")
    rows = [{"q": "Which way?", "frames": [f"f/frame_{i}.png" for i in range(4)], "clips": ["a.mp4", "a.mp4"],
             "answer": "left"}]  # fmt: skip
    one, _ = load_grpo_dataset(_jsonl(tmp_path, rows), prompt_column="q", video_column="frames")
    assert "video" in one.column_names and len(one[0]["video"]) == 4
    several, _ = load_grpo_dataset(_jsonl(tmp_path, rows), prompt_column="q", video_column="clips")
    assert "videos" in several.column_names
    assert [b["type"] for b in several[0]["prompt"][0]["content"]] == ["video", "video", "text"]


def test_parquet_with_encoded_clips_and_a_video_folder_with_splits(tmp_path):
    from conftest import write_video
    from datasets import Dataset

    path = write_video(tmp_path / "a.mp4")
    with open(path, "rb") as f:
        data = f.read()
    Dataset.from_list([{"question": "Which way?", "video": data, "answer": "left"}]).to_parquet(tmp_path / "d.parquet")
    train, _ = load_grpo_dataset(str(tmp_path / "d.parquet"))
    assert train[0]["video"]["bytes"] == data and check_dataset(train)[1].indices == []

    folder = tmp_path / "clips"
    for split in ("train", "test"):
        _frames_folder(folder / split / "c0")
        write_video(folder / split / "c1.mp4")
        (folder / split / "metadata.jsonl").write_text(
            json.dumps({"prompt": "Which way?", "video": "c0", "answer": "left"}) + "\n"
            + json.dumps({"prompt": "Which way?", "video": "c1.mp4", "answer": "right"}) + "\n"
        )  # fmt: skip
    train, test = load_grpo_dataset(str(folder), eval_split="test")
    assert (len(train), len(test)) == (2, 2) and test[1]["video"] == str(folder / "test" / "c1.mp4")
    with pytest.raises(DatasetError, match="no validation/ folder"):
        load_grpo_dataset(str(folder / "train"), eval_split="validation")


def test_the_training_split_as_the_held_out_split_is_refused(tmp_path):
    # `--eval_split train` on a file (one split, train) or a Hub dataset measured accuracy on the rows trained on.
    path = _jsonl(tmp_path, [{"prompt": f"q{i}", "answer": "a"} for i in range(4)])
    with pytest.raises(DatasetError, match=r"--eval_split train is the split trained on.*--test_size"):
        load_grpo_dataset(path, eval_split="train")

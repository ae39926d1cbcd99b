"""vlm_grpo.data.load: own datasets on disk -> GRPO rows (the end-to-end runs per format are in test_cli.py)."""

import json
import re

import pytest
from PIL import Image

from vlm_grpo.data.load import DatasetError, load_grpo_dataset, load_split, to_grpo_rows
from vlm_grpo.rows import check_dataset


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
    assert test is None and sorted(train.column_names) == ["answer", "images", "prompt"]
    row = train[1]
    assert row["prompt"][0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert row["prompt"][1]["content"] == [
        {"type": "text", "text": "Look: "},
        {"type": "image", "text": None},
        {"type": "text", "text": " How many? 1 Answer in <answer></answer>."},
    ]  # fmt: skip  (the text around a placeholder as written: vlm_grpo.prompts, EasyR1's split)
    assert row["images"][0].size == (16, 16) and row["answer"] == "1"
    check_dataset(train)  # what the trainer accepts


def test_column_mapping_and_held_out_count(tmp_path):
    rows = [{"q": "Which colour?", "pic": f"img/{i}.png", "gold": "red", "answer": "unused"} for i in range(3)]
    train, test = load_grpo_dataset(_jsonl(tmp_path, rows), test_size=1, prompt_column="q", image_column="pic",
                                    answer_column="gold")  # fmt: skip
    assert (len(train), len(test)) == (2, 1)
    assert sorted(train.column_names) == ["answer", "image", "prompt"] and train[0]["answer"] == "red"
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

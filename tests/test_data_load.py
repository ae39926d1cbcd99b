"""vlm_grpo.data.load: own datasets on disk -> GRPO rows (the end-to-end runs per format are in test_cli.py)."""

import json

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

"""CompletionTable: images beside completions, as HTML with inline thumbnails and as plain text."""

import base64
import io

import pytest
from PIL import Image

from vlm_grpo.data import make_visual_reasoning_dataset
from vlm_grpo.training.display import CompletionTable


def _table(thumbnail: int = 32) -> CompletionTable:
    rows = make_visual_reasoning_dataset("color", 2, seed=0, split="test")
    before = [
        {"completion": "<answer>blue & red</answer>", "choice_accuracy": 0.0},
        {"completion": "x", "choice_accuracy": None},
    ]
    after = [
        {"completion": rows[0]["answer"], "choice_accuracy": 1.0},
        {"completion": rows[1]["answer"], "choice_accuracy": 1.0},
    ]
    return CompletionTable(rows, {"before": before, "after": after}, thumbnail=thumbnail)


def test_html_has_one_thumbnail_per_row_and_escapes_completions():
    html = _table()._repr_html_()
    assert html.count("<tr>") == 3 and "<th>before</th>" in html and "<th>after</th>" in html
    uris = [part.split('"')[0] for part in html.split('src="data:image/png;base64,')[1:]]
    assert len(uris) == 2
    thumbnail = Image.open(io.BytesIO(base64.b64decode(uris[0])))
    assert thumbnail.format == "PNG" and thumbnail.size == (32, 32)  # 56x56 shrunk to fit 32
    # A completion is shown as text, never as markup: tags a model writes must not vanish into the page.
    assert "&lt;answer&gt;blue &amp; red&lt;/answer&gt;" in html and "<answer>" not in html
    assert "choice_accuracy 0.00" in html and "choice_accuracy 1.00" in html


def test_text_version_lists_each_row_with_its_completions():
    rows = make_visual_reasoning_dataset("color", 2, seed=0, split="test")
    text = str(_table())
    lines = text.splitlines()
    assert len(lines) == 6
    assert (
        lines[0] == f"[0] image 56x56  What colour is the shape? Answer with one word.  (answer: {rows[0]['answer']})"
    )
    assert lines[1] == "    before  '<answer>blue & red</answer>'  choice_accuracy 0.00"
    assert lines[4] == "    before  'x'"  # an unscorable row shows no score rather than a made-up one


def test_a_column_of_the_wrong_length_is_refused():
    rows = make_visual_reasoning_dataset("color", 2, seed=0, split="test")
    with pytest.raises(ValueError, match="1 samples for 2 rows"):
        CompletionTable(rows, {"before": [{"completion": "red"}]})

"""`CompletionTable`: sample completions beside their images, e.g. before and after training.

In Jupyter it renders as an HTML table with inline thumbnails (`_repr_html_`); `str(table)` is a plain-text
version for terminals and logs.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

from ..media.columns import row_images
from ..media.images import load_image, normalize_image
from .callbacks import _prompt_text

__all__ = ["CompletionTable"]


def _thumbnail_uri(image: Any, size: int) -> str:
    picture = normalize_image(load_image(image))
    picture.thumbnail((size, size))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _score_text(sample: Mapping[str, Any]) -> str:
    scores = [f"{name} {value:.2f}" for name, value in sample.items() if name != "completion" and value is not None]
    return ", ".join(scores)


class CompletionTable:
    """Rows of `dataset` (image, question, gold answer) with one or more columns of completions.

    Args:
        dataset: rows with `prompt`, `image` or `images`, and optionally `answer`.
        columns: column title -> one sample per row, as returned by `vlm_grpo.training.evaluation.sample_completions`
            (`{"completion": text, "<reward name>": score, ...}`), e.g. `{"before": ..., "after": ...}`.
        thumbnail: longest side of the inline images, in pixels.
    """

    def __init__(self, dataset: Any, columns: Mapping[str, Sequence[Mapping[str, Any]]], thumbnail: int = 96) -> None:
        self.rows = [dict(row) for row in dataset]
        self.columns = {title: list(samples) for title, samples in columns.items()}
        for title, samples in self.columns.items():
            if len(samples) != len(self.rows):
                raise ValueError(f"column {title!r} has {len(samples)} samples for {len(self.rows)} rows; "
                                 "give one sample per row (sample_completions on the same rows).")  # fmt: skip
        self.thumbnail = thumbnail

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(t)}</th>" for t in ("image", "question", "answer", *self.columns))
        body = []
        for i, row in enumerate(self.rows):
            images = "".join(f'<img src="{_thumbnail_uri(image, self.thumbnail)}"/>' for image in row_images(row))
            cells = [images, html.escape(_prompt_text(row["prompt"])), html.escape(str(row.get("answer", "")))]
            for samples in self.columns.values():
                sample = samples[i]
                cells.append(f"<code>{html.escape(repr(sample['completion']))}</code><br/>"
                             f"<small>{html.escape(_score_text(sample))}</small>")  # fmt: skip
            body.append("<tr>" + "".join(f'<td style="text-align:left">{c}</td>' for c in cells) + "</tr>")
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    def __str__(self) -> str:
        lines = []
        width = max((len(t) for t in self.columns), default=0)
        for i, row in enumerate(self.rows):
            sizes = " ".join("x".join(map(str, load_image(image).size)) for image in row_images(row))
            answer = f"  (answer: {row['answer']})" if row.get("answer") is not None else ""
            lines.append(f"[{i}] image {sizes or '-'}  {_prompt_text(row['prompt'])}{answer}")
            for title, samples in self.columns.items():
                sample = samples[i]
                lines.append(f"    {title:<{width}}  {sample['completion']!r}  {_score_text(sample)}".rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

"""Reading a dataset source as `datasets` rows: a Hub id, a `save_to_disk` directory, a JSONL / JSON / CSV / Parquet
file, an image folder or a video folder; its media paths resolved against the file's directory, and each row's line
in a JSON Lines or CSV file found, so messages name the line a user can open (`datasets` names byte positions)."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, NamedTuple

from ..media.columns import IMAGE_COLUMNS, VIDEO_COLUMNS, is_image_url
from ..media.images import fetch_image_bytes
from .image_columns import find_image_column

__all__ = ["FILE_BUILDERS", "DatasetError", "Source", "load_source", "load_split"]

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_METADATA = ("metadata.jsonl", "metadata.csv")


class DatasetError(ValueError):
    """A dataset that cannot be used as given; the message names the fix."""


class Source(NamedTuple):
    """One split as read: the rows, what messages call each row (its file line, or None: `row i`), the column holding
    its images (None: none) and whether that column was found by what it holds rather than named."""

    dataset: Any
    row_names: list[str] | None
    image_column: str | None
    found_by_content: bool = False


def _looks_local(source: str) -> bool:
    # A Hub id is `name` or `owner/name`; anything else that does not exist is a mistyped path.
    return (
        os.path.isabs(source) or source.startswith((".", "~")) or source.count("/") > 1
        or os.path.splitext(source)[1].lower() in FILE_BUILDERS
    )  # fmt: skip


def _pick_split(splits: Any, split: str, source: str) -> Any:
    if split not in splits:
        raise DatasetError(f"{source} has no split {split!r}; its splits: {', '.join(splits)}.")
    return splits[split]


def load_split(
    source: str,
    split: str = "train",
    name: str | None = None,
    image_column: str | None = None,
    video_column: str | None = None,
) -> Any:
    """One split of `source` as a `datasets.Dataset`, image columns (`image`, `images`, `image_column`) holding paths
    or bytes cast to `datasets.Image`, clip columns (`video`, `videos`, `video_column`) holding paths resolved to
    absolute ones.

    A single file has one split, `train`. Raises `DatasetError` for a missing path or split, an empty file, or a
    JSON Lines line that is not a JSON object (naming the line).
    """
    return load_source(source, split, name, image_column, video_column)[0]


def load_source(
    source: str, split: str, name: str | None, image_column: str | None, video_column: str | None
) -> Source:
    """`load_split` as a `Source`: also what messages call each row (its line for JSON Lines and CSV files, else None)
    and the image column: `image_column`, else `image` / `images`, else the one column whose values are images
    (`find_image_column`; several are refused, naming `--image_column`)."""
    import datasets

    path = os.path.expanduser(source)
    if os.path.isdir(path) and (metadata := _video_metadata(path, split, video_column)) is not None:
        dataset = datasets.load_dataset(FILE_BUILDERS[os.path.splitext(metadata)[1]], data_files=metadata,
                                        split="train")  # fmt: skip
        return _media_as_features(dataset, os.path.dirname(metadata), image_column, video_column, None)
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(path)
            dataset = _pick_split(loaded, split, source) if isinstance(loaded, datasets.DatasetDict) else loaded
            if not isinstance(loaded, datasets.DatasetDict) and split != "train":
                raise DatasetError(f"{source} holds one split (a saved Dataset); use --test_size for a held-out part.")
        else:  # an image folder: metadata.jsonl / .csv next to the images, optionally train/ and test/ subfolders
            dataset = _pick_split(datasets.load_dataset("imagefolder", data_dir=path), split, source)
        return _media_as_features(dataset, path, image_column, video_column, None)
    if os.path.isfile(path):
        builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise DatasetError(f"{source}: unknown file type; use one of {', '.join(FILE_BUILDERS)} or a directory.")
        if split != "train":
            raise DatasetError(
                f"{source} is one file with one split; hold rows out with --test_size instead of {split!r}."
            )
        lines = _row_lines(path, source, builder)
        try:
            dataset = datasets.load_dataset(builder, data_files=path, split="train")
        except datasets.exceptions.DatasetGenerationError as error:  # the reader's own message is on its cause
            raise DatasetError(f"{source}: cannot read it as {builder} ({error.__cause__ or error}).") from error
        if len(dataset) == 0:
            raise DatasetError(f"{source} has no rows: nothing to train on.")
        names = [f"line {n}" for n in lines] if lines is not None and len(lines) == len(dataset) else None
        return _media_as_features(dataset, os.path.dirname(os.path.abspath(path)), image_column, video_column, names)
    if _looks_local(source):
        raise DatasetError(f"no such file or directory: {source}")
    dataset = datasets.load_dataset(source, name, split=split)  # a Hub id: its image columns are datasets.Image
    found = _image_column(dataset, image_column, video_column)
    return Source(dataset, None, found, found not in (image_column, *IMAGE_COLUMNS))


def _row_lines(path: str, source: str, builder: str) -> list[int] | None:
    """The line each row of a JSON Lines or CSV file starts on (None for other files), checking on the way that the
    file has rows and that each JSON line is an object: `datasets` would report a bad line by its byte position, and an
    empty file as a bare `StopIteration`."""
    if os.path.getsize(path) == 0:
        raise DatasetError(f"{source} is empty (0 bytes): nothing to train on.")
    try:
        if builder == "json":
            lines = _json_lines(path, source)
        elif builder == "csv":
            lines = _csv_lines(path)
        else:
            return None
    except UnicodeDecodeError as error:
        raise DatasetError(f"{source} is not UTF-8 text ({error.reason} at byte {error.start}).") from error
    if lines is not None and not lines:
        raise DatasetError(f"{source} has no rows: nothing to train on.")
    return lines


def _json_lines(path: str, source: str) -> list[int] | None:
    """Line numbers of a JSON Lines file's rows, or None for one JSON document (an array of rows, or columns)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        first = text.strip().splitlines()[0] if text.strip() else ""
        if first.startswith("[") or (first and not _is_json(first)):  # one document, spread over lines
            raise DatasetError(f"{source} line {error.lineno}: not valid JSON ({error.msg}).") from error
    else:
        if not isinstance(document, dict) or len(text.strip().splitlines()) > 1:
            return None if document else []
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(
                f"{source} line {number}: not valid JSON ({error.msg}, column {error.colno}); fix or remove that line."
            ) from error
        if not isinstance(row, dict):
            raise DatasetError(
                f"{source} line {number}: a row must be a JSON object {{...}}, got {type(row).__name__}."
            )
        lines.append(number)
    return lines


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _csv_lines(path: str) -> list[int]:
    """The line each CSV row starts on, after the header, blank lines skipped (as `datasets`' pandas reader does)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        lines, end = [], 0
        for record in reader:
            start, end = end + 1, reader.line_num
            if record:
                lines.append(start)
    return lines[1:]  # the first record is the header


def _video_metadata(directory: str, split: str, video_column: str | None) -> str | None:
    """The metadata file of a video folder for `split` (`<dir>/<split>/metadata.jsonl`, else `<dir>/metadata.jsonl`
    for `train`), or None when `directory` is not a video folder (no metadata file, or one without a clip column)."""
    for folder in (os.path.join(directory, split), directory):
        for name in _METADATA:
            file = os.path.join(folder, name)
            if os.path.isfile(file) and _has_clip_column(file, video_column):
                if folder == directory and split != "train":
                    raise DatasetError(f"{directory} has no {split}/ folder: its rows are one split, train.")
                return file
    return None


def _has_clip_column(file: str, video_column: str | None) -> bool:
    with open(file, encoding="utf-8") as f:
        first = f.readline()
    try:
        columns = json.loads(first) if file.endswith(".jsonl") else next(csv.reader([first]))
    except (ValueError, StopIteration):
        return False
    return any(c in columns for c in (video_column, *VIDEO_COLUMNS) if c)


def _media_as_features(
    dataset: Any, base_dir: str, image_column: str | None, video_column: str | None, row_names: list[str] | None
) -> Source:
    """Cast image columns holding paths (relative to `base_dir`), URLs (fetched) or bytes to `datasets.Image`, and
    resolve clip columns' paths against `base_dir` (a missing file is the row check's to skip, as for images). The
    image column is `image_column`, else `image` / `images`, else the one found by its values."""
    from datasets import List, Sequence, Value

    found = _image_column(dataset, image_column, video_column)
    for column in dict.fromkeys(c for c in (found, *IMAGE_COLUMNS) if c in dataset.column_names):
        feature = dataset.features[column]
        inner = feature.feature if isinstance(feature, (List, Sequence)) else feature
        if isinstance(inner, Value) and inner.dtype in ("string", "large_string", "binary", "large_binary"):
            as_list = inner is not feature or _holds_path_lists(dataset, column, inner.dtype)
            dataset = _resolve_images(dataset, column, as_list=as_list, base_dir=base_dir)
    for column in dict.fromkeys(c for c in (video_column, *VIDEO_COLUMNS) if c in dataset.column_names):
        feature = dataset.features[column]
        inner = feature.feature if isinstance(feature, (List, Sequence)) else feature
        if isinstance(inner, Value) and inner.dtype in ("string", "large_string"):
            dataset = _resolve_clips(dataset, column, base_dir)
        elif isinstance(inner, Value) and inner.dtype in ("binary", "large_binary"):  # encoded video files
            dataset = _bytes_clips(dataset, column)
    return Source(dataset, row_names, found, found not in (image_column, *IMAGE_COLUMNS))


def _image_column(dataset: Any, image_column: str | None, video_column: str | None) -> str | None:
    """`find_image_column`, its refusal a `DatasetError`."""
    try:
        return find_image_column(dataset, image_column, video_column)
    except ValueError as error:
        raise DatasetError(str(error)) from None


def _bytes_clips(dataset: Any, column: str) -> Any:
    """Encoded video files in `column` as `{"bytes": ..., "path": None}` dicts, the form `vlm_grpo.media.clips` reads."""

    def wrap(value: Any) -> Any:
        if isinstance(value, list):
            return [wrap(v) for v in value]
        return None if value is None else {"bytes": value, "path": None}

    return dataset.map(lambda batch: {column: [wrap(v) for v in batch[column]]}, batched=True,
                       desc=f"reading `{column}`")  # fmt: skip


def _resolve_clips(dataset: Any, column: str, base_dir: str) -> Any:
    """Clip paths (files, frame folders, frame files) in `column` made absolute against `base_dir`."""
    # A module-level function with its arguments in `fn_kwargs`: datasets can hash it (a closure made it warn).
    return dataset.map(_absolute_clips, batched=True, fn_kwargs={"column": column, "base_dir": base_dir},
                       desc=f"resolving `{column}`")  # fmt: skip


def _absolute_clips(batch: dict[str, list], column: str, base_dir: str) -> dict[str, list]:
    return {column: [_absolute_clip(v, base_dir) for v in batch[column]]}


def _absolute_clip(value: Any, base_dir: str) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_absolute_clip(v, base_dir) for v in value]
    # A missing file is kept as its path: `drop_unreadable_rows` skips its row like one with a corrupt clip.
    return os.path.join(base_dir, os.path.expanduser(value))


def _path_list(value: Any) -> list[str] | None:
    """A CSV cell's JSON list of paths (`["img/0.png", "img/1.png"]`: a CSV has no list type) as that list, else None."""
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, list) and all(isinstance(v, str) for v in parsed) else None


def _holds_path_lists(dataset: Any, column: str, dtype: str) -> bool:
    """Whether a string image column holds JSON lists of paths (each such cell was read as one missing file): the
    cells starting with "[" found in Arrow, only those parsed."""
    import pyarrow.compute as pc

    if dtype not in ("string", "large_string"):
        return False
    cells = dataset.data.column(column)
    bracketed = cells.filter(pc.fill_null(pc.starts_with(pc.utf8_ltrim_whitespace(cells), "["), False))
    return any(_path_list(v) is not None for v in bracketed.to_pylist())


def _resolve_images(dataset: Any, column: str, as_list: bool, base_dir: str) -> Any:
    from datasets import Features, Image, List

    def fix(value: Any) -> Any:
        if value is None or isinstance(value, bytes):
            return None if value is None else {"bytes": value, "path": None}
        if is_image_url(value):  # fetched once, here: `datasets` would need aiohttp to read it at every step
            return {"bytes": fetch_image_bytes(value), "path": value}
        # A missing file is kept as its path: `drop_unreadable_rows` skips its row like one with a corrupt image.
        return {"bytes": None, "path": os.path.join(base_dir, os.path.expanduser(value))}

    def fix_batch(batch: dict[str, list]) -> dict[str, list]:
        def cells(row: Any) -> list[Any]:  # a list column's row, a JSON list of paths, or one path
            if isinstance(row, list) or row is None:
                return row or []
            listed = _path_list(row)
            return listed if listed is not None else [row]

        return {column: [[fix(v) for v in cells(row)] if as_list else fix(row) for row in batch[column]]}

    features = Features({**dataset.features, column: List(Image()) if as_list else Image()})
    return dataset.map(fix_batch, batched=True, features=features, desc=f"resolving `{column}`")

"""Your own data for GRPO: load a dataset from the Hub, disk, a file or an image folder and map it to GRPO rows.

    train, test = load_grpo_dataset("data/train.jsonl", test_size=0.1)   # image paths relative to the file
    train, test = load_grpo_dataset("hiyouga/geometry3k", eval_split="test")   # EasyR1 layout, no mapping needed

Sources: a Hub id (`datasets.load_dataset`), a directory written by `save_to_disk`, a JSONL / JSON / CSV /
Parquet file whose image column holds paths (relative to the file) or bytes, an image folder with
`metadata.jsonl` (the `imagefolder` builder), or a video folder: `metadata.jsonl` / `.csv` naming each row's clip
(a video file or a folder of frames, relative to the folder; `train/` and `test/` subfolders for splits). Rows come
out as the trainer expects them: `prompt` (chat messages), `image` or `images`, `video` or `videos`, `answer`, other
columns kept (they reach the reward functions).

Clips (`video` / `videos`, or the column `--video_column` names) may be a path to a video file, a path to a folder of
frames, a list of frame paths (one clip), a list of video paths (`videos`: several clips), or bytes of a video file;
paths are resolved against the file's (or folder's) directory, probed with the rows' images (a missing or unreadable
clip skips its row, `vlm_grpo.rows.drop_unreadable_rows`), and decoded only at training time (`vlm_grpo.videos`).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from typing import Any

from ..prompts import (
    IMAGE_COLUMNS,
    IMAGE_PLACEHOLDER,
    VIDEO_COLUMNS,
    VIDEO_PLACEHOLDER,
    apply_template,
    user_content,
    with_system,
)
from ..prompts import image_column as prompt_image_column
from ..prompts import video_column as prompt_video_column

__all__ = ["DatasetError", "load_grpo_dataset", "load_split", "to_grpo_rows"]

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_METADATA = ("metadata.jsonl", "metadata.csv")
# Frame files: a list of these in one `video` cell is one clip's frames (a list of other files: several clips).
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
PROMPT_COLUMNS = ("prompt", "problem", "question", "query")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")


class DatasetError(ValueError):
    """A dataset that cannot be used as given; the message names the fix."""


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
    return _load_split(source, split, name, image_column, video_column)[0]


def _load_split(
    source: str, split: str, name: str | None, image_column: str | None, video_column: str | None
) -> tuple[Any, list[str] | None]:
    """`load_split`, and what messages call each row: its line for JSON Lines and CSV files, else None (`row i`)."""
    import datasets

    path = os.path.expanduser(source)
    if os.path.isdir(path) and (metadata := _video_metadata(path, split, video_column)) is not None:
        dataset = datasets.load_dataset(FILE_BUILDERS[os.path.splitext(metadata)[1]], data_files=metadata,
                                        split="train")  # fmt: skip
        return _media_as_features(dataset, os.path.dirname(metadata), image_column, video_column), None
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(path)
            dataset = _pick_split(loaded, split, source) if isinstance(loaded, datasets.DatasetDict) else loaded
            if not isinstance(loaded, datasets.DatasetDict) and split != "train":
                raise DatasetError(f"{source} holds one split (a saved Dataset); use --test_size for a held-out part.")
        else:  # an image folder: metadata.jsonl / .csv next to the images, optionally train/ and test/ subfolders
            dataset = _pick_split(datasets.load_dataset("imagefolder", data_dir=path), split, source)
        return _media_as_features(dataset, path, image_column, video_column), None
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
        return _media_as_features(dataset, os.path.dirname(os.path.abspath(path)), image_column, video_column), names
    if _looks_local(source):
        raise DatasetError(f"no such file or directory: {source}")
    return datasets.load_dataset(source, name, split=split), None  # a Hub id


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


def _media_as_features(dataset: Any, base_dir: str, image_column: str | None, video_column: str | None) -> Any:
    """Cast image columns holding paths (relative to `base_dir`) or bytes to `datasets.Image`, and resolve clip
    columns' paths against `base_dir` (a missing file is the row check's to skip, as for images)."""
    from datasets import List, Sequence, Value

    for column in [c for c in (image_column, *IMAGE_COLUMNS) if c in dataset.column_names]:
        feature = dataset.features[column]
        inner = feature.feature if isinstance(feature, (List, Sequence)) else feature
        if isinstance(inner, Value) and inner.dtype in ("string", "large_string", "binary", "large_binary"):
            dataset = _resolve_images(dataset, column, as_list=inner is not feature, base_dir=base_dir)
    for column in dict.fromkeys(c for c in (video_column, *VIDEO_COLUMNS) if c in dataset.column_names):
        feature = dataset.features[column]
        inner = feature.feature if isinstance(feature, (List, Sequence)) else feature
        if isinstance(inner, Value) and inner.dtype in ("string", "large_string"):
            dataset = _resolve_clips(dataset, column, base_dir)
        elif isinstance(inner, Value) and inner.dtype in ("binary", "large_binary"):  # encoded video files
            dataset = _bytes_clips(dataset, column)
    return dataset


def _bytes_clips(dataset: Any, column: str) -> Any:
    """Encoded video files in `column` as `{"bytes": ..., "path": None}` dicts, the form `vlm_grpo.videos` reads."""

    def wrap(value: Any) -> Any:
        if isinstance(value, list):
            return [wrap(v) for v in value]
        return None if value is None else {"bytes": value, "path": None}

    return dataset.map(lambda batch: {column: [wrap(v) for v in batch[column]]}, batched=True,
                       desc=f"reading `{column}`")  # fmt: skip


def _resolve_clips(dataset: Any, column: str, base_dir: str) -> Any:
    """Clip paths (files, frame folders, frame files) in `column` made absolute against `base_dir`."""

    def fix(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, list):
            return [fix(v) for v in value]
        # A missing file is kept as its path: `drop_unreadable_rows` skips its row like one with a corrupt clip.
        return os.path.join(base_dir, os.path.expanduser(value))

    return dataset.map(lambda batch: {column: [fix(v) for v in batch[column]]}, batched=True,
                       desc=f"resolving `{column}`")  # fmt: skip


def _resolve_images(dataset: Any, column: str, as_list: bool, base_dir: str) -> Any:
    from datasets import Features, Image, List

    def fix(value: Any) -> Any:
        if value is None or isinstance(value, bytes):
            return None if value is None else {"bytes": value, "path": None}
        # A missing file is kept as its path: `drop_unreadable_rows` skips its row like one with a corrupt image.
        return {"bytes": None, "path": os.path.join(base_dir, os.path.expanduser(value))}

    def fix_batch(batch: dict[str, list]) -> dict[str, list]:
        return {column: [[fix(v) for v in (row or [])] if as_list else fix(row) for row in batch[column]]}

    features = Features({**dataset.features, column: List(Image()) if as_list else Image()})
    return dataset.map(fix_batch, batched=True, features=features, desc=f"resolving `{column}`")


def _find(columns: list[str], given: str | None, candidates: tuple[str, ...], flag: str) -> str | None:
    if given is not None:
        if given not in columns:
            raise DatasetError(f"{flag} {given!r} is not a column of the dataset (columns: {', '.join(columns)}).")
        return given
    return next((c for c in candidates if c in columns), None)


def _messages(
    text: str, n_images: int, system_prompt: str | None, template: str | None, n_videos: int = 0
) -> list[dict[str, Any]]:
    text = apply_template(text, template)
    for placeholder, count, kind in ((IMAGE_PLACEHOLDER, n_images, "image(s)"), (VIDEO_PLACEHOLDER, n_videos,
                                                                               "clip(s)")):  # fmt: skip
        placeholders = text.count(placeholder)
        if placeholders and placeholders != count:
            raise DatasetError(
                f"a prompt has {placeholders} {placeholder} placeholder(s) but its row has {count} {kind}: "
                f"{text[:80]!r}. Make them match."
            )
    content = user_content(text, n_images, n_videos)
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    # Arrow stores a list of blocks as one struct type: image blocks carry the text key too (as None).
    content = [{"type": block["type"], "text": block.get("text")} for block in content]
    return with_system([{"role": "user", "content": content}], system_prompt)


def to_grpo_rows(
    dataset: Any,
    *,
    prompt_column: str | None = None,
    image_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    video_column: str | None = None,
) -> Any:
    """Rename the mapped columns to `prompt`, `image`/`images`, `video`/`videos` and `answer`; string prompts become
    chat messages.

    Unmapped columns default to the usual names (`prompt`/`problem`/`question`, `images`/`image`, `videos`/`video`,
    `answer`/`solution`), so the EasyR1 / geometry3k layout needs no flags. String prompts get
    `prompt_template` (`{prompt}` is replaced by the question) and `system_prompt`; `<image>` / `<video>` in the
    text place the row's images / clips there (else they go before the question).
    """
    from datasets import Image, List, Sequence

    columns = list(dataset.column_names)
    prompt = _find(columns, prompt_column, PROMPT_COLUMNS, "--prompt_column")
    if prompt is None:
        raise DatasetError(f"no prompt column among {', '.join(columns)}; name it with --prompt_column.")
    image = _media_column(columns, image_column, prompt_image_column, "--image_column")
    video = _media_column(columns, video_column, prompt_video_column, "--video_column")
    answer = _find(columns, answer_column, ANSWER_COLUMNS, "--answer_column")
    if prompt_template is not None and "{prompt}" not in prompt_template:
        raise DatasetError("--prompt_template must contain {prompt}, where the question goes.")

    many = image is not None and isinstance(dataset.features[image], (List, Sequence, list))
    clips = _clip_column_name(dataset, video) if video is not None else None
    renames = {prompt: "prompt", answer: "answer", image: "images" if many else "image", video: clips}
    renames = {old: new for old, new in renames.items() if old is not None and old != new}
    # A mapped column replaces any column that already has its target name (and the other image / video column).
    drop = [c for c in columns if c in renames.values() and c not in renames]
    if image is not None:
        drop += [c for c in IMAGE_COLUMNS if c in columns and c != image and c not in drop]
    if video is not None:
        drop += [c for c in VIDEO_COLUMNS if c in columns and c != video and c not in drop]
    dataset = dataset.remove_columns(drop).rename_columns(renames)
    image = renames.get(image, image)

    if isinstance(dataset[0]["prompt"] if len(dataset) else None, str):
        raw = dataset
        if image is not None:  # count images without decoding them
            undecoded = List(Image(decode=False)) if many else Image(decode=False)
            raw = dataset.cast_column(image, undecoded)

        def convert(batch: dict[str, list]) -> dict[str, list]:
            rows = len(batch["prompt"])
            counts = [len(v or []) if many else int(v is not None) for v in batch[image]] if image else [0] * rows
            n_clips = (
                [len(v or []) if clips == "videos" else int(v is not None) for v in batch[clips]]
                if clips
                else [0] * rows
            )
            texts = zip(batch["prompt"], counts, n_clips)
            return {"prompt": [_messages(t, n, system_prompt, prompt_template, k) for t, n, k in texts]}

        dataset = raw.map(convert, batched=True, desc="building chat prompts")
        if image is not None:
            dataset = dataset.cast_column(image, List(Image()) if many else Image())
    elif prompt_template is not None:
        raise DatasetError("--prompt_template applies to string prompts; this dataset's prompts are chat messages.")
    elif system_prompt:
        dataset = dataset.map(lambda row: {"prompt": with_system(row["prompt"], system_prompt)}, desc="system prompt")
    return dataset


def _media_column(
    columns: list[str], given: str | None, default: Callable[[list[str]], str | None], flag: str
) -> str | None:
    """The image (or clip) column: `given` (checked to exist), else the usual one `default` finds (None: none)."""
    if given is None:
        try:
            given = default(columns)
        except ValueError as error:  # both `image` and `images` (or `video` and `videos`)
            raise DatasetError(f"{error} Or name the one to use with {flag}.") from None
    return _find(columns, given, (), flag)


def _clip_column_name(dataset: Any, column: str) -> str:
    """`video` (one clip per row) or `videos` (a list of clips) for a clip column: by its own name when it is one of
    those, else by its values: a list of video files is several clips, a list of frame images one clip."""
    if column in VIDEO_COLUMNS:
        return column
    first = next((v for v in dataset[column] if v is not None), None)
    if isinstance(first, list) and first and isinstance(first[0], str):
        return "video" if first[0].lower().endswith(_FRAME_SUFFIXES) else "videos"
    return "video"


def load_grpo_dataset(
    source: str,
    split: str = "train",
    *,
    name: str | None = None,
    eval_split: str | None = None,
    test_size: float = 0,
    seed: int = 0,
    check_images: bool = True,
    skip_bad_rows: bool = True,
    stop_hint: str = "skip_bad_rows=False",
    **columns: Any,
) -> tuple[Any, Any | None]:
    """`(train, test)` GRPO datasets from `source`: `eval_split`, else `test_size` rows held out (a fraction < 1 or a
    count; 0: no held-out set). `columns` go to `to_grpo_rows` (column mapping, system prompt, template).

    Rows whose images or clips are missing or unreadable are skipped before the split, named by their line in a JSON Lines or
    CSV file (`vlm_grpo.rows.drop_unreadable_rows`: `check_images` decodes every image, else only files' existence
    is checked; `skip_bad_rows=False` raises instead; `stop_hint` is how the skip message says to do that)."""
    media = {"image_column": columns.get("image_column"), "video_column": columns.get("video_column")}
    bad_rows = {"decode": check_images, "skip_bad_rows": skip_bad_rows, "stop_hint": stop_hint}
    train = _checked_split(source, split, name, media, bad_rows)
    test = _checked_split(source, eval_split, name, media, bad_rows) if eval_split else None
    if test is None and test_size:
        size = test_size if 0 < test_size < 1 else int(test_size)
        if not 0 < size < len(train):
            raise DatasetError(f"--test_size {test_size} leaves no training rows ({len(train)} rows in {source}).")
        parts = train.train_test_split(test_size=size, seed=seed)
        train, test = parts["train"], parts["test"]
    train = to_grpo_rows(train, **columns)
    return train, to_grpo_rows(test, **columns) if test is not None else None


def _checked_split(source: str, split: str, name: str | None, media: dict[str, Any], bad_rows: dict[str, Any]) -> Any:
    """`load_split` with the rows whose images or clips are missing or unreadable dropped (logged, named by their
    line)."""
    from ..images import ImageError
    from ..rows import drop_unreadable_rows
    from ..videos import VideoError

    dataset, row_names = _load_split(source, split, name, media["image_column"], media["video_column"])
    present = dataset.column_names
    try:
        column = media["image_column"] or prompt_image_column(present)
        clip_column = media["video_column"] or prompt_video_column(present)
    except ValueError:  # both `image` and `images` (or `video` and `videos`): to_grpo_rows names the fix
        return dataset
    column = column if column in present else None
    clip_column = clip_column if clip_column in present else None
    if column is None and clip_column is None:
        return dataset
    label = source if split == "train" else f"{source} ({split})"
    try:
        return drop_unreadable_rows(dataset, column, label, clip_column=clip_column, row_names=row_names, **bad_rows)[0]
    except (ImageError, VideoError) as error:
        raise DatasetError(str(error)) from error

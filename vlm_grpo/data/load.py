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
clip skips its row, `vlm_grpo.data.rows.drop_unreadable_rows`), and decoded only at training time (`vlm_grpo.media.clips`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..media.columns import IMAGE_COLUMNS, VIDEO_COLUMNS
from ..media.columns import image_column as prompt_image_column
from ..media.columns import video_column as prompt_video_column
from ..rewards.checks import ROW_ORIGIN
from .prompts import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, apply_template, user_content, with_system
from .sources import DatasetError, load_source, load_split

__all__ = ["DatasetError", "DatasetRows", "load_dataset_rows", "load_grpo_dataset", "load_split", "to_grpo_rows"]

# Frame files: a list of these in one `video` cell is one clip's frames (a list of other files: several clips).
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
PROMPT_COLUMNS = ("prompt", "problem", "question", "query")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")


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
    chat messages. The prompt and answer columns also stay under their own names (as your data had them), so rewards
    can read them by those.

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
    # Your own names stay beside the ones the trainer reads: a reward `f(completions, label, **kw)` gets `label`,
    # the question column its text as written.
    aliases = {old: new for old, new in renames.items() if new in ("prompt", "answer")}
    if aliases:
        dataset = dataset.map(_copy_columns, batched=True, fn_kwargs={"aliases": aliases}, desc="keeping your names")

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


def _copy_columns(batch: dict[str, list], aliases: dict[str, str]) -> dict[str, list]:
    # Module level, its arguments in `fn_kwargs`: datasets can hash it for its cache.
    return {old: batch[new] for old, new in aliases.items()}


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


@dataclass
class DatasetRows:
    """What `load_dataset_rows` read: the training and held-out rows, and the columns of yours they came from.

    Attributes:
        train, test: GRPO rows (`test` None without a held-out set).
        columns: for each role (`prompt`, `image`, `video`, `answer`), the column of yours that fills it (roles your
            data has none for are left out).
        image_found_by_content: True when no image column was named (`--image_column`, `image`, `images`) and the
            one holding images was found by its values.
    """

    train: Any
    test: Any | None
    columns: dict[str, str] = field(default_factory=dict)
    image_found_by_content: bool = False


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
    keep_origin: bool = False,
    **columns: Any,
) -> tuple[Any, Any | None]:
    """`(train, test)` GRPO datasets from `source`: `eval_split`, else `test_size` rows held out (a fraction < 1 or a
    count; 0: no held-out set). `columns` go to `to_grpo_rows` (column mapping, system prompt, template); without an
    image column named, the one column whose values are images is used, whatever its name (`find_image_column`).

    Rows whose images or clips are missing or unreadable are skipped before the split, named by their line in a JSON
    Lines or CSV file (`vlm_grpo.data.rows.drop_unreadable_rows`: `check_images` decodes every image, else only files'
    existence is checked; `skip_bad_rows=False` raises instead; `stop_hint` is how the messages say to do that).
    `keep_origin` keeps each row's line of such a file ("data.jsonl line 7") in a `vlm_grpo.rewards.checks.ROW_ORIGIN`
    column, so a reward that fails on a row names its line; reward functions never see that column."""
    loaded = load_dataset_rows(source, split, name=name, eval_split=eval_split, test_size=test_size, seed=seed,
                               check_images=check_images, skip_bad_rows=skip_bad_rows, stop_hint=stop_hint,
                               keep_origin=keep_origin, **columns)  # fmt: skip
    return loaded.train, loaded.test


def load_dataset_rows(
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
    keep_origin: bool = False,
    **columns: Any,
) -> DatasetRows:
    """`load_grpo_dataset`, with the columns of yours each role came from (`DatasetRows`)."""
    if eval_split is not None and eval_split == split:  # the held-out accuracy would be measured on trained rows
        raise DatasetError(f"--eval_split {eval_split} is the split trained on, so nothing would be held out; name "
                           "another split, or hold rows out of it with --test_size instead.")  # fmt: skip
    media = {"image_column": columns.get("image_column"), "video_column": columns.get("video_column")}
    bad_rows = {"decode": check_images, "skip_bad_rows": skip_bad_rows, "stop_hint": stop_hint,
                "keep_origin": keep_origin}  # fmt: skip
    train, image, found = _checked_split(source, split, name, media, bad_rows)
    # The held-out split's images are in the column the training split's are: found once, named for the second.
    media["image_column"] = image
    test = _checked_split(source, eval_split, name, media, bad_rows)[0] if eval_split else None
    if test is None and test_size:
        size = test_size if 0 < test_size < 1 else int(test_size)
        held_out = math.ceil(size * len(train)) if isinstance(size, float) else size  # as `train_test_split` counts
        if not 0 < held_out < len(train):
            raise DatasetError(f"--test_size {test_size:g} holds out {held_out} of {len(train)} rows in {source}, "
                               "leaving none to train on; hold out fewer (--test_size 0: none).")  # fmt: skip
        parts = train.train_test_split(test_size=size, seed=seed)
        train, test = parts["train"], parts["test"]
    columns = {**columns, "image_column": image}
    roles = _roles(list(train.column_names), columns)
    train = to_grpo_rows(train, **columns)
    return DatasetRows(train, to_grpo_rows(test, **columns) if test is not None else None, roles, found)


def _roles(present: list[str], columns: dict[str, Any]) -> dict[str, str]:
    """Which of `present` fills each role, as `to_grpo_rows` picks them (a role without a column left out)."""
    picks = {"prompt": _find(present, columns.get("prompt_column"), PROMPT_COLUMNS, "--prompt_column"),
             "image": columns.get("image_column"),
             "video": columns.get("video_column") or next((c for c in VIDEO_COLUMNS if c in present), None),
             "answer": _find(present, columns.get("answer_column"), ANSWER_COLUMNS, "--answer_column")}  # fmt: skip
    return {role: column for role, column in picks.items() if column is not None}


def _checked_split(
    source: str, split: str, name: str | None, media: dict[str, Any], bad_rows: dict[str, Any]
) -> tuple[Any, str | None, bool]:
    """`(rows, image column, found by content)`: `load_source`'s split with the rows whose images or clips are
    missing or unreadable dropped (logged, named by their line)."""
    from ..media.checks import drop_unreadable_rows
    from ..media.clips import VideoError
    from ..media.images import ImageError

    loaded = load_source(source, split, name, media["image_column"], media["video_column"])
    dataset, row_names, column = loaded.dataset, loaded.row_names, loaded.image_column
    bad_rows = dict(bad_rows)
    if bad_rows.pop("keep_origin", False) and row_names is not None:  # before rows are dropped: it goes with its row
        dataset = dataset.add_column(ROW_ORIGIN, [f"{source} {row}" for row in row_names])
    present = dataset.column_names
    try:
        prompt_image_column(present)
        clip_column = media["video_column"] or prompt_video_column(present)
    except ValueError:  # both `image` and `images` (or `video` and `videos`): to_grpo_rows names the fix
        return dataset, media["image_column"], False
    column = column if column in present else None
    clip_column = clip_column if clip_column in present else None
    if column is None and clip_column is None:
        return dataset, None, False
    label = source if split == "train" else f"{source} ({split})"
    try:
        dataset = drop_unreadable_rows(dataset, column, label, clip_column=clip_column, row_names=row_names,
                                       **bad_rows)[0]  # fmt: skip
    except (ImageError, VideoError) as error:
        message = str(error)
        hint = _relative_paths_hint(source, dataset, column) if "looks wrong as a whole" in message else ""
        if "relative to the working directory" in hint:  # the hint names the cause: the first failure adds nothing
            message = message.split(" First: ")[0]
        raise DatasetError(message.rstrip(".") + "." + hint if hint else message) from error
    return dataset, column, loaded.found_by_content


def _relative_paths_hint(source: str, dataset: Any, column: str | None) -> str:
    """For a dataset file whose image paths mostly miss: where they are read from, and the fix when they were
    written relative to the working directory instead (`shapes/img/0.jpg` in `shapes/data.csv`, not `img/0.jpg`)."""
    from ..media.checks import undecoded

    if column is None or not os.path.exists(source):
        return ""
    base = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else os.path.abspath(source)
    shown = os.path.relpath(base) if base != os.getcwd() else "."
    hint = ""
    for row in undecoded(dataset, column).select_columns([column]).select(range(min(len(dataset), 20))):
        value = row[column]
        for image in value if isinstance(value, list) else [value]:
            path = image.get("path") if isinstance(image, dict) and image.get("bytes") is None else image
            if not isinstance(path, str) or os.path.isfile(path):
                continue
            hint = f" Image paths are read relative to the dataset file's folder ({shown}/)"
            written = os.path.relpath(path, base)  # the path as the file has it
            if os.path.isfile(written):
                return (f"{hint}: {written!r} is there relative to the working directory; write it relative to "
                        f"{shown}/ as {os.path.relpath(os.path.abspath(written), base)!r}.")  # fmt: skip
    return hint + "." if hint else ""

"""Video clips: loading them from what a dataset row holds, and the errors that name what is wrong with one.

A row's clip may be a list of frames (anything `vlm_grpo.media.images.load_image` reads: PIL images, arrays, paths, bytes),
a 4-D array of frames (T x H x W x C), a folder of frame images (read in natural order: `frame_2` before `frame_10`),
a video file (decoded with PyAV, see below), or a `{"frames": [...], "fps": 8.0}` dict giving the rate of its frames.
Each becomes a :class:`Clip`: upright RGB frames of one size, with where they came from (the source's frame rate and
the index of every kept frame), which Qwen-VL's processors turn into temporal positions (`second_per_grid_ts`) and
frame timestamps.

Which frames are kept is not decided here: `load_clip` takes the rule (`vlm_grpo.media.video_budget.VideoBudget` owns it)
and decodes only those frames of a file.

Decoding: PyAV (`pip install 'vlm-grpo[video]'`), FFmpeg's own libraries in a self-contained wheel for Linux, macOS
and Windows, maintained with FFmpeg's releases, no torch or torchvision needed (transformers' default decoder,
torchcodec, must match the installed torch build, which the CPU wheels here do not provide). It reads every container
and codec FFmpeg does, and can stop decoding at the last frame a clip needs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from .images import ImageError, load_image, normalize_image

__all__ = ["Clip", "VideoError", "is_clip_value", "load_clip", "probe_clip"]

# Frame files a folder of frames may hold.
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
# What a clip may be, for error messages.
_ACCEPTED = (
    "a list of frames (PIL images, arrays, paths or bytes), a T x H x W x C array, a folder of frame images, a video "
    'file path, or a {"frames": [...], "fps": ...} dict'
)

FrameSampler = Callable[[int, "float | None"], Sequence[int]]


class VideoError(ValueError):
    """A clip could not be used; the message says why and how to fix it."""


@dataclass(frozen=True, eq=False)
class Clip:
    """Frames of one clip, all RGB and of one size, with where they sit in their source.

    Attributes:
        frames: the kept frames, in order.
        fps: frames per second of the source (a file's rate, or the rate given with its frames); None when unknown.
        indices: each kept frame's index in the source (repeats allowed: a short clip may repeat frames).
        total_frames: frames in the source.
    """

    frames: tuple[Image.Image, ...]
    fps: float | None
    indices: tuple[int, ...]
    total_frames: int

    @property
    def size(self) -> tuple[int, int]:
        """`(width, height)` of every frame."""
        return self.frames[0].size

    def __deepcopy__(self, memo: dict) -> Clip:
        # Never modified once loaded; TRL deep-copies every batch's prompts (and their media) before generating.
        return self

    def metadata(self) -> dict[str, Any]:
        """The clip as transformers' `VideoMetadata` describes one (the processor's temporal positions read it)."""
        width, height = self.size
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "frames_indices": list(self.indices),
            "width": width,
            "height": height,
            "duration": self.total_frames / self.fps if self.fps else None,
        }


def is_clip_value(value: Any) -> bool:
    """Whether `value` is something `load_clip` could read (not whether it reads: see `probe_clip`)."""
    if isinstance(value, Clip | str | os.PathLike):
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 4
    if isinstance(value, dict):
        return "frames" in value or {"path", "bytes"} & set(value)
    return isinstance(value, list | tuple)


def probe_clip(value: Any) -> int:
    """Check that `value` is a readable clip without decoding its frames where that can be avoided; return its frame
    count. A file is opened and its video stream read for a frame count; frames in a list or folder are opened (their
    headers read) to check they exist and share one size.

    Raises:
        VideoError: an unreadable or missing file, no frames, frames of different sizes, or a value of another kind.
    """
    if isinstance(value, Clip):
        return len(value.frames)
    source = _source(value)
    if isinstance(source, _File):
        with _open_container(source) as (container, stream):
            return source.frame_count(container, stream)
    frames = source.frames
    if isinstance(frames, np.ndarray):
        return len(frames)
    sizes = []
    for position, frame in enumerate(frames):
        sizes.append(_frame_size(frame, position, source.where))
    _check_sizes(sizes, source.where)
    return len(sizes)


def load_clip(value: Any, sample: FrameSampler | None = None) -> Clip:
    """Read a clip, keeping the frames `sample(total_frames, fps)` picks (all of them without a sampler).

    Only the picked frames of a video file are decoded (decoding stops after the last one). Frames come out upright
    8-bit RGB (`vlm_grpo.media.images.normalize_image`), all of one size.

    Raises:
        VideoError: as `probe_clip`, or a file whose frames cannot be decoded.
    """
    if isinstance(value, Clip):  # already loaded (and sampled)
        return value
    source = _source(value)
    if isinstance(source, _File):
        return source.decode(sample)
    frames = source.frames
    total = len(frames)
    if not total:
        raise VideoError(f"{source.where} has no frames; a clip needs at least one")
    indices = _picks(total, source.fps, sample)
    loaded: dict[int, Image.Image] = {}
    for index in sorted(set(indices)):
        loaded[index] = _load_frame(frames[index], index, source.where)
    _check_sizes([loaded[i].size for i in sorted(loaded)], source.where, sorted(loaded))
    return Clip(tuple(loaded[i] for i in indices), source.fps, tuple(indices), total)


# ---------------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Frames:
    frames: Sequence[Any] | np.ndarray
    fps: float | None
    where: str


@dataclass(frozen=True)
class _File:
    path: str | None
    data: bytes | None
    where: str

    def frame_count(self, container: Any, stream: Any) -> int:
        # The container's count when it has one; else the packets are counted (no decoding).
        count = int(stream.frames or 0)
        if not count:
            count = sum(1 for packet in container.demux(stream) if packet.size)
        if not count:
            raise VideoError(f"{self.where} has no frames in its video stream; re-encode it or drop the row")
        return count

    def decode(self, sample: FrameSampler | None) -> Clip:
        with _open_container(self) as (container, stream):
            fps = float(stream.average_rate) if stream.average_rate else None
            total = self.frame_count(container, stream)
            indices = _picks(total, fps, sample)
            frames, decoded = self._decode(container, stream, set(indices))
        if max(indices) >= decoded:  # the container promised more frames than it holds: sample what is there
            if not decoded:
                raise VideoError(f"{self.where}: no frame could be decoded; re-encode it or drop the row")
            total = decoded
            indices = _picks(total, fps, sample)
            with _open_container(self) as (container, stream):
                frames, _ = self._decode(container, stream, set(indices))
        return Clip(tuple(frames[i] for i in indices), fps, tuple(indices), total)

    def _decode(self, container: Any, stream: Any, wanted: set[int]) -> tuple[dict[int, Image.Image], int]:
        """The wanted frames by index, decoding no further than the last of them; and how many frames were decoded."""
        import av

        frames: dict[int, Image.Image] = {}
        decoded = 0
        try:
            for index, frame in enumerate(container.decode(stream)):
                decoded = index + 1
                if index in wanted:
                    frames[index] = normalize_image(frame.to_image())
                if index >= max(wanted):
                    break
        except (av.FFmpegError, OSError, ValueError) as error:
            raise VideoError(f"{self.where} could not be decoded after {decoded} frame(s) ({error}); the file is "
                             "probably truncated or corrupt: re-encode it or drop the row") from error  # fmt: skip
        return frames, decoded


def _picks(total: int, fps: float | None, sample: FrameSampler | None) -> list[int]:
    indices = list(range(total)) if sample is None else [int(i) for i in sample(total, fps)]
    if not indices or min(indices) < 0 or max(indices) >= total:
        raise VideoError(f"frame sampling picked {indices} from {total} frames")  # a bug in the sampler, not the data
    return indices


@contextlib.contextmanager
def _open_container(source: _File) -> Iterator[tuple[Any, Any]]:
    """`av.open` of a file or bytes and its first video stream, failures as `VideoError`s naming the fix."""
    try:
        import av
    except ImportError as error:
        raise VideoError(
            f"reading {source.where} needs PyAV: pip install 'vlm-grpo[video]' (or pip install av), or give the clip "
            "as a list of frames or a folder of frame images"
        ) from error
    target = source.path if source.data is None else io.BytesIO(source.data)
    try:
        container = av.open(target)
    except (av.FFmpegError, OSError, ValueError) as error:
        raise VideoError(f"{source.where} is not a readable video ({error}); check that it is a video file (mp4, "
                         "webm, avi, ...) and not empty or corrupt") from error  # fmt: skip
    try:
        if not container.streams.video:
            raise VideoError(f"{source.where} has no video stream (audio only?); it cannot be a clip")
        yield container, container.streams.video[0]
    finally:
        container.close()


def _source(value: Any) -> _Frames | _File:
    """What kind of clip `value` is, refused with the accepted kinds named when it is none."""
    if isinstance(value, dict) and "frames" in value:
        fps = value.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
            raise VideoError(f'a clip\'s "fps" must be a positive number, got {fps!r}')
        inner = _source(value["frames"])
        if isinstance(inner, _File):
            raise VideoError('"frames" of a clip dict must be frames (a list, an array or a folder), not a video file')
        return _Frames(inner.frames, float(fps) if fps is not None else inner.fps, inner.where)
    if isinstance(value, dict) and {"path", "bytes"} & set(value):  # datasets' Video(decode=False)
        data, path = value.get("bytes"), value.get("path")
        if data:
            return _File(None, bytes(data), f"video bytes ({len(data)} bytes)")
        if path:
            return _source(path)
        raise VideoError('a video dict has neither "bytes" nor "path"; the row holds no clip')
    if isinstance(value, str | os.PathLike):
        path = os.fspath(value)
        if os.path.isdir(path):
            names = sorted((n for n in os.listdir(path) if n.lower().endswith(_FRAME_SUFFIXES)), key=_natural)
            return _Frames([os.path.join(path, n) for n in names], None, f"frame folder {path!r}")
        if not os.path.isfile(path):
            raise VideoError(f"video not found: {path!r}; check the path or the dataset's video root")
        return _File(path, None, f"video file {path!r}")
    if isinstance(value, np.ndarray):
        if value.ndim != 4 or value.shape[-1] not in (1, 3, 4):
            raise VideoError(f"a clip array must be T x H x W x C (C 1, 3 or 4), got shape {value.shape}")
        return _Frames(value, None, "clip array")
    if isinstance(value, list | tuple):
        if value and _nested_depth(value) >= 4:  # a T x H x W x C array, as a datasets column stores one
            return _source(np.asarray(value, dtype=np.uint8 if _max(value) <= 255 else np.uint16))
        return _Frames(list(value), None, "clip frames")
    raise VideoError(f"cannot read a clip from {type(value).__name__!r}; pass {_ACCEPTED}")


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _nested_depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list | tuple) and value:
        value, depth = value[0], depth + 1
    return depth


def _max(value: Any) -> float:
    try:
        return float(np.max(np.asarray(value)))
    except (ValueError, TypeError) as error:
        raise VideoError(f"nested lists are not a rectangular T x H x W x C frame array: {error}") from error


def _frame_size(frame: Any, position: int, where: str) -> tuple[int, int]:
    if isinstance(frame, Image.Image):
        return frame.size
    if isinstance(frame, np.ndarray):
        return (frame.shape[1], frame.shape[0]) if frame.ndim >= 2 else (0, 0)
    if isinstance(frame, str | os.PathLike) and os.path.isfile(os.fspath(frame)):
        try:
            with Image.open(os.fspath(frame)) as image:  # the header only
                return image.size
        except (OSError, ValueError, SyntaxError) as error:
            raise VideoError(f"{where}, frame {position}: {os.fspath(frame)!r} is not a readable image "
                             f"({error})") from error  # fmt: skip
    return _load_frame(frame, position, where).size


def _load_frame(frame: Any, position: int, where: str) -> Image.Image:
    try:
        return normalize_image(load_image(frame))
    except ImageError as error:
        raise VideoError(f"{where}, frame {position}: {error}") from error


def _check_sizes(sizes: list[tuple[int, int]], where: str, positions: list[int] | None = None) -> None:
    if not sizes:
        raise VideoError(f"{where} has no frames; a clip needs at least one")
    positions = positions if positions is not None else list(range(len(sizes)))
    for position, size in zip(positions, sizes):
        if size != sizes[0]:
            raise VideoError(
                f"{where}: frame {position} is {size[0]}x{size[1]} but frame {positions[0]} is "
                f"{sizes[0][0]}x{sizes[0][1]}; every frame of a clip must have one size (resize them to one, or "
                "split the clip)"
            )

"""Image loading, normalisation to RGB, and pixel-budget resizing.

Dataset rows reach the trainer as PIL images, file paths, encoded bytes, numpy
arrays or the ``{"bytes": ..., "path": ...}`` dicts that ``datasets.Image``
stores. Everything here turns those into plain 8-bit RGB ``PIL.Image.Image``
objects of a controlled size, failing early with :class:`ImageError` when an
input cannot be used.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from .validation import is_int

__all__ = [
    "ImageError",
    "fit_pixel_budget",
    "load_image",
    "normalize_image",
    "prepare_image",
    "prepare_images",
]

_WHITE = (255, 255, 255)
_ACCEPTED = (
    "a PIL image, a file path (str or os.PathLike), encoded bytes, a numpy array, "
    'or a {"bytes": ..., "path": ...} dict as stored by datasets.Image'
)
# Pillow raises a zoo of exception types for corrupt data depending on the
# codec; all of them mean "this input is not a usable image".
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError)


class ImageError(ValueError):
    """An input could not be turned into an image; the message says why and how to fix it."""


# --------------------------------------------------------------------------- loading


def load_image(obj: Any) -> Image.Image:
    """Load ``obj`` into a fully decoded PIL image.

    Args:
        obj: A ``PIL.Image.Image``; a ``str``/``os.PathLike`` path; encoded image
            ``bytes``/``bytearray``; a numpy array of shape HxW, HxWx1, HxWx3 or
            HxWx4 with dtype uint8, uint16, bool or float (values in [0, 1]); or a
            ``{"bytes": ..., "path": ...}`` dict (bytes preferred, path as fallback); or nested lists of pixel
            values, which is what a numpy array becomes inside a ``datasets.Dataset``.

    Returns:
        The decoded image, in whatever mode the source had (see
        :func:`normalize_image` to get RGB). PIL inputs are returned as-is after
        decoding, not copied.

    Raises:
        ImageError: the file is missing, the data cannot be decoded or is
            truncated, the type is unsupported, or the image has zero size.
    """
    if isinstance(obj, Image.Image):
        img = _decode(obj, "PIL image")
    elif isinstance(obj, (str, os.PathLike)):
        img = _load_path(obj)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        img = _load_bytes(bytes(obj), "image bytes")
    elif isinstance(obj, np.ndarray):
        img = _from_array(obj)
    elif isinstance(obj, dict):
        img = _load_dict(obj)
    elif isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (list, tuple)):
        # A numpy array stored in a `datasets.Dataset` comes back as nested lists of numbers.
        try:
            array = np.asarray(obj)
        except ValueError as error:
            raise ImageError(f"nested lists are not a rectangular pixel array: {error}") from error
        if array.dtype == object or array.ndim not in (2, 3):
            raise ImageError(f"nested lists of shape {array.shape} are not an HxW or HxWxC pixel array")
        if array.dtype.kind in "iu":
            array = array.astype(np.uint16 if array.max(initial=0) > 255 else np.uint8)
        img = _from_array(array)
    else:
        raise ImageError(f"cannot load an image from {type(obj).__name__!r}; pass {_ACCEPTED}")
    if img.width == 0 or img.height == 0:
        raise ImageError(f"image has zero size {img.size}; every image needs at least 1x1 pixels")
    return img


def _decode(img: Image.Image, what: str) -> Image.Image:
    # Pillow decodes lazily; forcing it here makes truncated files fail at load
    # time instead of deep inside a collator.
    try:
        img.load()
    except Image.DecompressionBombError as err:
        raise ImageError(
            f"{what} is too large to decode safely ({err}); downscale it offline "
            "or raise PIL.Image.MAX_IMAGE_PIXELS if the source is trusted"
        ) from err
    except _DECODE_ERRORS as err:
        raise ImageError(
            f"{what} could not be fully decoded ({err}); the file is probably truncated "
            "or corrupt, re-download or re-encode it"
        ) from err
    return img


def _load_path(path: str | os.PathLike[str]) -> Image.Image:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ImageError(
            f"image file not found: {path!r}; check the path or the dataset's image root"
        )
    try:
        with Image.open(path) as img:
            return _decode(img, f"image file {path!r}")
    except ImageError:
        raise
    except Image.DecompressionBombError as err:
        raise ImageError(f"image file {path!r} is too large to open safely ({err})") from err
    except _DECODE_ERRORS as err:
        raise ImageError(
            f"image file {path!r} is not a readable image ({err}); check that it is a "
            "PNG/JPEG/... file and not empty or corrupt"
        ) from err


def _load_bytes(data: bytes, what: str) -> Image.Image:
    if not data:
        raise ImageError(f"{what} are empty; the dataset row has no encoded image")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as err:
        raise ImageError(f"{what} describe an image too large to open safely ({err})") from err
    except _DECODE_ERRORS as err:
        raise ImageError(
            f"{what} ({len(data)} bytes) are not a decodable image ({err}); "
            "pass encoded PNG/JPEG/... bytes, not raw pixel buffers"
        ) from err
    return _decode(img, what)


def _load_dict(obj: dict[str, Any]) -> Image.Image:
    data, path = obj.get("bytes"), obj.get("path")
    if data is not None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ImageError(f'dict "bytes" must be bytes, got {type(data).__name__!r}')
        return _load_bytes(bytes(data), 'dict "bytes"')
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise ImageError(f'dict "path" must be a str, got {type(path).__name__!r}')
        return _load_path(path)
    raise ImageError(
        f'image dict has neither "bytes" nor "path" (keys: {sorted(obj)}); '
        'expected the {"bytes": ..., "path": ...} form stored by datasets.Image'
    )


def _from_array(arr: np.ndarray) -> Image.Image:
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ImageError(f"numpy image must have shape HxW, HxWx1, HxWx3 or HxWx4, got {arr.shape}")
    if arr.size == 0:
        raise ImageError(f"numpy image has zero size {arr.shape}")
    arr = _array_to_uint(arr)
    if arr.dtype == np.uint16:
        # PIL has no 16-bit colour mode, so only greyscale keeps its depth;
        # colour is scaled to 8 bits here with the same rounding normalize uses.
        if arr.ndim == 2:
            height, width = arr.shape
            return Image.frombytes("I;16", (width, height), arr.astype("<u2").tobytes())
        arr = _scale_to_uint8(arr.astype(np.float64), 65535.0)
    mode = "L" if arr.ndim == 2 else ("RGB" if arr.shape[2] == 3 else "RGBA")
    return Image.frombytes(mode, (arr.shape[1], arr.shape[0]), np.ascontiguousarray(arr).tobytes())


def _array_to_uint(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.bool_:
        return arr.astype(np.uint8) * 255
    if arr.dtype in (np.uint8, np.uint16):
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or arr.min() < 0.0 or arr.max() > 1.0:
            raise ImageError(
                "float numpy image must hold finite values in [0, 1]; "
                "divide by 255 (or clip) first, or pass a uint8 array"
            )
        return _scale_to_uint8(arr.astype(np.float64), 1.0)
    raise ImageError(
        f"numpy image dtype {arr.dtype} is not supported; use uint8, uint16, bool "
        "or float in [0, 1] (e.g. arr.astype(np.uint8))"
    )


def _scale_to_uint8(values: np.ndarray, full_scale: float) -> np.ndarray:
    return np.clip(np.rint(values * (255.0 / full_scale)), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------- normalising


def normalize_image(img: Image.Image) -> Image.Image:
    """Return an upright 8-bit RGB copy of ``img``; the input is never modified.

    * EXIF orientation is applied (and dropped), so rotated phone photos come out upright.
    * Transparency (LA, RGBA, PA, palette or colour-key ``transparency``) is
      composited over a white background.
    * 16-bit modes (``I;16*``) are scaled by 255/65535, so 65535 maps to 255.
      Mode ``I`` is assumed 8-bit if its values fit in [0, 255], 16-bit if they
      fit in [0, 65535], and is min-max stretched otherwise.
    * Mode ``F`` is assumed to be in [0, 1] if it fits, [0, 255] if it fits, and
      is min-max stretched otherwise.
    * All other modes (1, L, P, CMYK, YCbCr, LAB, HSV, ...) use Pillow's conversion.
    """
    img = ImageOps.exif_transpose(img)  # returns a new image, input untouched
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img.copy()
    if mode.startswith("I;16"):
        return _gray_to_rgb(np.asarray(img).astype(np.float64), 65535.0)
    if mode == "I":
        return _gray_to_rgb(*_guess_int_range(np.asarray(img).astype(np.float64)))
    if mode == "F":
        return _gray_to_rgb(*_guess_float_range(np.asarray(img).astype(np.float64)))
    if mode in ("LA", "La", "PA", "RGBA", "RGBa") or "transparency" in img.info:
        return _flatten_on_white(img)
    return img.convert("RGB")


def _flatten_on_white(img: Image.Image) -> Image.Image:
    if img.mode == "La":
        # Pillow cannot convert premultiplied LA directly; unpremultiply first.
        img = img.convert("LA")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*_WHITE, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _guess_int_range(values: np.ndarray) -> tuple[np.ndarray, float]:
    lo, hi = float(values.min()), float(values.max())
    if lo >= 0 and hi <= 255:
        return values, 255.0
    if lo >= 0 and hi <= 65535:
        return values, 65535.0
    return _stretch(values, lo, hi)


def _guess_float_range(values: np.ndarray) -> tuple[np.ndarray, float]:
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(values.min()), float(values.max())
    if lo >= 0 and hi <= 1.0:
        return values, 1.0
    if lo >= 0 and hi <= 255.0:
        return values, 255.0
    return _stretch(values, lo, hi)


def _stretch(values: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, float]:
    span = hi - lo
    return (values - lo, span) if span > 0 else (np.zeros_like(values), 1.0)


def _gray_to_rgb(values: np.ndarray, full_scale: float) -> Image.Image:
    gray = _scale_to_uint8(values, full_scale)
    height, width = gray.shape
    return Image.frombytes("L", (width, height), gray.tobytes()).convert("RGB")


# ---------------------------------------------------------------------- pixel budget


def fit_pixel_budget(
    img: Image.Image,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    multiple_of: int = 1,
) -> Image.Image:
    """Resize ``img`` (keeping its aspect ratio) so its area is within a pixel budget.

    Args:
        img: Image to fit; never modified.
        min_pixels: Smallest allowed ``width * height``; ``None`` for no lower bound.
        max_pixels: Largest allowed ``width * height``; ``None`` for no upper bound.
        multiple_of: Both output sides are positive multiples of this (e.g. 28 for
            Qwen2.5-VL: patch 14 x spatial merge 2).

    Returns:
        A copy of ``img`` if it already satisfies the budget and ``multiple_of``;
        otherwise a BICUBIC resize to the size closest in aspect ratio (then area)
        that does. With ``multiple_of == 1`` an image inside the budget is never
        resized. Very elongated images may have their aspect ratio clamped, since
        each side is at least ``multiple_of``.

    Raises:
        ValueError: a bound or ``multiple_of`` is not a positive int,
            ``min_pixels > max_pixels``, or no size with sides that are multiples of
            ``multiple_of`` has an area inside the budget.
    """
    _check_budget(min_pixels, max_pixels, multiple_of)
    size = _budget_size(img.width, img.height, min_pixels, max_pixels, multiple_of)
    if size == img.size:
        return img.copy()
    return img.resize(size, Image.Resampling.BICUBIC)


def _check_budget(min_pixels: int | None, max_pixels: int | None, multiple_of: int) -> None:
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (not is_int(value) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if not is_int(multiple_of) or multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    if max_pixels is not None and max_pixels < multiple_of**2:
        raise ValueError(
            f"max_pixels ({max_pixels}) is smaller than one {multiple_of}x{multiple_of} "
            f"block; raise max_pixels to at least {multiple_of**2}"
        )


def _budget_size(
    width: int, height: int, min_pixels: int | None, max_pixels: int | None, unit: int
) -> tuple[int, int]:
    # Work in units of `unit` so the search is over small integers (a, b) with
    # output size (a * unit, b * unit).
    lo = (min_pixels or 0) / unit**2
    hi = (max_pixels or math.inf) / unit**2
    w, h = width / unit, height / unit
    ideal_area = min(max(w * h, lo), hi)
    scale = math.sqrt(ideal_area / (w * h))
    ideal_w, ideal_h = w * scale, h * scale

    best = _search(_around(ideal_w), _around(ideal_h), w / h, lo, hi, ideal_area)
    if best is None and math.isfinite(hi):
        # A tight budget (e.g. min == max) may only be met far from the ideal
        # size; the shorter side of any valid size is <= sqrt(hi), so this is exhaustive.
        sides = range(1, math.isqrt(math.floor(hi)) + 1)
        best = _search(sides, sides, w / h, lo, hi, ideal_area)
    if best is None:
        raise ValueError(
            f"no {unit}-multiple size has an area within [{min_pixels}, {max_pixels}] pixels; "
            "widen the budget or lower multiple_of"
        )
    return best[2] * unit, best[3] * unit


def _search(
    widths: range, heights: range, ratio: float, lo: float, hi: float, ideal_area: float
) -> tuple[float, float, int, int] | None:
    best: tuple[float, float, int, int] | None = None
    for a in widths:
        best = _better(best, a, _fit_other_side(a, 1 / ratio, lo, hi), ratio, ideal_area)
    for b in heights:
        best = _better(best, _fit_other_side(b, ratio, lo, hi), b, ratio, ideal_area)
    return best


def _around(x: float) -> range:
    return range(max(1, math.floor(x) - 1), max(1, math.ceil(x) + 1) + 1)


def _fit_other_side(side: int, ratio: float, lo: float, hi: float) -> int | None:
    """Best integer partner for ``side`` given the aspect ``ratio`` and area bounds."""
    first = max(1, math.ceil(lo / side - 1e-9))
    last = math.floor(hi / side + 1e-9) if math.isfinite(hi) else math.inf
    if first > last:
        return None
    return int(min(max(round(side * ratio), first), last))


def _better(
    best: tuple[float, float, int, int] | None,
    a: int | None,
    b: int | None,
    ratio: float,
    ideal_area: float,
) -> tuple[float, float, int, int] | None:
    if a is None or b is None:
        return best
    candidate = (abs(math.log(a / b / ratio)), abs(math.log(a * b / ideal_area)), a, b)
    # Aspect ratio first, then area: distortion is more harmful than a slightly smaller image.
    return candidate if best is None or candidate[:2] < best[:2] else best


# -------------------------------------------------------------------- one-stop entry


def prepare_image(
    obj: Any,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    multiple_of: int = 1,
) -> Image.Image:
    """Load, normalise to RGB and fit to the pixel budget; see the three steps for details."""
    return fit_pixel_budget(
        normalize_image(load_image(obj)), min_pixels, max_pixels, multiple_of=multiple_of
    )


def prepare_images(
    value: Any,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    multiple_of: int = 1,
) -> list[Image.Image]:
    """Turn a row's ``image`` (one) or ``images`` (a list) value into a list of RGB images.

    ``None`` gives ``[]``; a list or tuple (possibly empty) is prepared element by
    element; anything else is treated as a single image. Errors name the failing
    list index.
    """
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)):
        images = []
        for i, item in enumerate(value):
            try:
                images.append(prepare_image(item, min_pixels, max_pixels, multiple_of=multiple_of))
            except ImageError as err:
                raise ImageError(f"images[{i}]: {err}") from err
        return images
    return [prepare_image(value, min_pixels, max_pixels, multiple_of=multiple_of)]

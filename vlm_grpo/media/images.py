"""Image loading and normalisation to RGB (fitting to the pixel budget: `vlm_grpo.media.pixel_budget`).

Dataset rows reach the trainer as PIL images, file paths, encoded bytes, numpy
arrays or the ``{"bytes": ..., "path": ...}`` dicts that ``datasets.Image``
stores. Everything here turns those into plain 8-bit RGB ``PIL.Image.Image``
objects of a controlled size, failing early with :class:`ImageError` when an
input cannot be used.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "URL_TIMEOUT",
    "ImageError",
    "fetch_image_bytes",
    "load_image",
    "load_rgb_images",
    "normalize_image",
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


#: Seconds an image URL may take to answer before its row counts as unreadable.
URL_TIMEOUT = 30


def _is_url(path: str) -> bool:
    return path.lower().startswith(("http://", "https://"))


def _fetch(url: str) -> bytes:
    """The body of `url` (http or https), or `ImageError` saying why not."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT) as response:  # http(s) only: _is_url
            return response.read()
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise ImageError(f"image URL {url!r} could not be fetched ({reason}); check the URL or the network") from error


def fetch_image_bytes(url: str) -> bytes | None:
    """The bytes of an image URL, fetched once when a dataset is loaded; None when it cannot be fetched (the row
    check then fetches it again and names the reason, skipping its row)."""
    try:
        return _fetch(url)
    except ImageError:
        return None


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
    if _is_url(path):
        return _load_bytes(_fetch(path), f"image URL {path!r}")
    if not os.path.isfile(path):
        raise ImageError(f"image file not found: {path!r}; check the path or the dataset's image root")
    what = f"image file {path!r}"
    return _open(path, what, f"{what} is too large to open safely",
                 f"{what} is not a readable image ({{err}}); check that it is a PNG/JPEG/... file and not empty or corrupt")  # fmt: skip


def _load_bytes(data: bytes, what: str) -> Image.Image:
    if not data:
        raise ImageError(f"{what} are empty; the dataset row has no encoded image")
    return _open(io.BytesIO(data), what, f"{what} describe an image too large to open safely",
                 f"{what} ({len(data)} bytes) are not a decodable image ({{err}}); "
                 "pass encoded PNG/JPEG/... bytes, not raw pixel buffers")  # fmt: skip


def _open(source: Any, what: str, too_large: str, unreadable: str) -> Image.Image:
    """`Image.open(source)` decoded, its failures as `ImageError`s (`{err}` in `unreadable` becomes the error)."""
    try:
        img = Image.open(source)
    except Image.DecompressionBombError as err:
        raise ImageError(f"{too_large} ({err})") from err
    except _DECODE_ERRORS as err:
        raise ImageError(unreadable.replace("{err}", str(err))) from err  # not format(): paths may hold braces
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


def _guess_range(values: np.ndarray, full_scales: tuple[float, ...]) -> tuple[np.ndarray, float]:
    """The first of `full_scales` that holds every value (from 0), else the values stretched to their own range."""
    lo, hi = float(values.min()), float(values.max())
    for scale in full_scales:
        if lo >= 0 and hi <= scale:
            return values, scale
    return _stretch(values, lo, hi)


def _guess_int_range(values: np.ndarray) -> tuple[np.ndarray, float]:
    return _guess_range(values, (255.0, 65535.0))


def _guess_float_range(values: np.ndarray) -> tuple[np.ndarray, float]:
    return _guess_range(np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0), (1.0, 255.0))


def _stretch(values: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, float]:
    span = hi - lo
    return (values - lo, span) if span > 0 else (np.zeros_like(values), 1.0)


def _gray_to_rgb(values: np.ndarray, full_scale: float) -> Image.Image:
    gray = _scale_to_uint8(values, full_scale)
    height, width = gray.shape
    return Image.frombytes("L", (width, height), gray.tobytes()).convert("RGB")


# -------------------------------------------------------------------- one-stop entry


def load_rgb_images(value: Any) -> list[Image.Image]:
    """Turn a row's ``image`` (one) or ``images`` (a list) value into a list of upright RGB images.

    Each image is loaded (:func:`load_image`) and normalised (:func:`normalize_image`). ``None`` gives ``[]``; a list
    or tuple (possibly empty) is loaded element by element; anything else is treated as a single image. Errors name
    the failing list index.
    """
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)):
        images = []
        for i, item in enumerate(value):
            try:
                images.append(normalize_image(load_image(item)))
            except ImageError as err:
                raise ImageError(f"images[{i}]: {err}") from err
        return images
    return [normalize_image(load_image(value))]

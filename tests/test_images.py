"""Tests for vlm_grpo.media.images: loading every input kind, RGB normalisation, pixel budgets."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_grpo.media.images import ImageError, load_image, load_rgb_images, normalize_image
from vlm_grpo.media.pixel_budget import fit_pixel_budget


def _encode(img: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture
def rgb() -> Image.Image:
    img = Image.new("RGB", (8, 6), (10, 20, 30))
    img.putpixel((0, 0), (200, 100, 50))
    return img


@pytest.fixture
def png_path(tmp_path: Path, rgb: Image.Image) -> Path:
    path = tmp_path / "img.png"
    rgb.save(path)
    return path


# ------------------------------------------------------------------------- loading


def test_load_pil(rgb: Image.Image) -> None:
    assert load_image(rgb).getpixel((0, 0)) == (200, 100, 50)


def test_load_path_str_and_pathlike(png_path: Path, rgb: Image.Image) -> None:
    for source in (str(png_path), png_path):
        img = load_image(source)
        assert img.size == (8, 6)
        assert img.tobytes() == rgb.tobytes()


@pytest.mark.parametrize("wrap", [bytes, bytearray])
def test_load_bytes(rgb: Image.Image, wrap: type) -> None:
    assert load_image(wrap(_encode(rgb))).tobytes() == rgb.tobytes()


def test_load_datasets_dict_prefers_bytes(rgb: Image.Image, png_path: Path) -> None:
    other = Image.new("RGB", (3, 3), (1, 2, 3))
    from_bytes = load_image({"bytes": _encode(other), "path": str(png_path)})
    assert from_bytes.size == (3, 3)
    from_path = load_image({"bytes": None, "path": str(png_path)})
    assert from_path.tobytes() == rgb.tobytes()


def test_load_dict_without_data_raises() -> None:
    with pytest.raises(ImageError, match="neither"):
        load_image({"bytes": None, "path": None})


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.full((4, 5), 200, np.uint8), (200, 200, 200)),
        (np.full((4, 5, 1), 7, np.uint8), (7, 7, 7)),
        (np.full((4, 5, 3), (1, 2, 3), np.uint8), (1, 2, 3)),
        (np.full((4, 5, 4), (1, 2, 3, 255), np.uint8), (1, 2, 3)),
        (np.full((4, 5), 65535, np.uint16), (255, 255, 255)),
        (np.full((4, 5, 3), 65535, np.uint16), (255, 255, 255)),
        (np.ones((4, 5), bool), (255, 255, 255)),
        (np.full((4, 5, 3), 0.5, np.float32), (128, 128, 128)),
    ],
)
def test_load_numpy(array: np.ndarray, expected: tuple[int, int, int]) -> None:
    img = normalize_image(load_image(array))
    assert img.size == (5, 4)
    assert img.mode == "RGB"
    assert img.getpixel((0, 0)) == expected


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.zeros((4, 5), np.int32), "dtype"),
        (np.full((4, 5), 2.0), r"\[0, 1\]"),
        (np.zeros((4, 5, 2), np.uint8), "shape"),
        (np.zeros((0, 5), np.uint8), "zero size"),
    ],
)
def test_load_numpy_rejects(array: np.ndarray, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        load_image(array)


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="not found"):
        load_image(tmp_path / "nope.png")


@pytest.mark.parametrize("bad", [42, 1.5, ["a"], object()])
def test_wrong_type_raises(bad: object) -> None:
    with pytest.raises(ImageError, match="cannot load an image"):
        load_image(bad)


def test_undecodable_bytes_raise() -> None:
    with pytest.raises(ImageError, match="not a decodable image"):
        load_image(b"definitely not an image")
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_raises(tmp_path: Path, fmt: str) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = _encode(Image.fromarray(noise), fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match="truncated"):
        load_image(path)
    with pytest.raises(ImageError):
        load_image(data[: len(data) // 2])


def test_zero_size_image_raises() -> None:
    with pytest.raises(ImageError, match="zero size"):
        load_image(Image.new("RGB", (0, 4)))


# --------------------------------------------------------------------- normalising


def test_exif_rotation_applied(tmp_path: Path) -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = img.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif.tobytes())
    out = normalize_image(load_image(path))
    assert out.size == (20, 40)
    assert out.getexif().get(0x0112, 1) == 1


def test_palette_with_transparency_on_white() -> None:
    img = Image.new("P", (2, 1))
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    img.putpixel((1, 0), 1)
    img.info["transparency"] = 0  # index 0 (black) is transparent
    out = normalize_image(img)
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 0)) == (255, 0, 0)


def test_rgba_composited_on_white() -> None:
    img = Image.new("RGBA", (3, 1), (0, 0, 0, 0))
    img.putpixel((1, 0), (0, 0, 255, 255))
    img.putpixel((2, 0), (0, 0, 0, 128))
    out = normalize_image(img)
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 0)) == (0, 0, 255)
    assert all(120 <= c <= 135 for c in out.getpixel((2, 0)))


def test_la_composited_on_white() -> None:
    img = Image.new("LA", (1, 1), (0, 0))
    assert normalize_image(img).getpixel((0, 0)) == (255, 255, 255)


def test_16bit_png_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.array([[0, 257 * 100, 65535]], dtype="<u2")
    img16 = Image.frombytes("I;16", (3, 1), values.tobytes())
    path = tmp_path / "deep.png"
    img16.save(path)
    loaded = load_image(path)
    assert loaded.mode.startswith("I")
    out = normalize_image(loaded)
    assert [out.getpixel((x, 0))[0] for x in range(3)] == [0, 100, 255]


def test_16bit_big_endian_and_mode_i() -> None:
    big = Image.frombytes("I;16B", (1, 1), np.array([65535], ">u2").tobytes())
    assert normalize_image(big).getpixel((0, 0)) == (255, 255, 255)
    mode_i = Image.frombytes("I", (2, 1), np.array([0, 65535], "<i4").tobytes())
    out = normalize_image(mode_i)
    assert [out.getpixel((x, 0)) for x in range(2)] == [(0, 0, 0), (255, 255, 255)]


def test_float_mode_scaled() -> None:
    img = Image.frombytes("F", (2, 1), np.array([0.0, 1.0], "<f4").tobytes())
    out = normalize_image(img)
    assert [out.getpixel((x, 0)) for x in range(2)] == [(0, 0, 0), (255, 255, 255)]


def test_cmyk_jpeg(tmp_path: Path) -> None:
    path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(path, quality=95)  # pure red ink
    out = normalize_image(load_image(path))
    r, g, b = out.getpixel((4, 4))
    assert out.mode == "RGB" and r > 200 and g < 60 and b < 60


def _in_mode(mode: str, rgba: tuple[int, int, int, int] = (200, 30, 60, 255)) -> Image.Image:
    """A 3x2 image of one colour in `mode`, made by Pillow's own conversion from RGB(A)."""
    if mode == "PA":  # palette index 1 is the colour, alpha from `rgba`
        img = Image.new("P", (3, 2), 1)
        img.putpalette([0, 0, 0, *rgba[:3]] + [0] * 762)
        pa = img.convert("PA")
        pa.putalpha(rgba[3])
        return pa
    rgba_image = Image.new("RGBA", (3, 2), rgba)
    if mode == "La":  # Pillow's RGBA -> La conversion drops the alpha; LA -> La keeps it
        return rgba_image.convert("LA").convert("La")
    return rgba_image.convert(mode)


def _on_white(value: int, alpha: int) -> int:
    return round(value * alpha / 255 + 255 * (1 - alpha / 255))


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (Image.new("1", (3, 2), 1), (255, 255, 255)),  # 1-bit white is 255, not 1
        (Image.new("L", (3, 2), 100), (100, 100, 100)),
        (Image.new("I;16", (3, 2), 257 * 100), (100, 100, 100)),  # scaled, not clipped to 255
        (_in_mode("YCbCr"), (200, 30, 60)),  # converted, not its channels read as R, G, B
        (_in_mode("LAB"), (200, 30, 60)),
        (_in_mode("HSV"), (200, 30, 60)),
        (_in_mode("PA"), (200, 30, 60)),
        (_in_mode("PA", (200, 30, 60, 128)), tuple(_on_white(v, 128) for v in (200, 30, 60))),
        (_in_mode("RGBa", (200, 30, 60, 128)), tuple(_on_white(v, 128) for v in (200, 30, 60))),  # premultiplied
        (_in_mode("La", (100, 100, 100, 128)), (_on_white(100, 128),) * 3),
    ],
    ids=["1", "L", "I;16", "YCbCr", "LAB", "HSV", "PA", "PA-half-alpha", "RGBa-half-alpha", "La-half-alpha"],
)
def test_other_modes_keep_their_colour_in_rgb(image: Image.Image, expected: tuple[int, int, int]) -> None:
    out = normalize_image(image)
    assert out.mode == "RGB" and out.size == (3, 2)
    assert np.abs(np.asarray(out, dtype=int) - expected).max() <= 3, (out.getpixel((0, 0)), expected)


def test_normalize_does_not_mutate(rgb: Image.Image) -> None:
    before = rgb.tobytes()
    out = normalize_image(rgb)
    assert out is not rgb
    out.putpixel((0, 0), (0, 0, 0))
    assert rgb.tobytes() == before


# -------------------------------------------------------------------- pixel budget


def test_budget_untouched_inside() -> None:
    img = Image.new("RGB", (30, 20))
    out = fit_pixel_budget(img, 100, 1000)
    assert out.size == (30, 20) and out is not img


def test_budget_downscale_keeps_aspect() -> None:
    out = fit_pixel_budget(Image.new("RGB", (400, 300)), max_pixels=10_000)
    w, h = out.size
    assert w * h <= 10_000
    assert w * h > 9_000
    assert math.isclose(w / h, 4 / 3, rel_tol=0.03)


def test_budget_upscale_keeps_aspect() -> None:
    out = fit_pixel_budget(Image.new("RGB", (20, 10)), min_pixels=5_000)
    w, h = out.size
    assert 5_000 <= w * h < 5_300
    assert math.isclose(w / h, 2.0, rel_tol=0.03)


def test_budget_extreme_aspect_still_within() -> None:
    out = fit_pixel_budget(Image.new("RGB", (1, 10_000)), max_pixels=100)
    assert out.size == (1, 100)
    assert fit_pixel_budget(Image.new("RGB", (10_000, 3)), max_pixels=100).size == (100, 1)


def test_budget_max_wins_when_the_bounds_are_within_a_row() -> None:
    # Rounding 30x30 up to 1000 px gives 32x32 = 1024: the max bound is the one that must hold.
    w, h = fit_pixel_budget(Image.new("RGB", (30, 30)), min_pixels=1000, max_pixels=1000).size
    assert w * h <= 1000 and abs(w - h) <= 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_pixels": 2000, "max_pixels": 1000}, r"min_pixels \(2000\).*max_pixels \(1000\)"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"max_pixels": -5}, "max_pixels"),
        ({"max_pixels": 1e4}, "max_pixels must be a positive integer"),
        ({"min_pixels": True}, "min_pixels must be a positive integer"),
    ],
)
def test_budget_validation(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_pixel_budget(Image.new("RGB", (30, 30)), **kwargs)


# ----------------------------------------------------------------------- one-stop


def test_load_rgb_images_shapes(rgb: Image.Image, png_path: Path) -> None:
    assert load_rgb_images(None) == []
    assert load_rgb_images([]) == []
    [one] = load_rgb_images({"bytes": _encode(rgb.convert("RGBA")), "path": None})
    assert one.mode == "RGB" and one.size == rgb.size
    mixed = load_rgb_images([rgb, str(png_path), _encode(rgb), np.zeros((2, 2, 3), np.uint8)])
    assert [im.mode for im in mixed] == ["RGB"] * 4
    assert [im.getpixel((0, 0)) for im in mixed] == [(200, 100, 50)] * 3 + [(0, 0, 0)]  # each its own, in order


def test_load_rgb_images_names_bad_index(rgb: Image.Image) -> None:
    with pytest.raises(ImageError, match=r"images\[1\]"):
        load_rgb_images([rgb, b"junk"])

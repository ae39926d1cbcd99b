"""Grounding rewards: IoU between the predicted box and the gold box, in the model's own coordinate frame.

Models write boxes in different frames, fixed by the model family, never guessed from the numbers:

* ``"pixels"``: absolute pixels of the dataset's (original) image; what the prompt asks for in ``--task locate``.
* ``"normalized"``: fractions of the image, 0–1.
* ``"qwen2_vl"``: Qwen2-VL's and Qwen3-VL's 0–1000 grid over the image.
* ``"qwen2_5_vl"``: Qwen2.5-VL's absolute pixels *of the image the processor resized* (``smart_resize``). Mapping
  them back needs that size: ``VLMGRPOTrainer`` and ``vlm_grpo.evaluate`` add it to every row as
  ``fed_image_size`` (see :func:`vlm_grpo.data.rows.add_image_sizes`).

Gold boxes (column ``bbox``) are in the original image's pixels (or 0–1 with ``gold_frame="normalized"``), as
corners ``[x1, y1, x2, y2]`` unless ``box_format="xywh"`` declares COCO's ``[x, y, width, height]``. IoU does not
change when each axis is scaled, so both boxes are compared as fractions of their image.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..families import FAMILIES
from .adaptor import BatchReward, RewardFunc
from .parsing import conclusion, final_segment, last_answer_tag

__all__ = ["FRAMES", "box_iou", "coordinate_frame_for", "iou", "iou_threshold", "make_iou_reward", "parse_box"]

FRAMES = ("pixels", "normalized", "qwen2_vl", "qwen2_5_vl")
Frame = Literal["pixels", "normalized", "qwen2_vl", "qwen2_5_vl"]
# model_type -> the frame that family writes boxes in, from the family records (`vlm_grpo.families`).
_MODEL_FRAMES = {t: f.box_frame for t, f in FAMILIES.items() if f.box_frame is not None}

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
# Maximal comma-separated runs of numbers; only runs of exactly four are boxes ("[1, 2, 3, 4, 5]" is not).
_NUMBER_RUN_RE = re.compile(rf"(?<![\w.]){_NUM}(?:\s*,\s*{_NUM})*(?![\w.])")
# Qwen2-VL's corner pairs "(x1,y1),(x2,y2)".
_CORNER_PAIR_RE = re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")


def _ordered(box: Sequence[float]) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def _boxes_in(text: str) -> list[list[float]]:
    boxes = [[float(p) for p in m.group(0).split(",")] for m in _NUMBER_RUN_RE.finditer(text)]
    boxes = [b for b in boxes if len(b) == 4]
    boxes += [[float(g) for g in m.groups()] for m in _CORNER_PAIR_RE.finditer(text)]
    return [_ordered(b) for b in boxes]


def parse_box(text: str) -> list[float] | None:
    """The one box a completion answers with, as ``[x1, y1, x2, y2]`` (corners sorted), or None.

    Read from the last answer tag after the thinking if there is one, else from the text after ``</think>``.
    Notations: ``[x1, y1, x2, y2]``, ``(x1, y1, x2, y2)``, bare ``x1,y1,x2,y2``, Qwen2.5-VL JSON ``{"bbox_2d":
    [...]}`` and Qwen2-VL ``(x1,y1),(x2,y2)``. Several *distinct* boxes give None (zero credit): scoring the best or
    the last of several would pay a model for scattering guesses. The same box repeated counts once.
    """
    tagged = last_answer_tag(conclusion(text))
    boxes = {tuple(b) for b in _boxes_in(tagged if tagged is not None else final_segment(text))}
    return list(boxes.pop()) if len(boxes) == 1 else None


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes in one frame (corners in either order); 0.0 when
    the union has no area."""
    ax1, ay1, ax2, ay2 = _ordered(a)
    bx1, by1, bx2, by2 = _ordered(b)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def coordinate_frame_for(model_type: str) -> str:
    """The frame a model family writes boxes in (``config.model_type``: ``"qwen2_5_vl"`` -> ``"qwen2_5_vl"``, Qwen2-VL
    and Qwen3-VL -> ``"qwen2_vl"``); ValueError for a family without a known native frame."""
    if model_type not in _MODEL_FRAMES:
        raise ValueError(f"No known box frame for model type {model_type!r}; pass coordinate_frame= one of {FRAMES}.")
    return _MODEL_FRAMES[model_type]


def _size(value: Any, column: str) -> tuple[float, float]:
    if isinstance(value, Mapping):
        value = (value.get("width"), value.get("height"))
    try:
        width, height = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"Column `{column}` must hold (width, height), got {value!r}.") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"Column `{column}` must hold a positive (width, height), got {value!r}.")
    return width, height


def _original_size(row: Mapping[str, Any]) -> tuple[float, float]:
    declared, measured = row.get("image_size"), row.get("source_image_size")
    if declared is None and measured is None:
        raise ValueError("Converting boxes needs the image's size: add an `image_size` column of (width, height), or "
                         "train / evaluate with VLMGRPOTrainer / vlm_grpo.evaluate, which add `source_image_size`.")  # fmt: skip
    if declared is not None and measured is not None and _size(declared, "image_size") != _size(measured, "x"):
        raise ValueError(f"Column `image_size` says {declared!r} but the row's image is {measured!r}: fix the column.")
    return _size(declared if declared is not None else measured, "image_size")


class IoUScorer:
    """IoU of one prediction (a class, so the reward pickles for TRL's async rollout worker)."""

    def __init__(self, threshold: float | None, coordinate_frame: str, box_format: str, gold_frame: str) -> None:
        self.threshold, self.frame, self.box_format, self.gold_frame = (
            threshold,
            coordinate_frame,
            box_format,
            gold_frame,
        )

    def _gold(self, value: Any) -> list[float]:
        if isinstance(value, Mapping):
            value = value.get("bbox_2d", value.get("bbox"))
        box = _boxes_in(value)[0] if isinstance(value, str) and len(_boxes_in(value)) == 1 else value
        try:
            x1, y1, a, b = (float(v) for v in box)
        except (TypeError, ValueError):
            raise ValueError(f"Column `bbox` must hold one box of four numbers, got {value!r}.") from None
        x2, y2 = (x1 + a, y1 + b) if self.box_format == "xywh" else (a, b)
        if x2 <= x1 or y2 <= y1:
            hint = "" if self.box_format == "xywh" else " If it is COCO's [x, y, w, h], pass box_format='xywh'."
            raise ValueError(f"Gold box {value!r} is not {self.box_format} with positive area.{hint}")
        return [x1, y1, x2, y2]

    def _unit(self, box: list[float], frame: str, row: Mapping[str, Any]) -> list[float]:
        """A box as fractions of its image's width and height."""
        if frame == "normalized":
            return box
        if frame == "qwen2_vl":
            return [v / 1000.0 for v in box]
        if frame == "qwen2_5_vl":
            if row.get("fed_image_size") is None:
                raise ValueError("coordinate_frame='qwen2_5_vl' needs column `fed_image_size` (the size the processor "
                                 "resized the image to); VLMGRPOTrainer and vlm_grpo.evaluate add it.")  # fmt: skip
            width, height = _size(row["fed_image_size"], "fed_image_size")
        else:
            width, height = _original_size(row)
        return [box[0] / width, box[1] / height, box[2] / width, box[3] / height]

    def __call__(self, text: str, gold: Any, /, **row: Any) -> float:
        gold_box, pred = self._gold(gold), parse_box(text)
        if pred is None:  # no box, or several: the model failed to commit to one location
            return 0.0
        if self.frame != self.gold_frame:
            pred, gold_box = self._unit(pred, self.frame, row), self._unit(gold_box, self.gold_frame, row)
        value = box_iou(pred, gold_box)
        return value if self.threshold is None else float(value >= self.threshold)


def make_iou_reward(
    threshold: float | None = None,
    coordinate_frame: Frame = "pixels",
    *,
    box_format: Literal["xyxy", "xywh"] = "xyxy",
    gold_frame: Literal["pixels", "normalized"] = "pixels",
) -> RewardFunc:
    """Build a grounding reward: the IoU of the completion's one box (:func:`parse_box`) with column ``bbox``.

    Args:
        threshold: None for the continuous IoU; else 1.0 when IoU >= threshold, 0.0 otherwise.
        coordinate_frame: The frame the model writes boxes in (module doc; :func:`coordinate_frame_for` maps a
            ``model_type`` to it). Sizes come from columns ``image_size`` / ``source_image_size`` (original) and
            ``fed_image_size`` (Qwen2.5-VL); a conversion that lacks one raises ``ValueError`` naming it.
        box_format: Layout of the gold boxes: corners ``"xyxy"`` or COCO ``"xywh"``.
        gold_frame: ``"pixels"`` of the original image, or ``"normalized"`` 0–1.

    Returns:
        A picklable reward named ``iou`` / ``iou_at_50`` (plus ``_<frame>`` for a non-pixel frame). No box or
        several distinct boxes score 0.0; a None gold gives None.
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}.")
    if coordinate_frame not in FRAMES:
        raise ValueError(f"coordinate_frame must be one of {FRAMES}, got {coordinate_frame!r}.")
    if box_format not in ("xyxy", "xywh") or gold_frame not in ("pixels", "normalized"):
        raise ValueError(f"box_format must be 'xyxy' or 'xywh' and gold_frame 'pixels' or 'normalized', got "
                         f"{box_format!r}, {gold_frame!r}.")  # fmt: skip
    name = "iou" if threshold is None else "iou_at_" + f"{threshold * 100:g}".replace(".", "_")
    name += "" if coordinate_frame == "pixels" else f"_{coordinate_frame}"
    scorer = IoUScorer(threshold, coordinate_frame, box_format, gold_frame)
    columns = ("image_size", "source_image_size", "fed_image_size")
    return BatchReward(scorer, "bbox", name=name, columns=columns, prediction=parse_box)


#: Continuous IoU, boxes in the original image's pixels (see :func:`make_iou_reward`).
iou = make_iou_reward()
#: 1.0 when IoU >= 0.5, else 0.0, boxes in the original image's pixels.
iou_threshold = make_iou_reward(0.5)

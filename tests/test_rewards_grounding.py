"""Grounding: one box parsed, IoU in the model's own frame, COCO golds declared, several boxes refused."""

from __future__ import annotations

import pickle

import pytest

from vlm_grpo.rewards import box_iou, coordinate_frame_for, iou, iou_threshold, make_iou_reward, parse_box

# (label, completion, parsed box or None)
BOX_CASES = [
    ("list", "[10, 20, 30, 40]", [10, 20, 30, 40]),
    ("tuple", "box: (10,20,30,40)", [10, 20, 30, 40]),
    ("bare", "10, 20, 30, 40", [10, 20, 30, 40]),
    ("qwen2.5 json", '```json\n[{"bbox_2d": [12, 34, 56, 78], "label": "dog"}]\n```', [12, 34, 56, 78]),
    ("qwen2 corner pairs", "<|box_start|>(100,200),(300,400)<|box_end|>", [100, 200, 300, 400]),
    ("reversed corners", "[30, 40, 10, 20]", [10, 20, 30, 40]),
    ("decimals", "[0.5, 0.1, 0.2, 0.9]", [0.2, 0.1, 0.5, 0.9]),
    ("same box twice counts once", "[1, 2, 3, 4] so [1, 2, 3, 4]", [1, 2, 3, 4]),
    ("tag first", "<answer>[1, 2, 3, 4]</answer> later [5, 6, 7, 8]", [1, 2, 3, 4]),
    ("reasoning boxes ignored", "<think>[9, 9, 19, 19]?</think> [1, 2, 3, 4]", [1, 2, 3, 4]),
    ("two distinct boxes", "first [1, 2, 3, 4] then [5, 6, 7, 8]", None),
    ("two boxes in the tag", "<answer>[1, 2, 3, 4], [5, 6, 7, 8]</answer>", None),
    ("json with two objects", '[{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8]}]', None),
    ("committed answer without a box", "<answer>the red one</answer> at [5, 6, 7, 8]", None),
    ("three numbers", "[1, 2, 3]", None),
    ("five numbers", "[1, 2, 3, 4, 5]", None),
    ("letters", "[a, b, c, d]", None),
    ("empty", "", None),
]


@pytest.mark.parametrize(("text", "box"), [c[1:] for c in BOX_CASES], ids=[c[0] for c in BOX_CASES])
def test_parse_box(text: str, box: list[float] | None) -> None:
    assert parse_box(text) == box


def test_box_iou_matches_the_torchvision_formula() -> None:
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 2, 2], [1, 0, 3, 2]) == pytest.approx(1 / 3)
    assert box_iou([2, 2, 0, 0], [1, 0, 3, 2]) == pytest.approx(1 / 3)
    assert box_iou([0, 0, 1, 1], [1, 0, 2, 1]) == 0.0  # touching edges
    assert box_iou([1, 1, 1, 1], [1, 1, 1, 1]) == 0.0  # no area


def test_qwen2_5_vl_boxes_are_mapped_back_from_the_resized_image() -> None:
    # Issue 15: a 1920x1080 image fed at 812x476 (max_pixels=401408): the perfect box in the fed frame must score 1.
    gold = [480.0, 270.0, 1440.0, 810.0]
    pred = f"[{480 * 812 / 1920}, {270 * 476 / 1080}, {1440 * 812 / 1920}, {810 * 476 / 1080}]"
    qwen = make_iou_reward(coordinate_frame="qwen2_5_vl")
    sizes = {"source_image_size": [(1920, 1080)], "fed_image_size": [(812, 476)]}
    assert qwen(None, [pred], bbox=[gold], **sizes) == [pytest.approx(1.0)]
    assert iou(None, [pred], bbox=[gold], **sizes)[0] < 0.3  # read as original pixels it is far off
    with pytest.raises(ValueError, match="fed_image_size"):
        qwen(None, [pred], bbox=[gold], image_size=[(1920, 1080)])


@pytest.mark.parametrize(
    ("frame", "pred"),
    [("qwen2_vl", "(250,250),(750,750)"), ("normalized", "[0.25, 0.25, 0.75, 0.75]"), ("pixels", "[50, 25, 150, 75]")],
)
def test_frames_chosen_by_name_not_guessed(frame: str, pred: str) -> None:
    reward = make_iou_reward(coordinate_frame=frame)
    assert reward(None, [pred], bbox=[[50, 25, 150, 75]], image_size=[{"width": 200, "height": 100}]) == [
        pytest.approx(1.0)
    ]


def test_normalized_prediction_is_not_rescued_in_the_pixel_frame() -> None:
    # The old "auto" mode guessed a 0-1 box and rescaled it; the pixel frame compares what the model wrote.
    assert iou(None, ["[0.25, 0.25, 0.75, 0.75]"], bbox=[[50, 25, 150, 75]], image_size=[(200, 100)]) == [0.0]


def test_coco_xywh_gold_must_be_declared() -> None:
    coco = make_iou_reward(box_format="xywh")
    assert coco(None, ["[10, 20, 40, 60]"], bbox=[[10, 20, 30, 40]]) == [1.0]
    with pytest.raises(ValueError, match="box_format='xywh'"):  # [x, y, w, h] with w < x reads as inverted corners
        iou(None, ["[10, 20, 40, 60]"], bbox=[[10, 20, 5, 8]])


def test_image_size_column_must_agree_with_the_image() -> None:
    reward = make_iou_reward(coordinate_frame="normalized")
    with pytest.raises(ValueError, match="image_size"):
        reward(None, ["[0, 0, 1, 1]"], bbox=[[0, 0, 10, 10]], image_size=[(10, 10)], source_image_size=[(20, 20)])
    with pytest.raises(ValueError, match="image_size"):
        reward(None, ["[0, 0, 1, 1]"], bbox=[[0, 0, 10, 10]])


def test_iou_rewards_several_boxes_score_zero_and_threshold() -> None:
    golds = [[0, 0, 2, 2]] * 4 + [None]
    completions = ["[0, 0, 2, 2]", "[0, 0, 2, 2] or [4, 4, 6, 6]", "[0, 0, 2, 1]", "nothing", "[0, 0, 1, 1]"]
    assert iou(None, completions, bbox=golds) == [1.0, 0.0, 0.5, 0.0, None]
    assert iou_threshold(None, completions, bbox=golds) == [1.0, 0.0, 1.0, 0.0, None]
    assert iou(None, ["[0, 0, 2, 2]"] * 2, bbox=["[0, 0, 2, 2]", {"bbox_2d": [0, 0, 2, 2]}]) == [1.0, 1.0]


def test_names_errors_and_pickling() -> None:
    assert (iou.__name__, iou_threshold.__name__) == ("iou", "iou_at_50")
    assert make_iou_reward(0.75, "qwen2_5_vl").__name__ == "iou_at_75_qwen2_5_vl"
    assert pickle.loads(pickle.dumps(iou)) is iou
    clone = pickle.loads(pickle.dumps(iou_threshold))
    assert clone(None, ["[0, 0, 2, 2]"], bbox=[[1, 0, 3, 2]]) == [0.0]
    for bad in ({"threshold": 1.5}, {"coordinate_frame": "auto"}, {"box_format": "cxcywh"}):
        with pytest.raises(ValueError):
            make_iou_reward(**bad)
    with pytest.raises(ValueError, match="`bbox`"):
        iou(None, ["[0, 0, 1, 1]"], box=[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="bbox"):
        iou(None, ["[0, 0, 1, 1]"], bbox=[[1, 2, 3]])
    assert coordinate_frame_for("qwen2_5_vl") == "qwen2_5_vl" and coordinate_frame_for("qwen3_vl") == "qwen2_vl"
    with pytest.raises(ValueError, match="coordinate_frame"):
        coordinate_frame_for("gemma3")

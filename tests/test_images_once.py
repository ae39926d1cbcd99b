"""Each distinct image of a batch through the image processor once (`media.images_once`): the outputs of one plain
call over all images, with the real tiny Qwen2.5-VL processor and PIL images."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vlm_grpo.media.images_once import images_processed_once
from vlm_grpo.models.loader import FastVisionModel


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_a_batch_processes_each_distinct_image_once_with_the_plain_calls_outputs(tiny_dir):
    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    plain = processor.image_processor
    originals = [_image(0, (56, 84)), _image(1, (84, 56))]
    crops = [_image(2, (28, 28)), _image(3, (56, 28))]
    # what TRL's tool loop hands it at each turn: every row's images so far, the group's rows repeating the prompt's
    # image as separate objects with the same pixels
    turns = [[img.copy() for img in originals for _ in range(4)],
             [[o.copy(), c] for o, c in zip(originals * 4, crops * 4, strict=True)]]  # fmt: skip
    processed = []
    with images_processed_once(processor):
        memo = processor.image_processor
        assert memo.merge_size == plain.merge_size  # the processor's attributes read through
        inner_calls = []
        memo._inner = lambda images, **kw: inner_calls.append(len(images)) or plain(images, **kw)  # counts, then runs
        outputs = [processor.image_processor(images=batch, return_tensors="pt") for batch in turns]
        processed = list(inner_calls)
    assert processor.image_processor is plain  # restored after the batch
    for batch, out in zip(turns, outputs, strict=True):
        expected = plain(images=batch, return_tensors="pt")
        assert torch.equal(out["pixel_values"], expected["pixel_values"])
        assert torch.equal(out["image_grid_thw"], expected["image_grid_thw"])
    assert processed == [2, 2]  # two distinct originals, then only the two crops


def test_other_calls_reach_the_processor_unchanged(tiny_dir):
    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    images = [_image(0, (56, 56))]
    with images_processed_once(processor):
        listed = processor.image_processor(images=images)  # no tensors asked for: the processor's own answer
    assert set(listed.keys()) == {"pixel_values", "image_grid_thw"}
    with images_processed_once(processor, active=False):
        assert processor.image_processor.__class__.__name__ != "_Memo"


def test_a_processor_without_per_image_grids_is_called_as_it_is(tiny_dir):
    # Gemma 3's processor returns pixel values and crop counts: no memo is put in front of it.
    _, processor = FastVisionModel.from_pretrained(tiny_dir("gemma3"))
    plain = processor.image_processor
    images = [_image(0, (56, 56)), _image(1, (56, 56))]
    with images_processed_once(processor):
        outs = [processor.image_processor(images=images, return_tensors="pt") for _ in range(2)]
        assert processor.image_processor is plain
    expected = plain(images=images, return_tensors="pt")
    assert all(torch.equal(out["pixel_values"], expected["pixel_values"]) for out in outs)


def test_palette_images_differing_only_in_palette_are_two_images_and_the_memo_copies(tiny_dir):
    import copy
    import pickle

    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    plain = processor.image_processor
    indices = Image.fromarray(np.random.default_rng(0).integers(0, 4, (56, 56), dtype=np.uint8), mode="P")
    red, blue = indices.copy(), indices.copy()
    red.putpalette([255, 0, 0, 0, 0, 0, 9, 9, 9, 50, 50, 50])
    blue.putpalette([0, 0, 255, 0, 0, 0, 9, 9, 9, 50, 50, 50])
    with images_processed_once(processor):
        out = processor.image_processor(images=[red, blue], return_tensors="pt")
        copy.deepcopy(processor.image_processor)  # a processor copied or pickled mid-batch (its repr, a save)
        pickle.loads(pickle.dumps(processor.image_processor))
    expected = plain(images=[red, blue], return_tensors="pt")
    assert torch.equal(out["pixel_values"], expected["pixel_values"])
    half = len(out["pixel_values"]) // 2
    assert not torch.equal(out["pixel_values"][:half], out["pixel_values"][half:])

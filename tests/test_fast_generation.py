"""The fast generation path gives what TRL's plain `model.generate` path gives, on every tiny family.

Each test drives a real `VLMGRPOTrainer`: TRL's own `_tokenize_prompts` turns rows into token ids and
processor outputs, TRL's `_generate_single_turn` is the plain path, `trainer.fast_generator` the fast one.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from trl.data_utils import prepare_multimodal_messages
from trl.trainer.grpo_trainer import GRPOTrainer

from vlm_grpo.data.rows import prepare_row
from vlm_grpo.engine.fast_generation import FastPathUnavailable
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "idefics3", "qwen3_5", "qwen3_5_moe", "lfm2_vl",
            "llava_onevision", "paligemma", "glm4v", "glm46v", "internvl", "smolvlm", "mistral3"]  # fmt: skip


def _image(seed: int, size: int = 32) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


IMAGE, TEXT = {"type": "image"}, lambda text: {"type": "text", "text": text}
# One prompt with one image, one with none, one with two images of different sizes.
ROWS = [
    {"prompt": _user(IMAGE, TEXT("what colour is it?")), "images": [_image(0)]},
    {"prompt": _user(TEXT("no image in this one")), "images": []},
    {"prompt": _user(IMAGE, IMAGE, TEXT("which is brighter?")), "images": [_image(1), _image(2, 48)]},
]


def _zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(tiny_dir, tmp_path, family="qwen2_5_vl", generations=3, lora_b=0.0, config=None, **generation_kwargs):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4)
    if lora_b:  # a trained-looking adapter, so merging it changes the weights
        torch.manual_seed(0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, lora_b)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(ROWS) * generations,
        num_generations=generations, max_completion_length=8, report_to="none", use_cpu=True, max_steps=1,
        generation_kwargs={"do_sample": False, "min_new_tokens": 6, **generation_kwargs}, **(config or {}),
    )  # fmt: skip
    dataset = Dataset.from_list(ROWS)  # distinct prompts, so every batch has exactly three groups
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=dataset, processing_class=processor)


def _batch(trainer, rows, generations):
    """What TRL hands `_generate_single_turn` for `rows`, each repeated `generations` times."""
    prepared = [prepare_row(row) for row in rows for _ in range(generations)]
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in prepared]
    return trainer._tokenize_prompts(prompts)


def _plain(trainer, batch, generations):
    FastVisionModel.for_inference(trainer.model)
    return GRPOTrainer._generate_single_turn(trainer, *batch, generations)[0]


def _fast(trainer, batch):
    FastVisionModel.for_inference(trainer.model)
    pad = trainer._tokenizer.pad_token_id
    return trainer.fast_generator.generate(trainer.model, *batch, trainer.generation_config, pad)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_the_plain_path(tiny_dir, tmp_path, family):
    trainer = _trainer(tiny_dir, tmp_path, family)
    rows = [row for row in ROWS if row["images"]] if family == "paligemma" else ROWS  # PaliGemma: images required
    batch = _batch(trainer, rows, 3)
    plain, fast = _plain(trainer, batch, 3), _fast(trainer, batch)
    assert fast == plain
    assert min(len(c) for c in fast) >= 6  # min_new_tokens honoured: real decoding happened
    # One prefill per distinct prompt: 3 prompts x 3 completions -> 3 prefilled rows.
    stats = trainer.fast_generator.stats
    assert stats["prefill_rows"] == len(rows) and stats["rows"] == 3 * len(rows)


@pytest.mark.parametrize("generations", [1, 16])
def test_group_sizes_one_and_sixteen(tiny_dir, tmp_path, generations):
    # Training needs two generations per prompt (TRL); groups of one are what evaluation generates.
    trainer = _trainer(tiny_dir, tmp_path, generations=max(generations, 2))
    batch = _batch(trainer, ROWS[:1] + ROWS[2:], generations)
    assert _fast(trainer, batch) == _plain(trainer, batch, generations)
    assert trainer.fast_generator.stats["prefill_rows"] == 2


@pytest.mark.parametrize(
    "settings, inside",
    [
        ({"do_sample": False, "min_new_tokens": 4}, True),  # counted on the device (`token_loop.MinNewTokensOnDevice`)
        ({"do_sample": True, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "min_new_tokens": 0}, True),
        # A repetition penalty reads the ids generated so far: sampled on the host, after the step.
        ({"do_sample": True, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2},
         False),
    ],
    ids=["greedy", "seeded-sampling", "seeded-sampling-repetition-penalty"],
)  # fmt: skip
def test_greedy_and_seeded_sampling_give_the_plain_paths_tokens(tiny_dir, tmp_path, settings, inside):
    # Processors that read only the scores are sampled inside the decode step (`engine.token_loop`: what a recorded
    # CUDA graph replays on a GPU); the sampler is then kept, and reused while the settings stay.
    trainer = _trainer(tiny_dir, tmp_path, generations=4, lora_b=0.05, **settings)
    batch = _batch(trainer, ROWS, 4)
    torch.manual_seed(7)
    plain = _plain(trainer, batch, 4)
    torch.manual_seed(7)
    fast = _fast(trainer, batch)
    assert fast == plain
    kept = trainer.fast_generator._kept_sampler
    assert (kept is not None) == inside
    assert trainer.fast_generator.stats["decode_steps"] > 1
    if settings["do_sample"]:
        assert len({tuple(c) for c in fast[:4]}) > 1  # really sampled: one prompt's completions differ
    torch.manual_seed(7)
    assert _fast(trainer, batch) == plain and trainer.fast_generator._kept_sampler is kept


def test_min_new_tokens_holds_eos_back_inside_the_step_as_generate_does(tiny_dir, tmp_path):
    # EOS is made the token greedy decoding picks first, so without min_new_tokens the first completion is [EOS]: only
    # the count of new tokens (on the device, `token_loop.MinNewTokensOnDevice`) keeps it going.
    probe = _trainer(tiny_dir, tmp_path, generations=2, lora_b=0.05, min_new_tokens=0)
    eos = _plain(probe, _batch(probe, ROWS, 2), 2)[0][0]
    ended = _trainer(tiny_dir, tmp_path, generations=2, lora_b=0.05, min_new_tokens=0, eos_token_id=[eos])
    assert _fast(ended, _batch(ended, ROWS, 2))[0] == [eos]
    trainer = _trainer(tiny_dir, tmp_path, generations=2, lora_b=0.05, min_new_tokens=4, eos_token_id=[eos])
    batch = _batch(trainer, ROWS, 2)
    fast = _fast(trainer, batch)
    assert trainer.fast_generator._kept_sampler is not None  # sampled inside the step
    # TRL pads after its tokenizer's EOS, not the generation config's: compared up to the first `eos`.
    plain = [row[: row.index(eos) + 1] if eos in row else row for row in _plain(trainer, batch, 2)]
    assert fast == plain
    assert eos not in fast[0][:4] and len(fast[0]) > 4


@pytest.mark.trains
def test_training_uses_the_fast_path_and_the_switch_turns_it_off(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    trainer.args.max_steps = 2
    trainer.train()
    stats = trainer.fast_generator.stats
    assert stats["calls"] == 2 and stats["rows"] == 18 and stats["prefill_rows"] == 6
    plain = _trainer(tiny_dir, tmp_path)
    plain.args.fast_generation = False
    plain.train()
    assert plain.fast_generator.stats["calls"] == 0


@pytest.mark.trains
@pytest.mark.parametrize(
    "family, settings, reason",
    [
        # Tiny Gemma 3 has a 64-token sliding window; a long completion budget would roll the copied prefill.
        ("gemma3", {"max_new_tokens": 60, "min_new_tokens": 1}, "sliding window"),
        ("qwen2_5_vl", {"num_beams": 2}, "num_beams"),  # beam search is generate's, not the fast loop's
    ],
)
def test_a_batch_the_fast_path_cannot_serve_falls_back_once_with_the_reason(
    tiny_dir, tmp_path, caplog, family, settings, reason
):
    trainer = _trainer(tiny_dir, tmp_path, family, **settings)
    trainer.args.max_steps = 2
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.training.trainer"):
        trainer.train()
    messages = [r.getMessage() for r in caplog.records if "Fast generation is off" in r.getMessage()]
    assert len(messages) == 1 and reason in messages[0]
    assert trainer.fast_generator.stats["calls"] == 0


def test_max_time_is_left_to_generate(tiny_dir, tmp_path):
    # generate stops every row once max_time has passed; the fast loop keeps no clock, so it refuses the batch (the
    # route then takes generate's path, as for num_beams above) rather than run past the time asked.
    trainer = _trainer(tiny_dir, tmp_path, max_time=600.0)
    with pytest.raises(FastPathUnavailable, match="max_time"):
        _fast(trainer, _batch(trainer, ROWS[:1], 3))


@pytest.mark.slow
def test_compiled_decode_matches_and_one_graph_serves_several_prompt_lengths(tiny_dir, tmp_path):
    import torch._dynamo.utils

    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    trainer.fast_generator.compile = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    for row in (ROWS[0], ROWS[2]):  # prompt lengths differ, the cache bucket does not
        batch = _batch(trainer, [row], 2)
        assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_freeing_the_decode_memory_after_each_call_keeps_the_tokens_and_the_compiled_graph(tiny_dir, tmp_path, family):
    import torch._dynamo.utils

    # LoRA merged (a trained-looking adapter): the stacked q/k/v copy exists; Qwen3.5: linear-attention states too.
    trainer = _trainer(tiny_dir, tmp_path, family=family, generations=2, lora_b=0.05,
                       config={"fast_generation_keep_decode_memory": False})  # fmt: skip
    generator = trainer.fast_generator
    assert generator.keep_decode_memory is False  # the config reached the generator
    generator.compile = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    batch = _batch(trainer, ROWS[:1], 2)
    plain = _plain(trainer, batch, 2)
    graphs = []
    for _ in range(2):
        assert _fast(trainer, batch) == plain
        assert not generator._decode_caches.caches and not generator._decode_caches.decode_buffers
        assert generator._fused is None and not generator._graphs.recordings
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # New caches, the same compiled step (one graph per kind of decoder layer: Qwen3.5 has two)
    assert graphs[1] == graphs[0] == (2 if family == "qwen3_5" else 1)
    generator.keep_decode_memory = True  # the default keeps them for the next call
    assert _fast(trainer, batch) == plain and generator._decode_caches.caches
    assert family != "qwen2_5_vl" or generator._fused is not None


def test_turns_that_grow_decode_in_the_kept_longer_cache_with_the_same_tokens(tiny_dir, tmp_path):
    # Three prompt lengths a bucket apart, in growing order twice, like a tool rollout's turns in two steps: with one
    # cache per length, at most two kept, each call evicted the cache (and CUDA graph) the next one needed.
    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    generator = trainer.fast_generator
    generator.cache_bucket = 4  # the tiny prompts' lengths (+ 8 new tokens) fall in different buckets
    batches = [_batch(trainer, [row], 2) for row in (ROWS[1], ROWS[0], ROWS[2])]
    needed = [-(-(len(batch[0][0]) + 8) // 4) for batch in batches]
    assert needed == sorted(needed) and len(set(needed)) == 3, needed
    for batch in batches:
        assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    kept = {key: id(cache) for key, cache in generator._decode_caches.caches.items()}
    assert len(kept) == 2
    for batch in batches:  # the second "step": every call fits a kept cache, so nothing is allocated
        assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert {key: id(cache) for key, cache in generator._decode_caches.caches.items()} == kept


def test_with_turn_headroom_every_turn_decodes_in_the_first_turns_cache(tiny_dir, tmp_path):
    # A tool trainer's generator keeps TRL's completion budget free beyond the first turn: the later, longer turns
    # fit the first turn's cache, so one cache (one compiled graph, one recording) serves the whole rollout.
    import torch._dynamo.utils

    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    generator = trainer.fast_generator
    generator.cache_bucket, generator.turn_headroom, generator.compile = 4, 16, True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    batches = [_batch(trainer, [row], 2) for row in (ROWS[1], ROWS[0], ROWS[2])]
    assert len(batches[2][0][0]) - len(batches[0][0][0]) <= 16  # the turns' growth fits the headroom
    for batch in batches:
        assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert len(generator._decode_caches.caches) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the decode step compiled once


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")
def test_a_tool_trainer_keeps_its_completion_budget_as_headroom(tiny_dir, tmp_path):
    from vlm_grpo.tools import image_tools

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_vl", tools=True))
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=160, report_to="none", use_cpu=True)  # fmt: skip
    with_tools = VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(ROWS),
                                processing_class=processor, environment_factory=image_tools("zoom"))  # fmt: skip
    assert with_tools.fast_generator.turn_headroom == 160
    assert _trainer(tiny_dir, tmp_path).fast_generator.turn_headroom == 0  # one turn: no headroom


# ----- clips (Qwen-VL): the same tokens as the plain path, clips' temporal positions included -----

VIDEO_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


def _clip(seed: int, frames: int, size: tuple[int, int] = (56, 56)) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(frames)]


# A clip alone, a clip beside an image (odd frame count, another size), and text alone.
CLIP_ROWS = [
    {"prompt": "Which way does it move? <video>", "video": _clip(0, 4), "image": None},
    {"prompt": "<image> and <video>: same colour?", "video": _clip(1, 3, (48, 56)), "image": _image(3)},
    {"prompt": "no clip in this one", "video": None, "image": None},
]


def _clip_trainer(tiny_dir, tmp_path, family, generations=3):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(CLIP_ROWS) * generations,
        num_generations=generations, max_completion_length=8, report_to="none", use_cpu=True, max_steps=1,
        generation_kwargs={"do_sample": False, "min_new_tokens": 6},
    )  # fmt: skip
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(CLIP_ROWS),
                          processing_class=processor)  # fmt: skip


def _clip_batch(trainer, rows, generations):
    """What the trainer hands `_generate_single_turn` for rows with clips, each repeated `generations` times."""
    prepared = [
        prepare_row(row, trainer.pixel_budget, trainer.video_budget) for row in rows for _ in range(generations)
    ]
    return trainer._tokenize_prompts([row["prompt"] for row in prepared])


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_greedy_tokens_on_clips_match_the_plain_path(tiny_dir, tmp_path, family):
    trainer = _clip_trainer(tiny_dir, tmp_path, family)
    batch = _clip_batch(trainer, CLIP_ROWS, 3)
    assert "pixel_values_videos" in batch[2] and batch[2]["video_grid_thw"].shape[0] == 2 * 3
    plain, fast = _plain(trainer, batch, 3), _fast(trainer, batch)
    assert fast == plain
    assert min(len(c) for c in fast) >= 6
    assert trainer.fast_generator.stats["prefill_rows"] == 3 and trainer.fast_generator.stats["rows"] == 9
    # The clip is what the model sees: other frames change the greedy completions of that prompt.
    other = _clip_batch(trainer, [{**CLIP_ROWS[0], "video": _clip(7, 4)}], 3)
    assert _fast(trainer, other) == _plain(trainer, other, 3)
    if family == "qwen2_5_vl":  # (checked on one family: a random tiny model may ignore a small change)
        assert _fast(trainer, other)[0] != fast[0]

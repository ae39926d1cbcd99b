"""A tool turn's rows continue the previous call's KV cache (`engine.prefill.TurnCache`): the same tokens and
sampler log-probs as prefilling the whole conversation again, with fewer tokens prefilled, through TRL's real tool
loop on the tiny Qwen3-VL (its call forced, the reply after the tool's image decoded freely and greedily)."""

from __future__ import annotations

import pytest
import torch

from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tools import image_tools
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")

CALL = '<tool_call>\n{"name": "zoom", "arguments": {"x1": 0, "y1": 0, "x2": 32, "y2": 32, "factor": 4}}\n</tool_call>'


def _forcing(context: list[int], reply: list[int]) -> list:
    """A `sequence_bias` that makes greedy decoding write `reply` after `context` (the longest match wins)."""
    return [[context + reply[: i + 1], 2.0 ** (len(context) + i + 1)] for i in range(len(reply))]


def _rollouts(tiny_dir, tmp_path, append: bool, turns: int, end: str = "<|im_end|>") -> tuple[dict, dict]:
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_vl", tools=True, words=answer_words("zoom", 1)))
    model = FastVisionModel.get_peft_model(model, r=4, random_state=0)
    torch.manual_seed(1)
    with torch.no_grad():  # an adapter that does something, merged while generating like a trained one
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    rows = make_visual_reasoning_dataset("zoom", 4)
    args = VLMGRPOConfig(output_dir=str(tmp_path / str(append)), per_device_train_batch_size=4, num_generations=2,
                         max_completion_length=160, max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                         disable_tqdm=True, seed=0, max_tool_calling_iterations=turns, beta=0.0)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [lambda completions, **kw: [0.0] * len(completions)], args=args,
                             train_dataset=rows, processing_class=processor, environment_factory=image_tools("zoom"))  # fmt: skip
    trainer.fast_generator.append_turns = append
    tok = processor.tokenizer

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    # The first turn calls zoom (forced); the turn after the tool's reply is the model's own greedy choice, read off
    # the cache that turn continues.
    trainer.generation_config.sequence_bias = _forcing(ids(".<|im_end|>\n<|im_start|>assistant\n"),
                                                       ids(CALL + end))  # fmt: skip
    if end != "<|im_end|>":  # the turn cut by its length right after `end`, as a random model's turns are
        trainer.generation_config.max_new_tokens = len(ids(CALL + end))
    trainer.generation_config.do_sample = False
    return _scored_rollouts(trainer, rows)


def _scored_rollouts(trainer, rows) -> tuple[dict, dict]:
    """One batch of rollouts (two prompts of the same ids and different images, two each), what the loss scores for
    them, and the generator's counts so far."""
    out = trainer._generate_and_score_completions([rows[0], rows[0], rows[1], rows[1]])
    sequences = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():  # what the loss scores: TRL's forward over the whole conversations
        scored = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            sequences,
            mask,
            out["completion_ids"].shape[1],
            4,
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            num_images=out["num_images"],
            mm_token_type_ids=out["mm_token_type_ids"],
        )
    out["scored"] = scored[0]
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]  # TRL's own choice of the two
    assert not any(
        k.startswith("fast_generation/") for k in trainer._metrics["eval" if trainer.model.training else "train"]
    )
    out["logged"] = {k: v for k, v in metrics.items() if k.startswith("fast_generation/")}
    out["trainer"], out["rows"] = trainer, rows
    return out, dict(trainer.fast_generator.stats)


@pytest.mark.trains
def test_a_tool_turn_continues_the_cache_with_the_tokens_of_a_full_prefill(tiny_dir, tmp_path):
    """Two prompts of the same ids (an image is the same run of placeholders whatever its pixels) and different
    images, two rollouts each: every later turn continues its own row's cache (matched by ids and pixels), writes
    the tokens a full prefill writes, and samples from what the loss scores."""
    appended, with_append = _rollouts(tiny_dir, tmp_path, append=True, turns=2)
    full, without = _rollouts(tiny_dir, tmp_path, append=False, turns=2)
    assert without["appended_rows"] == 0 and with_append["appended_rows"] > 0  # the later turns continued the cache
    assert with_append["calls"] == without["calls"] >= 2  # the same turns
    assert with_append["prefill_tokens"] < 0.6 * without["prefill_tokens"]  # the conversation was not prefilled again
    logged = appended["logged"]  # per call: the first turn's prompts, then the tool turn's appended tokens
    assert sum(logged["fast_generation/prefill_tokens"]) == with_append["prefill_tokens"]
    assert logged["fast_generation/appended_rows"][0] == 0 and sum(logged["fast_generation/appended_rows"]) > 0
    mask = appended["completion_mask"].bool()
    assert torch.equal(appended["completion_ids"][mask], full["completion_ids"][full["completion_mask"].bool()])
    assert torch.equal(appended["tool_mask"], full["tool_mask"])
    # The tokens the model chose after the tool's reply (the call before it was forced, its log-probs biased).
    replied = mask & appended["tool_mask"].bool() & ((appended["tool_mask"] == 0).cumsum(1) > 0)
    assert replied.sum(1).min() >= 4
    ours, theirs = appended["sampling_per_token_logps"], full["sampling_per_token_logps"]
    assert torch.allclose(ours[replied], theirs[replied], atol=1e-5)
    assert float((appended["scored"] - ours).abs()[replied].max()) < 1e-5  # the loss scores what was sampled


@pytest.mark.trains
def test_a_sampled_vision_start_token_opens_no_image_in_the_appended_turn(tiny_dir, tmp_path):
    """A random model samples any id: a turn cut by its length right after a sampled `<|vision_start|>` leaves it
    first in the next turn's new tokens, where it opens no image. The appended turn takes the pixels of the tool's
    image alone (counting starts had taken two images' pixels for one image's placeholders: "Image features and
    image tokens do not match") and writes what a full prefill writes."""
    appended, with_append = _rollouts(tiny_dir, tmp_path, append=True, turns=1, end="<|vision_start|>")
    full, _ = _rollouts(tiny_dir, tmp_path, append=False, turns=1, end="<|vision_start|>")
    assert with_append["appended_rows"] > 0 and appended["trainer"]._metrics["train"]["tools/call_frequency"] == [1.0]
    assert torch.equal(appended["completion_ids"], full["completion_ids"])
    replied = appended["completion_mask"].bool() & appended["tool_mask"].bool()  # after the tool's reply: sampled
    replied &= (appended["tool_mask"] == 0).cumsum(1) > 0  # freely (the call before it was forced)
    assert (
        replied.any() and float((appended["scored"] - appended["sampling_per_token_logps"]).abs()[replied].max()) < 1e-5
    )


@pytest.mark.trains
def test_after_an_optimizer_step_the_turns_continue_caches_of_the_new_weights(tiny_dir, tmp_path):
    """The adapters changed in place and the step count moved on, as after an optimizer step: the next batch's tool
    turns continue caches made with the new weights, never the old ones (the loss scores what was sampled)."""
    first, _ = _rollouts(tiny_dir, tmp_path, append=True, turns=2)
    trainer = first["trainer"]
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    trainer.state.global_step += 1
    appended_before = trainer.fast_generator.stats["appended_rows"]
    second, stats = _scored_rollouts(trainer, first["rows"])
    assert stats["appended_rows"] > appended_before
    replied = second["completion_mask"].bool() & second["tool_mask"].bool()
    replied &= (second["tool_mask"] == 0).cumsum(1) > 0
    assert replied.any() and float((second["scored"] - second["sampling_per_token_logps"]).abs()[replied].max()) < 1e-5

    # With the decode memory freed after each rollout (fast_generation_keep_decode_memory=False): a rollout's turns
    # still continue their caches, the loss still scores what was sampled, and nothing is kept after the rollout.
    generator = trainer.fast_generator
    generator.keep_decode_memory = False
    trainer.state.global_step += 1
    appended_before = generator.stats["appended_rows"]
    third, stats = _scored_rollouts(trainer, first["rows"])
    assert stats["appended_rows"] > appended_before
    assert not generator._decode_caches.caches and generator._fused is None and generator.turns._last is None
    replied = third["completion_mask"].bool() & third["tool_mask"].bool()
    replied &= (third["tool_mask"] == 0).cumsum(1) > 0
    assert replied.any() and float((third["scored"] - third["sampling_per_token_logps"]).abs()[replied].max()) < 1e-5


def test_one_forward_appends_rows_of_different_lengths_as_a_full_prefill_would(tiny_dir):
    """Rows of a tool turn differ: cached prompts of different lengths (one with an image, one text only) and new
    tokens of different lengths (one with the tool's image, one without). `_append_forward` pads both inside one
    batch; each row's logits and cache are what a full prefill of its whole conversation gives."""
    import numpy as np
    from PIL import Image

    from vlm_grpo.engine.prefill import _append_forward, _Appended, full_prefill
    from vlm_grpo.media.batch_layout import left_padded
    from vlm_grpo.private_api import generation_position_ids

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), dtype=torch.float32)
    model.eval()
    images = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (56, 84, 3), dtype=np.uint8)) for s in (0, 1)]
    image = "<|vision_start|><|image_pad|><|vision_end|>"

    def encoded(text, row_images):
        out = processor(text=[text], images=row_images or None, return_tensors="pt")
        fields = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
        # per-token image marks, a list per row as TRL hands them: the 3-D rotary positions are read from them
        return out["input_ids"][0].tolist(), fields | {"mm_token_type_ids": [out["mm_token_type_ids"][0].tolist()]}

    # (cached text, its images, appended text, its image): the appended image is the row's last
    rows = [(image + "what is it?", images[:1], "<|im_end|>tool says" + image + "so", images[1:]),
            ("a much longer prompt with no image in it at all, and more words", [], " ok", [])]  # fmt: skip
    cached = [encoded(c, ci) for c, ci, _, _ in rows]
    added = [encoded(a, ai) for _, _, a, ai in rows]

    def joined(first, second):  # one row's fields over its cached then its appended tokens
        out = {k: torch.cat([first[k], second[k]]) for k in first.keys() & second.keys() if k != "mm_token_type_ids"}
        out |= {k: v for k, v in (*first.items(), *second.items()) if k not in first.keys() & second.keys()}
        return out | {"mm_token_type_ids": [first["mm_token_type_ids"][0] + second["mm_token_type_ids"][0]]}

    whole = [(c + a, joined(cf, af)) for (c, cf), (a, af) in zip(cached, added, strict=True)]
    assert len({len(ids) for ids, _ in cached}) == 2 and len({len(ids) for ids, _ in added}) == 2

    def merged(parts):  # the rows' fields as one call's
        out = {k: torch.cat([f[k] for _, f in parts if k in f]) for k in ("pixel_values", "image_grid_thw")}
        return out | {"mm_token_type_ids": [f["mm_token_type_ids"][0] for _, f in parts]}

    pad, device = processor.tokenizer.pad_token_id, torch.device("cpu")
    with torch.no_grad():
        width = max(len(ids) for ids, _ in cached)
        kept = full_prefill(model, [ids for ids, _ in cached], merged(cached), width, pad, device).cache
        appended = []
        for r, ((ids, _), (full, fields), (_, new_fields)) in enumerate(zip(cached, whole, added, strict=True)):
            full_ids, kwargs = left_padded([full], fields, len(full), pad, device)
            position = generation_position_ids(model, full_ids, kwargs)
            vision = (
                (new_fields["pixel_values"], new_fields["image_grid_thw"]) if "pixel_values" in new_fields else None
            )
            marks = {"mm_token_type_ids": kwargs["mm_token_type_ids"][0, len(ids) :]}
            appended.append(_Appended(r, slice(width - len(ids), width), full_ids[0, len(ids) :], position[..., len(ids) :], marks, vision))  # fmt: skip
            if r == 0:  # 3-D positions: over the images, rows and columns differ
                assert not torch.equal(position[1], position[2])
        full_width = max(len(full) for full, _ in whole)
        cache, logits = _append_forward(model, kept, appended, full_width, pad)
        reference = full_prefill(model, [full for full, _ in whole], merged(whole), full_width, pad, device)
    assert torch.allclose(logits, reference.logits, atol=1e-4)
    for r, (full, _) in enumerate(whole):  # every row's slots, and the zeros left of them
        for ours, theirs in ((cache.layers[0].keys, reference.cache.layers[0].keys),
                             (cache.layers[-1].values, reference.cache.layers[-1].values)):  # fmt: skip
            assert torch.allclose(
                ours[r, :, full_width - len(full) :], theirs[r, :, full_width - len(full) :], atol=1e-4
            )
            assert not ours[r, :, : full_width - len(full)].any()

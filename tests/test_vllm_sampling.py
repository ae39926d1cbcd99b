"""What reaches vLLM's sampling under `use_vllm=True`, and what the loss then excludes (`engine.vllm_sampling`).

vLLM cannot run on this machine (no GPU); its reading of `bad_words` is mirrored from `SamplingParams`' own rule and
checked here against the real tiny tokenizers. `tests/gpu/test_gpu_vllm.py` trains through vLLM on the H100.
"""

from __future__ import annotations

import pytest

from vlm_grpo.blocked_tokens import blocked_ids
from vlm_grpo.engine.vllm_sampling import _vllm_bad_word_ids, placeholder_ids, vllm_sampling
from vlm_grpo.families import core_model
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.config import VLMGRPOConfig


@pytest.fixture(scope="module")
def qwen(tiny_dir):
    return FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))


def _args(tmp_path, **generation_kwargs):
    return VLMGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, use_cpu=True,
                         generation_kwargs=generation_kwargs or None)  # fmt: skip


def test_the_image_and_video_pads_reach_vllm_as_bad_words_and_scoring_excludes_them(qwen, tmp_path):
    model, processor = qwen
    config = core_model(model).config
    sampling = vllm_sampling(_args(tmp_path), model, processor)
    pads = {config.image_token_id, config.video_token_id}
    assert set(placeholder_ids(model)) == pads
    words = sampling.sampling_kwargs["bad_words"]
    # vLLM blocks exactly the pads: each word is one token, with no leading-space variant
    assert sorted(s[0] for s in _vllm_bad_word_ids(words, processor.tokenizer)) == sorted(pads)
    assert all(len(s) == 1 for s in _vllm_bad_word_ids(words, processor.tokenizer))
    assert set(sampling.blocked) == pads == set(blocked_ids(sampling.generation_config))
    assert "allowed_token_ids" not in sampling.sampling_kwargs


def test_transformers_names_are_renamed_and_a_forced_length_blocks_eos(qwen, tmp_path):
    model, processor = qwen
    sampling = vllm_sampling(_args(tmp_path, min_new_tokens=8, suppress_tokens=[4], bad_words_ids=[[5]]), model,
                             processor)  # fmt: skip
    assert sampling.sampling_kwargs["min_tokens"] == 8 and "min_new_tokens" not in sampling.sampling_kwargs
    assert "suppress_tokens" not in sampling.sampling_kwargs and "bad_words_ids" not in sampling.sampling_kwargs
    eos = core_model(model).generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert {4, 5} | eos <= set(sampling.blocked)  # min_tokens == max_tokens: EOS never sampled, never scored
    assert {4, 5} <= {s[0] for s in _vllm_bad_word_ids(sampling.sampling_kwargs["bad_words"], processor.tokenizer)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"no_repeat_ngram_size": 3}, "no vLLM equivalent"),
        ({"max_time": 60.0}, "max_tokens"),  # it would reach SamplingParams as an unknown name
        ({"min_new_tokens": 2, "min_tokens": 2}, "keep one"),
        ({"bad_words_ids": [[4, 5]]}, "single tokens"),
        ({"bad_words": ["red green"]}, "several tokens"),
    ],
)
def test_settings_vllm_cannot_apply_are_refused_with_the_fix(qwen, tmp_path, kwargs, message):
    model, processor = qwen
    with pytest.raises(ValueError, match=message):
        vllm_sampling(_args(tmp_path, **kwargs), model, processor)


def test_allowed_token_ids_are_scored_as_their_complement(qwen, tmp_path):
    model, processor = qwen
    allowed = [0, 1, 2, 3]
    sampling = vllm_sampling(_args(tmp_path, allowed_token_ids=allowed), model, processor)
    vocab = core_model(model).get_output_embeddings().weight.shape[0]
    assert set(sampling.blocked) == set(range(vocab)) - set(allowed)


@pytest.mark.parametrize("kind", ["no round trip", "a leading-space variant"])
def test_ids_vllm_would_read_otherwise_are_blocked_through_allowed_token_ids(tiny_dir, tmp_path, kind):
    # Qwen3.5's byte-level tokenizer: a lone UTF-8 continuation byte decodes to U+FFFD, which encodes to other ids;
    # "!" encodes back to itself, but vLLM's bad_words would also block " !" (another single token)
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_5"))
    tokenizer = processor.tokenizer

    def reads(i):
        return _vllm_bad_word_ids([tokenizer.decode([i])], tokenizer)

    if kind == "no round trip":
        odd = next(i for i in range(len(tokenizer)) if reads(i)[0] != [i])
    else:
        odd = next(i for i in range(len(tokenizer)) if reads(i)[0] == [i] and len(reads(i)) == 2)
    sampling = vllm_sampling(_args(tmp_path, suppress_tokens=[odd]), model, processor)
    allowed = sampling.sampling_kwargs["allowed_token_ids"]
    assert odd not in allowed and "bad_words" not in sampling.sampling_kwargs
    vocab = core_model(model).get_output_embeddings().weight.shape[0]
    assert set(sampling.blocked) == set(range(vocab)) - set(allowed)  # the head's rows past the tokenizer too

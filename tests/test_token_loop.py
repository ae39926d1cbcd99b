"""`vlm_grpo.engine.token_loop`: which processors are sampled inside the decode step, when a sampler is the same, and
how the buffers move on by one token. (The tokens against `model.generate`: `tests/test_fast_generation.py`.)"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlm_grpo.engine.token_loop import DecodeBuffers, MinNewTokensOnDevice, Sampler, on_device, samples_in_graph


def _sampler(temperature: float = 0.7, suppressed=(3, 4), eos=(2,)) -> Sampler:
    processors = LogitsProcessorList([
        TemperatureLogitsWarper(temperature), TopKLogitsWarper(5), TopPLogitsWarper(0.9),
        SuppressTokensLogitsProcessor(list(suppressed)),
    ])  # fmt: skip
    return Sampler(processors, do_sample=True, eos=torch.tensor(list(eos)), pad_id=0)


def test_only_processors_that_read_just_the_scores_are_sampled_inside_the_step():
    assert samples_in_graph(_sampler().processors)
    assert samples_in_graph(LogitsProcessorList())  # plain sampling or argmax

    class ReadsTheIds(TemperatureLogitsWarper):  # a user's subclass may read more than the scores
        pass

    assert not samples_in_graph(LogitsProcessorList([ReadsTheIds(0.7)]))
    # These read the ids generated so far (a slice that grows every token): sampled outside the recorded step.
    assert not samples_in_graph(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)]))
    assert not samples_in_graph(
        LogitsProcessorList([TemperatureLogitsWarper(0.7), MinNewTokensLengthLogitsProcessor(4, 2, torch.tensor([2]))])
    )


def test_min_new_tokens_counts_from_the_buffers_and_blocks_eos_exactly_as_transformers_does():
    eos = torch.tensor([2, 7])
    original = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=2, eos_token_id=eos)
    processors = on_device(LogitsProcessorList([TemperatureLogitsWarper(0.7), original]), prompt_width=3)
    assert isinstance(processors[1], MinNewTokensOnDevice) and samples_in_graph(processors)
    sampler = Sampler(processors, do_sample=False, eos=eos, pad_id=0)
    buffers = DecodeBuffers.allocate(batch=2, cache_len=8, position_shape=(2, 1), device=torch.device("cpu"))
    buffers.start(torch.tensor([[4, 5, 6], [0, 5, 6]]), torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 1), pad_id=0)
    scores = torch.randn(2, 10)
    sampler.processors[1].bind(buffers)
    for new_tokens in range(4):  # the ids a plain `generate` would pass: prompt and new tokens so far
        ids = buffers.tokens[:, : 3 + new_tokens]
        ours = sampler.processors[1](ids, scores)
        assert torch.equal(ours, original(ids, scores)), new_tokens
        assert torch.isinf(ours[:, [2, 7]]).all() == (new_tokens < 2)
        buffers.column.add_(1)
    # Made for another prompt width, it is left to transformers (and sampling stays outside a recording).
    other = on_device(LogitsProcessorList([MinNewTokensLengthLogitsProcessor(5, 2, eos)]), prompt_width=3)
    assert not samples_in_graph(other)


def test_a_sampler_is_the_same_while_its_settings_are():
    assert _sampler().key == _sampler().key  # rebuilt every generation, equal by value
    assert _sampler(temperature=0.8).key != _sampler().key
    assert _sampler(suppressed=(3, 5)).key != _sampler().key
    assert _sampler(eos=(2, 7)).key != _sampler().key

    def with_min_new_tokens(width: int, minimum: int = 4) -> Sampler:
        made = MinNewTokensLengthLogitsProcessor(width, minimum, torch.tensor([2]))
        return Sampler(on_device(LogitsProcessorList([made]), width), False, torch.tensor([2]), 0)

    # The prompt width is the buffers' (a device tensor), not the sampler's: one sampler serves any prompt length,
    # whichever buffers it sampled into last.
    used = with_min_new_tokens(3)
    buffers = DecodeBuffers.allocate(batch=1, cache_len=8, position_shape=(1, 1), device=torch.device("cpu"))
    buffers.start(torch.tensor([[4, 5, 6]]), torch.ones(1, 3, dtype=torch.long), torch.zeros(1, 1), pad_id=0)
    used.sample(buffers, torch.randn(1, 10), buffers.tokens[:, :3])
    assert used.key == with_min_new_tokens(9).key != with_min_new_tokens(3, minimum=5).key


def test_buffers_move_one_token_on_and_sampling_writes_into_them():
    buffers = DecodeBuffers.allocate(batch=2, cache_len=8, position_shape=(3, 2, 1), device=torch.device("cpu"))
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    buffers.start(prompts, torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[[2], [3]]] * 3), pad_id=0)
    greedy = Sampler(LogitsProcessorList(), do_sample=False, eos=torch.tensor([2]), pad_id=0)
    logits = torch.zeros(2, 10)
    logits[0, 2], logits[1, 6] = 1.0, 1.0  # row 0 ends (EOS), row 1 says 6
    greedy.sample(buffers, logits, buffers.tokens[:, :3])
    assert buffers.tokens[:, 3].tolist() == [2, 6] and buffers.next_tokens.tolist() == [2, 6]
    assert buffers.unfinished.tolist() == [False, True] and buffers.column.item() == 4
    buffers.advance()  # the forward of the token just sampled: its slot, position and mask column
    assert buffers.slot.item() == 3 and buffers.position[:, :, 0].tolist() == [[3, 4]] * 3
    assert buffers.mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    logits[0, 2], logits[0, 9] = 0.0, 1.0
    greedy.sample(buffers, logits, buffers.tokens[:, :4])
    assert buffers.tokens[:, 4].tolist() == [0, 6]  # a finished row gets the pad
    buffers.start(prompts, torch.ones(2, 3, dtype=torch.long), torch.zeros(3, 2, 1, dtype=torch.long), pad_id=0)
    assert buffers.tokens[:, 3:].eq(0).all() and buffers.unfinished.all() and buffers.column.item() == 3
    assert buffers.fits(2, 8, (3, 2, 1), torch.device("cpu")) and not buffers.fits(
        2, 16, (3, 2, 1), torch.device("cpu")
    )

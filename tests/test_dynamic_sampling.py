"""`vlm_grpo.training.dynamic_sampling`: batches of groups whose rewards differ, drawn in the trainer's prompt order.

The rewards here are chosen so the informative groups are known in advance: a reward that differs within a group
for the prompts of a given set of ids and is constant for the others. Every check runs the real trainer on a tiny
model.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from trl.trainer.utils import RepeatSampler

from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.config import VLMGRPOConfig
from vlm_grpo.training.dynamic_sampling import NoRewardVariance, PromptStream, informative_groups, resume_batches
from vlm_grpo.training.trainer import VLMGRPOTrainer

COLORS = answer_words("color", 1)
G = 2  # completions per prompt in the trainer tests


class Rewards:
    """A reward that differs within a group (0, 1, ...) for the prompts whose id is in `graded`, 0 for the others;
    records the ids it scores and the optimizer step they were scored at."""

    __name__ = "graded"

    def __init__(self, graded=lambda i: True):
        self.graded, self.seen = graded, []

    def __call__(self, prompts, completions, id, trainer_state, **kwargs):
        self.seen.extend((trainer_state.global_step, i) for i in id[::G])
        return [float(k % G) if self.graded(i) else 0.0 for k, i in enumerate(id)]


def _dataset(n=32):
    data = make_visual_reasoning_dataset("color", n, seed=0, image_size=28)
    return data.add_column("id", list(range(n)))


def _trainer(tiny_dir, tmp_path, reward, dataset=None, model=None, **config):
    if model is None:
        model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=True)
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_completion_length=3,
        learning_rate=1e-3, max_steps=2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, dynamic_sampling=True,
    )  # fmt: skip
    return VLMGRPOTrainer(model, [reward], args=VLMGRPOConfig(**(args | config)), train_dataset=dataset or _dataset())


def _order(trainer) -> list[int]:
    """The prompts in the trainer's own sampler order (one pass), each once."""
    sampler = trainer._get_train_sampler()
    indices = list(sampler)[:: sampler.mini_repeat_count]
    chunk = sampler.batch_size
    return [i for start in range(0, len(indices), chunk * sampler.repeat_count) for i in indices[start : start + chunk]]


def _fill(trainer):
    """One training generation batch, as `_prepare_inputs` asks for it (the rows it passes only set the size)."""
    trainer.model.train()
    rows = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    return trainer._generate_and_score_completions([trainer.train_dataset[0]] * rows)


def _expected_draws(order: list[int], graded, batches: int, groups: int = 4) -> list[int]:
    """The prompts a run draws for `batches` batches: rounds of `groups` prompts in `order`, each batch until it has
    `groups` graded ones (a batch's surplus is dropped, not carried to the next)."""
    drawn, rounds = [], iter(range(0, len(order), groups))
    for _ in range(batches):
        found = 0
        while found < groups:
            chunk = order[next(rounds) :][:groups]
            drawn += chunk
            found += sum(map(graded, chunk))
    return drawn


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_a_group_is_informative_when_its_scored_rewards_differ():
    nan = math.nan
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0],  # equal: 1 + 0 twice
                            [1.0, 0.0], [0.0, 1.0],  # equal weighted sums, 1 and 1
                            [1.0, nan], [0.0, nan],  # differ
                            [1.0, nan], [nan, nan],  # one scored completion: no comparison
                            [0.5, 0.0], [0.5, 1e-12]])  # fmt: skip
    assert informative_groups(rewards, torch.ones(2), 2).tolist() == [False, False, True, False, False]
    # Weights count: with the second function weighted 3, group 1's sums are 1 and 3.
    assert informative_groups(rewards, torch.tensor([1.0, 3.0]), 2).tolist() == [False, True, True, False, False]


def test_under_normalize_then_sum_a_group_is_informative_when_its_standardised_rewards_differ():
    # TRL's GDPO aggregation standardises each function's rewards within the group before the weighted sum: 0 / 1 and
    # 2 / 0 weighted 1 and 0.5 sum to 1 for both completions, yet their standardised sums differ (advantages).
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0],  # raw weighted sums equal, standardised ones not
                            [1.0, 0.0], [1.0, 0.0]])  # fmt: skip
    weights = torch.tensor([1.0, 0.5])
    assert informative_groups(rewards, weights, 2).tolist() == [False, False]
    assert informative_groups(rewards, weights, 2, "normalize_then_sum").tolist() == [True, False]


def test_the_stream_walks_the_samplers_passes_and_resumes_where_it_stopped():
    sampler = RepeatSampler(range(10), mini_repeat_count=4, batch_size=3, repeat_count=2, seed=7)
    first_pass = list(sampler)[::4]  # each chunk repeated twice, each index 4 times: as TRL's trainer draws them
    second_pass = list(sampler)[::4]
    expected = [first_pass[i : i + 3] for i in range(0, len(first_pass), 6)]
    expected += [second_pass[i : i + 3] for i in range(0, len(second_pass), 6)]
    stream = PromptStream(10, 3, shuffle=True, seed=7)
    drawn = [stream.next_batch() for _ in range(6)]
    assert drawn == expected and stream.batches_per_pass == 3 and stream.passes == 2.0
    assert len({i for batch in drawn[:3] for i in batch}) == 9  # no prompt twice in a pass (the 10th is left over)
    resumed = PromptStream(10, 3, shuffle=True, seed=7, consumed=4)
    assert [resumed.next_batch() for _ in range(2)] == drawn[4:]
    with pytest.raises(ValueError, match="fewer than one generation batch"):
        PromptStream(2, 3, shuffle=False, seed=0)


def test_a_checkpoint_inside_a_generation_batch_replays_it():
    # A batch drawn at step 4 (micro-step 0 of it) spanning 4 micro-steps = 2 optimizer steps of 2 micro-steps.
    position = {"before": 7, "after": 9, "step": 4, "micro_step": 0}
    assert resume_batches(position, 5, accumulation=2, generate_every=4) == 7  # half trained: TRL regenerates it
    assert resume_batches(position, 6, accumulation=2, generate_every=4) == 9
    # Two batches per optimizer step: the checkpoint after the step follows the second (drawn at micro-step 2).
    assert resume_batches(position | {"micro_step": 2}, 5, accumulation=4, generate_every=2) == 9


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_sampling_rounds": 0}, "max_sampling_rounds must be >= 1"),
        ({"remove_unused_columns": True}, "remove_unused_columns=False"),
    ],
)
def test_settings_it_cannot_serve_are_refused(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        VLMGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                      dynamic_sampling=True, **settings)  # fmt: skip


def test_an_iterable_dataset_is_refused(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="IterableDataset cannot give"):
        _trainer(tiny_dir, tmp_path, Rewards(), dataset=_dataset(8).to_iterable_dataset())


@pytest.mark.trains
def test_with_every_group_informative_it_trains_exactly_as_without(tiny_dir, tmp_path):
    """Gradient accumulation, num_iterations 2: the stream gives the prompts the trainer's dataloader gives."""
    weights = {}
    for dynamic in (False, True):
        rewards = Rewards()
        trainer = _trainer(tiny_dir, tmp_path / str(dynamic), rewards, gradient_accumulation_steps=2,
                           num_iterations=2, max_steps=3, dynamic_sampling=dynamic)  # fmt: skip
        trainer.train()
        weights[dynamic] = [p.detach().clone() for p in trainer.model.parameters()]
        seen = [i for _, i in rewards.seen]
        # A generation batch (8 prompts over two micro-steps) serves two optimizer steps (num_iterations 2).
        assert seen == _order(trainer)[:16]
    assert all(torch.equal(a, b) for a, b in zip(weights[False], weights[True], strict=True))
    # Logged at the steps that generated (1 and 3).
    assert _logged(trainer, "dynamic_sampling/rounds") == [1.0] * 2
    assert _logged(trainer, "frac_reward_zero_std") == [0.0] * 2


def _assert_table_shows(trainer, batch):
    """TRL's completions table (`trainer._logs`) holds the rows trained on, with the advantages the loss uses: not the
    last round's rows, dropped groups included."""
    logs = trainer._logs
    assert list(logs["rewards"]["graded"]) == [0.0, 1.0] * 4  # every kept group is graded: 0, 1
    assert list(logs["advantages"]) == batch["advantages"].tolist()
    ids = [row[mask.bool()].tolist() for row, mask in zip(batch["completion_ids"], batch["completion_mask"])]
    texts = trainer.processing_class.batch_decode(ids, skip_special_tokens=True)
    assert [turns[0]["content"] for turns in logs["completion"]] == texts
    assert len(logs["prompt"]) == len(logs["images"]) == 8


@pytest.mark.trains
def test_a_batch_holds_only_informative_groups_drawn_in_the_samplers_order(tiny_dir, tmp_path):
    rewards = Rewards(lambda i: i % 2 == 0)  # half the prompts
    trainer = _trainer(tiny_dir, tmp_path, rewards, max_sampling_rounds=20)
    order = _order(trainer)
    for batch_number in (1, 2):
        batch = _fill(trainer)
        assert batch["prompt_ids"].shape[0] == 8
        # Rows come group by group: every group has an advantage, hence a gradient.
        assert (batch["advantages"].view(4, G) != 0).any(dim=1).all()
        assert batch["num_items_in_batch"] == batch["completion_mask"].sum()  # recounted for the kept rows
        # The prompts were drawn in the sampler's order, 4 per round, until the batch had 4 informative groups.
        assert [i for _, i in rewards.seen] == _expected_draws(order, rewards.graded, batch_number)
        _assert_table_shows(trainer, batch)
    metrics = trainer._metrics["train"]
    assert metrics["frac_reward_zero_std"][-2:] == [0.0, 0.0]
    assert metrics["dynamic_sampling/groups_kept"][-2:] == [4.0, 4.0]
    assert sum(metrics["dynamic_sampling/rounds"]) * 4 == len(rewards.seen)
    assert sum(metrics["dynamic_sampling/groups_informative"]) == sum(i % 2 == 0 for _, i in rewards.seen)
    assert metrics["dynamic_sampling/rounds"] != [1.0, 1.0]  # some round came up short: the filter had work


@pytest.mark.trains
def test_the_round_cap_fills_the_batch_with_zero_std_groups_and_says_so(tiny_dir, tmp_path, caplog):
    probe = _trainer(tiny_dir, tmp_path / "probe", Rewards())
    first_round = _order(probe)[:4]
    rewards = Rewards(lambda i: i == first_round[2])  # one informative group in the first round
    trainer = _trainer(tiny_dir, tmp_path, rewards, model=probe.model, max_sampling_rounds=1)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.training.dynamic_sampling"):
        batch = _fill(trainer)
        _fill(trainer)
    assert [i for _, i in rewards.seen][:4] == first_round
    has_advantage = (batch["advantages"].view(4, G) != 0).any(dim=1)
    assert has_advantage.tolist() == [True, False, False, False]  # the kept group, then the filling
    assert batch["prompt_ids"].shape[0] == 8 and batch["num_items_in_batch"] == batch["completion_mask"].sum()
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/cap_hit"] == [1.0, 1.0] and metrics["dynamic_sampling/rounds"] == [1.0, 1.0]
    assert metrics["frac_reward_zero_std"][0] == 0.75
    warnings = [r.getMessage() for r in caplog.records if "this batch needs" in r.getMessage()]
    assert len(warnings) == 1 and "found 1 of the 4 groups" in warnings[0]  # once, not every batch


@pytest.mark.trains
def test_no_group_with_differing_rewards_stops_the_run_with_the_reason(tiny_dir, tmp_path):
    rewards = Rewards(lambda i: False)  # a constant reward
    trainer = _trainer(tiny_dir, tmp_path, rewards, max_sampling_rounds=3)
    with pytest.raises(NoRewardVariance, match=r"all 12 groups generated in 3 round\(s\).*rewards seen: 0\)"):
        trainer.train()
    assert len(rewards.seen) == 3 * 4 and trainer.state.global_step == 0  # three rounds, then the error


@pytest.mark.trains
def test_a_saturated_batch_later_in_the_run_is_trained_with_a_warning(tiny_dir, tmp_path, caplog):
    rewards = Rewards()
    trainer = _trainer(tiny_dir, tmp_path, rewards, max_sampling_rounds=2)
    _fill(trainer)
    rewards.graded = lambda i: False  # the task saturates: every completion now earns the same reward
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.training.dynamic_sampling"):
        batch = _fill(trainer)
    assert not batch["advantages"].any() and batch["prompt_ids"].shape[0] == 8
    assert trainer._metrics["train"]["dynamic_sampling/groups_kept"][-1] == 0.0
    assert any("no group with differing rewards" in r.getMessage() for r in caplog.records)


def _lora_model(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS))
    return FastVisionModel.get_peft_model(model, r=4, random_state=0)


@pytest.mark.trains
def test_resume_continues_the_prompt_stream_from_the_checkpoint(tiny_dir, tmp_path):
    # LoRA: transformers 5.24 resumes a full fine-tune of Qwen2.5-VL without its weights (the checkpoint's keys are
    # saved in the original layout, which its resume path does not map back), so its losses could not be compared.
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=5e-3)
    full = Rewards(lambda i: i % 2 == 0)
    trainer = _trainer(tiny_dir, tmp_path, full, model=_lora_model(tiny_dir), **settings)
    trainer.train()
    assert os.path.isdir(tmp_path / "out" / "checkpoint-2")
    losses = _logged(trainer, "loss")

    resumed = Rewards(full.graded)
    trainer = _trainer(tiny_dir, tmp_path, resumed, model=_lora_model(tiny_dir), **settings)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.seen == [(step, i) for step, i in full.seen if step >= 2]  # steps 3 and 4, the same prompts
    assert _logged(trainer, "loss")[-2:] == pytest.approx(losses[-2:], rel=1e-4, abs=1e-9)
    assert _logged(trainer, "dynamic_sampling/data_passes")[-1] == len(full.seen) / 32  # prompts drawn / 32 a pass


@pytest.mark.slow
@pytest.mark.trains
def test_learns_faster_per_step_when_half_the_prompts_never_vary(tmp_path):
    """The demo's task with half the training prompts ungraded (reward 0 whatever the answer): the same 40 steps
    and seed, with and without dynamic sampling (benchmarks/dynamic_sampling.py runs it longer, docs/benchmarks.md)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from dynamic_sampling import train_and_evaluate

    runs = {dynamic: train_and_evaluate(str(tmp_path), dynamic, steps=40, eval_every=40, max_sampling_rounds=8)
            for dynamic in (False, True)}  # fmt: skip
    plain, dynamic = (runs[d]["points"][-1]["accuracy"] for d in (False, True))
    # Plain GRPO trains on about 55% zero-std groups; dynamic sampling on none, in every one of its 40 batches.
    assert sum(h["frac_reward_zero_std"] for h in runs[False]["logged"]) / 40 > 0.4
    assert [h["frac_reward_zero_std"] for h in runs[True]["logged"]] == [0.0] * 40
    assert dynamic >= plain and dynamic > 0.5, (plain, dynamic)  # chance is 0.25; measured: 0.594 and 0.719


class Opposed:
    """Two rewards whose weighted sum (weights 1 and 0.5) is the same for every completion: 0 / 1 and 2 / 0."""

    def __init__(self, scale: float) -> None:
        self.scale, self.__name__ = scale, f"opposed_{scale:g}"

    def __call__(self, prompts, completions, **kwargs):
        return [float(k % G) if self.scale == 1 else self.scale * (1 - k % G) for k in range(len(completions))]


@pytest.mark.trains
def test_under_normalize_then_sum_it_keeps_the_groups_trl_gives_advantages(tiny_dir, tmp_path):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=True)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_completion_length=3,
        max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=0, dynamic_sampling=True,
        multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5], max_sampling_rounds=1,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [Opposed(1), Opposed(2)], args=args, train_dataset=_dataset())
    batch = _fill(trainer)  # the weighted sums are constant: every group was dropped, NoRewardVariance raised
    assert (batch["advantages"].view(4, G) != 0).any(dim=1).all()  # TRL's advantages: every group has a gradient
    assert trainer._metrics["train"]["dynamic_sampling/groups_kept"] == [4.0]


@pytest.mark.trains
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_batch_scaled_advantages_are_scaled_by_the_batch_trained_on(tiny_dir, tmp_path, aggregation):
    """With half the prompts graded (0 / 1 in a group, 0 otherwise), a batch of 4 groups takes rounds whose generated
    batches hold ungraded groups too; scaled by each round's batch (TRL's per call) the trained rows had another scale
    than the batch they form, as verl and TRL compute it for a batch."""
    trainer = _trainer(tiny_dir, tmp_path, Rewards(graded=lambda i: i % 2 == 0), scale_rewards="batch",
                       multi_objective_aggregation=aggregation, max_sampling_rounds=8)  # fmt: skip
    batch = _fill(trainer)
    assert trainer._metrics["train"]["dynamic_sampling/groups_kept"] == [4.0]
    assert trainer._metrics["train"]["dynamic_sampling/rounds"][0] >= 2
    trained = torch.tensor([0.0, 1.0] * 4)  # every kept group is graded: 0, 1
    if aggregation == "normalize_then_sum":  # each function standardised in its group first: -0.5 / 0.5 over std
        trained = (trained - 0.5) / (math.sqrt(0.5) + 1e-4)
    expected = (trained - trained.view(4, 2).mean(1).repeat_interleave(2)) / (trained.std() + 1e-4)
    torch.testing.assert_close(batch["advantages"].flatten().float(), expected, rtol=1e-5, atol=1e-5)
    _assert_table_shows(trainer, batch)  # the recomputed advantages, not each round's own

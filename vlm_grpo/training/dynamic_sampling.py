"""DAPO's dynamic sampling: every trained batch holds groups whose rewards differ.

When all G completions of a prompt earn the same reward, the group's advantages are zero: it adds nothing to the
policy gradient, yet costs its forward and backward passes and shrinks the batch. With `dynamic_sampling=True`,
`DynamicSampler.fill` builds each generation batch (the `per_device_train_batch_size * steps_per_generation` rows a
process trains on until the next generation) in rounds:

1. the next prompts of the stream are generated and scored by TRL (`_generate_and_score_completions`, one call per
   round: the fast-generation and shared-prefix paths, the rewards, the advantages of each group and the reference
   log-probs, as for any batch);
2. the groups whose weighted reward has zero standard deviation are dropped (`informative_groups`; under
   `multi_objective_aggregation="normalize_then_sum"`, the weighted sum of the rewards standardised in the group);
3. rounds go on until every process holds its configured number of groups, at most `max_sampling_rounds` of them.
   Each round is one generation batch: every process generates its share of the next prompts.

Every process decides from the rewards of all processes (TRL gathers them to compute the advantages), so all take
the same number of rounds (no process waits in a collective that another never joins), and each trains on a full
batch. A process that has its groups before the others keeps generating with them and drops its surplus, as verl
drops what overflows its batch.

**Which prompts.** `PromptStream` walks the training set in the order of the trainer's own sampler (TRL's
`RepeatSampler`, same seed: the same permutation per pass), one generation batch of prompts at a time, pass after
pass. Every prompt drawn is used once (kept, or dropped with its group); a pass over the data visits each prompt once,
and the next pass starts only when it is done. Unlike verl, which takes the extra prompts from its epoch's dataloader
and so ends the epoch after fewer steps, the trainer keeps its configured number of optimizer steps (`max_steps`, or
epochs of `len(dataloader)` steps: the learning-rate schedule stays as planned); the trainer's dataloader only paces
the steps. The passes over the data are logged as `dynamic_sampling/data_passes`. With every group informative the
stream gives exactly the prompts the plain trainer would.

**The round cap.** When `max_sampling_rounds` rounds leave a process short, its batch is filled with zero-std groups
of those rounds, so every process trains on its full batch shape and the loss is normalised as TRL normalises any
batch (those groups have zero advantage: they add only the KL term, as they would without dynamic sampling). Logged
as `dynamic_sampling/cap_hit`, with a warning the first time. A first batch with no group whose rewards differ in any
round raises `NoRewardVariance` (a constant reward, or a task the model always or never solves: nothing to learn);
later in a run (the task saturating) such a batch is trained as it is, with a warning.

**Advantages scaled by the batch** (`scale_rewards="batch"`, or `multi_objective_aggregation="normalize_then_sum"`,
whose mean and std are the batch's): computed again over the batch trained on, every process's kept rows
(`batch_advantages`), as verl computes DAPO's after filtering. Each round's own were scaled by that round's generated
batch, dropped groups included: rows of two rounds had two scales (and under "normalize_then_sum" a mean that the
dropped groups shifted). Per-group scaling (the default) needs nothing: a group's advantages are its own.

**Metrics** (per generation batch, summed over processes): `dynamic_sampling/rounds`, `groups_generated`,
`groups_informative` (of those generated), `groups_kept` (informative groups trained on) and `cap_hit`;
`frac_reward_zero_std` is replaced by the share of zero-std groups in the batch trained on (0 when the batch was
filled). TRL's reward and completion metrics (`reward`, `reward_std`, `rewards/*`, `completions/*`, `num_tokens`)
cover every generated group, dropped ones included; the completions table (`log_completions`) shows the rows trained
on, with the advantages the loss uses (`training.rollout_logs`).

**Resume.** The stream's position is saved in each checkpoint's `trainer_state.json` (`DynamicSamplingState`) and a
resumed run continues from it, replaying the interrupted generation batch when a checkpoint fell inside one (as TRL
regenerates it).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from trl.trainer.utils import RepeatSampler, nanstd

from .rollout_batch import concat_rollouts, loss_token_count, select_rollouts
from .rollout_logs import RoundLogs

__all__ = ["DynamicSampler", "DynamicSamplingState", "NoRewardVariance", "PromptStream", "batch_advantages",
           "informative_groups", "rewards_vary", "row_rewards"]  # fmt: skip

logger = logging.getLogger(__name__)


class NoRewardVariance(RuntimeError):
    """Every group of a batch earned one reward for all of its completions, in every sampling round."""


def row_rewards(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:  # fmt: skip
    """Each row's reward as TRL computes it for its advantages under `aggregation` ([rows]): the weighted sum of
    `rewards_per_func` ([rows, functions], NaN where a function did not score it), each function's rewards first
    standardised within the group under "normalize_then_sum"; NaN for a row no function scored."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean, std = torch.nanmean(grouped, dim=1, keepdim=True), nanstd(grouped, dim=1, keepdim=True)
        rewards_per_func = ((grouped - mean) / (std + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    return rewards


def informative_groups(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:  # fmt: skip
    """For each group of `num_generations` consecutive rows: whether its completions' rewards differ.

    The rewards are :func:`row_rewards` (as TRL computes them for `aggregation`: under "normalize_then_sum" rewards
    whose weighted sum is constant in a group can still differ once each is standardised, as in TRL's GDPO). A group
    is informative when at least two of its completions were scored and their standard deviation is not zero (TRL's
    `frac_reward_zero_std` test), i.e. when TRL gives it advantages.
    """
    return rewards_vary(row_rewards(rewards_per_func, weights, num_generations, aggregation), num_generations)


def rewards_vary(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """For each group of `num_generations` consecutive `rewards` (:func:`row_rewards`): whether at least two were
    scored and their standard deviation is not zero."""
    grouped = rewards.view(-1, num_generations)
    scored = ~torch.isnan(grouped)
    count = scored.sum(dim=1)
    mean = grouped.nansum(dim=1) / count.clamp(min=1)
    variance = ((grouped - mean.unsqueeze(1)) ** 2).nansum(dim=1) / (count - 1).clamp(min=1)
    std = variance.sqrt()
    return (count >= 2) & ~torch.isclose(std, torch.zeros_like(std))


def batch_advantages(
    rewards: torch.Tensor, everyone: torch.Tensor, num_generations: int, aggregation: str
) -> torch.Tensor:
    """The advantages of one process's trained rows (`rewards`, :func:`row_rewards` of them) where TRL scales by the
    whole batch (`scale_rewards="batch"`, or `aggregation="normalize_then_sum"`), computed over the batch trained on
    (`everyone`: every process's trained rows' rewards), as verl computes DAPO's after filtering: from the rounds'
    own advantages, each round's rows were scaled by that round's generated batch, dropped groups included."""
    std = nanstd(everyone) + 1e-4
    if aggregation == "normalize_then_sum":
        return torch.nan_to_num((rewards - torch.nanmean(everyone)) / std, nan=0.0)
    group_mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return torch.nan_to_num((rewards - group_mean) / std, nan=0.0)


class PromptStream:
    """Dataset indices in the trainer's sampler order, one generation batch of distinct prompts at a time, pass after
    pass (each pass a new permutation, incomplete last batches dropped, as TRL's `RepeatSampler` gives them).

    `consumed` batches have been drawn; a stream built with `consumed=n` continues where one that drew n stopped.
    """

    def __init__(self, num_prompts: int, prompts_per_batch: int, shuffle: bool, seed: int, consumed: int = 0) -> None:
        self.batches_per_pass = num_prompts // prompts_per_batch
        if self.batches_per_pass == 0:
            raise ValueError(
                f"dynamic_sampling: the training set has {num_prompts} prompts, fewer than one generation batch "
                f"({prompts_per_batch} prompts); add prompts or lower the batch size."
            )
        self.prompts_per_batch = prompts_per_batch
        self._sampler = RepeatSampler(range(num_prompts), mini_repeat_count=1, batch_size=prompts_per_batch,
                                      shuffle=shuffle, seed=seed)  # fmt: skip
        self._indices: Any = iter(())
        self.consumed = 0
        for _ in range(consumed):
            self.next_batch()

    def next_batch(self) -> list[int]:
        """The next generation batch's prompts (dataset indices)."""
        batch = list(itertools.islice(self._indices, self.prompts_per_batch))
        if not batch:  # this pass is done: the sampler's next permutation
            self._indices = iter(self._sampler)
            batch = list(itertools.islice(self._indices, self.prompts_per_batch))
        self.consumed += 1
        return batch

    @property
    def passes(self) -> float:
        """Passes over the data so far (1.5: one and a half)."""
        return self.consumed / self.batches_per_pass


class DynamicSamplingState(TrainerCallback, ExportableState):
    """Carries the prompt stream's position into every checkpoint's `trainer_state.json` (transformers saves the
    state of callbacks that are `ExportableState`). `DynamicSampler` updates `position` after each batch and reads
    it back from the resumed `TrainerState`, so this object being replaced on restore changes nothing."""

    def __init__(self, position: dict[str, Any] | None = None) -> None:
        self.position = dict(position or {})

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"position": dict(self.position)}}


def resume_batches(position: dict[str, Any], global_step: int, accumulation: int, generate_every: int) -> int:
    """The stream batches a run resumed at `global_step` continues after.

    `position` is the last generation batch's: the stream before and after it, and the optimizer step and
    micro-step it started at. A checkpoint taken before that batch's `generate_every` micro-steps were all trained
    resumes at its start: TRL regenerates the interrupted batch on resume, so its prompts are drawn again.
    """
    trained = (global_step - position["step"]) * accumulation - position["micro_step"]
    return position["after"] if trained >= generate_every else position["before"]


class DynamicSampler:
    """Builds each training generation batch of a `VLMGRPOTrainer` from informative groups (see the module doc).

    Args:
        trainer: the trainer (its config, dataset, state, metrics and the rewards of its last scoring call).
        score: generates and scores dataset rows, each prompt repeated for its group, returning TRL's batch
            (`VLMGRPOTrainer._score_rollouts`).
    """

    def __init__(self, trainer: Any, score: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        args, dataset = trainer.args, trainer.train_dataset
        if dataset is not None and (
            isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__")
        ):
            raise ValueError(
                "dynamic_sampling draws further prompts by index, which an IterableDataset cannot give: pass a "
                "map-style dataset (datasets.Dataset), or turn dynamic_sampling off."
            )
        self.trainer, self.score = trainer, score
        self.max_rounds = args.max_sampling_rounds
        self.num_generations = trainer.num_generations
        self.prompts_per_batch = args.generation_batch_size // self.num_generations
        self.stream: PromptStream | None = None
        self._signal_seen = False
        self._warned: set[str] = set()

    def restart(self) -> None:
        """Called as `train()` starts: the next batch builds the stream afresh, or from the resumed checkpoint."""
        self.stream = None

    def _state_callback(self) -> DynamicSamplingState:
        return next(cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, DynamicSamplingState))

    def _open_stream(self) -> PromptStream:
        trainer = self.trainer
        state = trainer.state
        consumed = 0
        if state.global_step > 0 and not trainer.args.ignore_data_skip:  # resumed from a checkpoint
            generate_every = trainer.args.steps_per_generation * trainer.num_iterations
            saved = (state.stateful_callbacks or {}).get(DynamicSamplingState.__name__, {})
            position = saved.get("attributes", {}).get("position") if isinstance(saved, dict) else None
            if position:
                accumulation = trainer.args.gradient_accumulation_steps
                consumed = resume_batches(position, state.global_step, accumulation, generate_every)
                self._signal_seen = position.get("signal_seen", False)
            else:
                # A checkpoint of a run without dynamic sampling: where its dataloader had got to.
                consumed = state.global_step * trainer.args.gradient_accumulation_steps // generate_every
                logger.warning(
                    "dynamic_sampling: the checkpoint holds no prompt-stream position (saved without dynamic "
                    "sampling); continuing after the %d generation batches its steps used.", consumed
                )  # fmt: skip
        return PromptStream(len(trainer.train_dataset), self.prompts_per_batch, trainer.shuffle_dataset,
                            trainer.args.seed, consumed)  # fmt: skip

    def fill(self, rows: int) -> dict[str, Any]:
        """One process's generation batch of `rows` rows, from groups whose rewards differ where the rounds allow."""
        trainer, accelerator = self.trainer, self.trainer.accelerator
        G, processes, rank = self.num_generations, accelerator.num_processes, accelerator.process_index
        groups = rows // G
        if groups * G != rows or groups * processes != self.prompts_per_batch:
            raise ValueError(
                f"dynamic_sampling: a process's generation batch of {rows} rows is not "
                f"{self.prompts_per_batch} / {processes} whole groups of {G}."
            )
        if self.stream is None:
            self.stream = self._open_stream()
        stream = self.stream
        before = stream.consumed
        metrics = trainer._metrics["train"]
        zero_std_logged = len(metrics["frac_reward_zero_std"])

        kept_parts, spare_parts, kept_rewards, spare_rewards = [], [], [], []
        order, spare_orders = [], []  # (round, row) of each kept row, and of each spare part's, for the logs
        logs = RoundLogs(trainer._logs, rows)  # the completions table: the rows trained on (`rollout_logs`)
        kept = torch.zeros(processes, dtype=torch.long)  # informative groups each process has, up to `groups`
        spare = 0  # this process's zero-std groups set aside in case the rounds run out
        generated = informative = rounds = 0
        rewards_seen: set[float] = set()
        while rounds < self.max_rounds and bool((kept < groups).any()):
            rounds += 1
            prompts = stream.next_batch()[rank * groups : (rank + 1) * groups]
            dataset_rows = [trainer.train_dataset[int(i)] for i in prompts]
            batch = self.score([row for row in dataset_rows for _ in range(G)])
            this_round = logs.end_round()
            rewards = trainer._last_rewards_per_func
            # Gathered over processes (process p's rows p*rows...), so every process sees the same table.
            every_row = row_rewards(rewards, trainer.reward_weights, G, trainer.multi_objective_aggregation)
            table = rewards_vary(every_row, G).view(processes, groups).cpu()  # `informative_groups`, rewards kept
            mine_rewards = every_row.view(processes, rows)[rank]
            generated += processes * groups
            informative += int(table.sum())
            if len(rewards_seen) <= 8:
                rewards_seen.update((rewards * trainer.reward_weights.to(rewards.device)).nansum(1).unique().tolist())
            mine = torch.nonzero(table[rank]).flatten()[: groups - int(kept[rank])].tolist()
            if mine:
                kept_parts.append(select_rollouts(batch, picked := [g * G + j for g in mine for j in range(G)]))
                kept_rewards.append(mine_rewards[picked])
                order += [(this_round, i) for i in picked]
            zero = torch.nonzero(~table[rank]).flatten()[: groups - spare].tolist()
            if zero:
                spare_parts.append(select_rollouts(batch, picked := [g * G + j for g in zero for j in range(G)]))
                spare_rewards.append(mine_rewards[picked])
                spare_orders.append([(this_round, i) for i in picked])
                spare += len(zero)
            kept = torch.minimum(kept + table.sum(dim=1), torch.tensor(groups))

        if informative == 0 and not self._signal_seen:
            raise NoRewardVariance(self._no_variance_message(generated, rounds, sorted(rewards_seen)))
        self._signal_seen |= informative > 0
        parts, missing = kept_parts, groups - int(kept[rank])
        while missing > 0:  # the rounds ran out: fill with zero-std groups, in the order they were generated
            part = spare_parts.pop(0)
            take = min(missing, part["prompt_ids"].shape[0] // G)
            parts.append(select_rollouts(part, range(take * G)))
            kept_rewards.append(spare_rewards.pop(0)[: take * G])
            order += spare_orders.pop(0)[: take * G]
            missing -= take
        out = concat_rollouts(parts, trainer._tokenizer.pad_token_id)
        if trainer.scale_rewards == "batch" or trainer.multi_objective_aggregation == "normalize_then_sum":
            trained = torch.cat(kept_rewards)
            everyone = accelerator.gather(trained)
            advantages = batch_advantages(trained, everyone, G, trainer.multi_objective_aggregation)
            out["advantages"] = advantages.to(out["advantages"].device, out["advantages"].dtype)
        out["num_items_in_batch"] = accelerator.gather(loss_token_count(out)).sum()
        logs.keep(order, out["advantages"], gather_object, accelerator.gather)

        trained_informative = int(kept.sum())
        self._log_shortfall(informative, trained_informative, processes * groups, rounds)
        del metrics["frac_reward_zero_std"][zero_std_logged:]  # TRL's, for every round: replaced by the trained batch's
        metrics["frac_reward_zero_std"].append(1.0 - trained_informative / (processes * groups))
        for name, value in (("rounds", rounds), ("groups_generated", generated), ("groups_informative", informative),
                            ("groups_kept", trained_informative), ("cap_hit", float(trained_informative < processes * groups)),
                            ("data_passes", stream.passes)):  # fmt: skip
            metrics[f"dynamic_sampling/{name}"].append(float(value))
        self._state_callback().position = {
            "before": before, "after": stream.consumed, "step": trainer.state.global_step,
            "micro_step": trainer._step % trainer.args.gradient_accumulation_steps, "signal_seen": self._signal_seen,
        }  # fmt: skip
        return out

    def _no_variance_message(self, generated: int, rounds: int, rewards: list[float]) -> str:
        values = ", ".join(f"{r:g}" for r in rewards[:8]) + (", ..." if len(rewards) > 8 else "")
        return (
            f"dynamic_sampling: all {generated} groups generated in {rounds} round(s) (max_sampling_rounds) gave every "
            f"one of their {self.num_generations} completions the same reward (rewards seen: {values}), so GRPO has "
            "nothing to learn from them. Check that the reward functions score these completions (a constant "
            "reward?), that the task is neither always nor never solved by this model (e.g. the answer format it "
            "asks for), and that sampling varies the completions (temperature); or raise max_sampling_rounds."
        )

    def _log_shortfall(self, informative: int, trained: int, batch_groups: int, rounds: int) -> None:
        if trained == batch_groups:
            return
        kind = "none" if informative == 0 else "short"
        if kind in self._warned:
            return
        self._warned.add(kind)
        if kind == "none":
            logger.warning(
                "dynamic_sampling: no group with differing rewards in %d round(s) (max_sampling_rounds); this batch "
                "trains on zero-advantage groups only (the KL term). The task may be saturated. Logged as "
                "dynamic_sampling/groups_kept = 0; warned once.", rounds
            )  # fmt: skip
        else:
            logger.warning(
                "dynamic_sampling: %d round(s) (max_sampling_rounds) found %d of the %d groups with differing rewards "
                "this batch needs; filled with zero-std groups (zero advantage). Logged as dynamic_sampling/cap_hit; "
                "warned once. Raise max_sampling_rounds to fill more batches.", rounds, trained, batch_groups
            )  # fmt: skip

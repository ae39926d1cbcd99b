"""`training.rollout_logs`: the completions table of a dynamic-sampling batch holds the rows trained on.

The trainer-level check is `test_dynamic_sampling._assert_table_shows` (one process); here two processes' rows, laid
out as TRL's gathers lay them (process-major), pick their entries from the right rounds. The two collectives are given
as what they return on two processes: every process's list, process 0's first.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from vlm_grpo.training.rollout_logs import RoundLogs

ROWS = 2  # rows per process, in every round and in the batch


def _logs() -> dict:
    return {
        "images": deque(maxlen=4), "prompt": deque(maxlen=4), "completion": deque(maxlen=4),
        "advantages": deque(maxlen=4), "rewards": defaultdict(lambda: deque(maxlen=4)),
        "extra": defaultdict(lambda: deque(maxlen=4)),
    }  # fmt: skip


def _log_round(logs: dict, name: str, extra: bool) -> None:
    """One generation call of two processes, as TRL logs it: p0's rows, then p1's."""
    labels = [f"{name}-p{p}r{i}" for p in range(2) for i in range(ROWS)]
    logs["prompt"].extend(labels)
    logs["completion"].extend(labels)
    logs["advantages"].extend([-1.0] * 4)  # the round's own: never shown
    logs["rewards"]["r"].extend(range(4))
    if extra:
        logs["extra"]["pred"].extend(labels)


def test_each_process_rows_come_from_their_rounds_with_the_batchs_advantages() -> None:
    logs = _logs()
    _log_round(logs, "last-batch", extra=False)
    rounds = RoundLogs(logs, ROWS)
    _log_round(logs, "a", extra=False)
    assert rounds.end_round() == 0
    _log_round(logs, "b", extra=True)  # a log_extra column written from round 1 on
    assert rounds.end_round() == 1
    assert not logs["prompt"]  # each round's entries taken as it ends
    # Process 0 trains on round 0's row 1 and round 1's row 0; process 1 on round 1's rows 1 and 0.
    orders = [[(0, 1), (1, 0)], [(1, 1), (1, 0)]]
    advantages = torch.tensor([[0.5, -0.5], [1.5, -1.5]])
    rounds.keep(orders[0], advantages[0], lambda _: orders[0] + orders[1], lambda _: advantages.flatten())
    assert list(logs["prompt"]) == list(logs["completion"]) == ["a-p0r1", "b-p0r0", "b-p1r1", "b-p1r0"]
    assert list(logs["advantages"]) == [0.5, -0.5, 1.5, -1.5]
    assert list(logs["rewards"]["r"]) == [1, 0, 3, 2]
    assert list(logs["extra"]["pred"]) == [None, "b-p0r0", "b-p1r1", "b-p1r0"]  # round 0 wrote none
    assert not logs["images"]  # no round logged images


def test_a_batch_of_another_size_is_refused() -> None:
    logs = _logs()
    rounds = RoundLogs(logs, ROWS)
    _log_round(logs, "a", extra=False)
    rounds.end_round()
    with pytest.raises(RuntimeError, match="kept 1 rows for a batch of 2"):
        rounds.keep([(0, 0)], torch.zeros(1), lambda x: x, lambda x: x)

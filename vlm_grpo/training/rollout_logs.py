"""TRL's completions table under dynamic sampling: the rows trained on, with the advantages the loss uses.

TRL keeps the prompts, completions, rewards, advantages, images and `log_extra` columns of the last generation batch
in `trainer._logs` (deques of the generation batch's length) and writes them as the completions table
(`log_completions`, W&B / trackio, the printed sample). Dynamic sampling (`training.dynamic_sampling`) runs several
generation calls per batch, each appending its rows: the deques ended up holding the last round's rows, groups it
dropped included and rows it trained on from earlier rounds left out, with each round's own advantages where the loss
used ones computed again over the kept rows (`batch_advantages`). `RoundLogs` takes each round's entries as it ends and
puts back those of the rows trained on, in the batch's order, with the batch's advantages, gathered over processes as
TRL gathers them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["RoundLogs"]

_ROW_KEYS = ("images", "prompt", "completion", "advantages")  # one entry per row of every process
_COLUMN_KEYS = ("rewards", "extra")  # {column: entries}


def _take(logs: dict[str, Any]) -> dict[str, Any]:
    """A copy of the entries of `logs`, which are then emptied (their columns stay, as TRL made them)."""
    taken: dict[str, Any] = {key: list(logs[key]) for key in _ROW_KEYS if key in logs}
    for key in _COLUMN_KEYS:
        if key in logs:
            taken[key] = {column: list(entries) for column, entries in logs[key].items()}
    for key in _ROW_KEYS:
        if key in logs:
            logs[key].clear()
    for key in _COLUMN_KEYS:
        for entries in logs.get(key, {}).values():
            entries.clear()
    return taken


class RoundLogs:
    """One dynamic-sampling batch's log entries, round by round (`trainer._logs`, TRL's)."""

    def __init__(self, logs: dict[str, Any], rows_per_process: int) -> None:
        self.logs, self.rows = logs, rows_per_process
        _take(logs)  # the last batch's: replaced by this one's, as TRL's deques replace them
        self.rounds: list[dict[str, Any]] = []

    def end_round(self) -> int:
        """Take the entries the round just generated appended; returns the round's index."""
        self.rounds.append(_take(self.logs))
        return len(self.rounds) - 1

    def keep(
        self, order: Sequence[tuple[int, int]], advantages: torch.Tensor, gather_object: Callable[[list], list],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:  # fmt: skip
        """Put back the entries of this process's trained rows, `order[k] = (round, row of that round)` for its k-th
        row, and every process's (all processes call it, as TRL's logging gathers); `advantages`: this process's, as
        the loss uses them."""
        if len(order) != self.rows:
            raise RuntimeError(f"dynamic_sampling kept {len(order)} rows for a batch of {self.rows} (a vlm_grpo bug).")
        everyone = gather_object(list(order))  # process-major: process p's rows are everyone[p*rows : (p+1)*rows]
        # Each round logged every process's rows the same way: process p's row i at p*rows + i.
        picked = [(r, (k // self.rows) * self.rows + i) for k, (r, i) in enumerate(everyone)]

        def entries(round_entries: list[list[Any]]) -> list[Any]:
            # A round that logged no such entry (no images; a log_extra column first written later) gives None.
            return [round_entries[r][j] if j < len(round_entries[r]) else None for r, j in picked]

        for key in ("images", "prompt", "completion"):
            if key in self.logs:
                values = entries([logs.get(key, []) for logs in self.rounds])
                if key != "images" or any(v is not None for v in values):
                    self.logs[key].extend(values)
        if "advantages" in self.logs:
            self.logs["advantages"].extend(gather(advantages.detach()).tolist())
        for key in _COLUMN_KEYS:
            if key not in self.logs:
                continue
            columns = dict.fromkeys(column for logs in self.rounds for column in logs.get(key, {}))
            for column in columns:
                self.logs[key][column].extend(entries([logs.get(key, {}).get(column, []) for logs in self.rounds]))

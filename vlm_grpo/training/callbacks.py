"""Trainer callbacks for watching a GRPO run.

- `MetricsJsonlCallback`: every log record as one JSON line, with a few sampled prompts, completions and their
  rewards at each logging step (read from the buffer TRL fills for its `log_completions` tables); a resumed run
  appends to the records up to its checkpoint (`keep_records_up_to`).
- `LivePlotCallback`: the mean reward and each reward function's mean (accuracy, format...) redrawn as one plot
  in Jupyter at every logging step; one text line per logging step elsewhere.
- `RewardProgressBar` / `RewardPrinter`: transformers' progress bar with the few numbers worth watching in its
  postfix, or one short line per logging step, in place of a printed dict per log (what `vlm-grpo` shows).
- `library_bars_off`: transformers' own bars ("Loading weights", "Writing model shards") off for a block, where a
  model loads or saves in no time (the tiny model, the KL reference, the final save) and its bar would sit between
  ours.
- `plot_reward_curve`: the mean training reward of a `metrics.jsonl`, with the held-out accuracy before and
  after, as a PNG (`reward_curve.png`).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from typing import Any

from transformers import ProgressCallback, TrainerCallback

from ..third_party_logs import library_bars_off  # re-exported: its home is with the other third-party output

logger = logging.getLogger(__name__)

__all__ = [
    "LivePlotCallback",
    "MetricsJsonlCallback",
    "RewardPrinter",
    "RewardProgressBar",
    "close_progress_bars",
    "completion_samples",
    "in_notebook",
    "keep_records_up_to",
    "library_bars_off",
    "plot_reward_curve",
    "reward_curve_figure",
    "reward_summary",
]


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where rich output such as images can be displayed), False in a terminal."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _finite(value: Any) -> Any:
    """JSON has no NaN: an unscorable reward is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _prompt_text(prompt: Any) -> str:
    """The question of a prompt: the string, or the text of its last user message (images left out)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"] or list(prompt)
    content = users[-1].get("content") if users else ""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text") or "" for part in content or [] if part.get("type") == "text").strip()


def completion_samples(trainer: Any, num_samples: int = 4) -> list[dict[str, Any]]:
    """Up to `num_samples` rows of the latest generation batch: prompt text, completion text, each reward and the
    advantage (plus columns that rewards log with `log_extra`, e.g. the parsed prediction).

    Read from `trainer._logs`, which `trl.GRPOTrainer` fills at every step for its `log_completions` tables. Rows are
    taken one per prompt group first (then the second completion of each group...), so a few samples show several
    images rather than one prompt's group.
    """
    from ..rewards import completion_text

    logs = trainer._logs
    prompts, completions = list(logs["prompt"]), list(logs["completion"])
    group = max(int(getattr(trainer, "num_generations", 1) or 1), 1)
    order = sorted(range(len(prompts)), key=lambda i: (i % group, i // group))[: max(num_samples, 0)]
    rewards = {name: list(values) for name, values in logs["rewards"].items()}
    extra = {name: list(values) for name, values in logs["extra"].items()}
    advantages = list(logs["advantages"])
    samples = []
    for i in order:
        sample = {"prompt": _prompt_text(prompts[i]), "completion": completion_text(completions[i])}
        sample["rewards"] = {name: _finite(values[i]) for name, values in rewards.items() if i < len(values)}
        if i < len(advantages):
            sample["advantage"] = _finite(advantages[i])
        sample.update({name: values[i] for name, values in extra.items() if i < len(values)})
        samples.append(sample)
    return samples


class MetricsJsonlCallback(TrainerCallback):
    """Write each log record as one JSON line to `path` (flushed per line, so a crash keeps what was logged).

    Training records (those with a `reward`) also get `samples`: `num_samples` prompts with their completions and
    rewards (`completion_samples`), when the callback is given the trainer. TRL's own `log_completions=True` sends
    the same rows to wandb / trackio tables and `output_dir/completions/*.parquet`.

    A run resumed from a checkpoint (`trainer.train(resume_from_checkpoint=...)`) keeps the file's records up to the
    checkpoint's step and appends to them, so the file holds every logged step once; a fresh run starts it empty.
    Nothing is written before training begins.
    """

    def __init__(self, path: str | os.PathLike, trainer: Any = None, num_samples: int = 4) -> None:
        self.path = os.fspath(path)
        self.trainer = trainer
        self.num_samples = num_samples

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the file: empty for a fresh run; for a resumed one (its state restored, so `global_step > 0`), the
        records up to the checkpoint's step, since the steps after it are trained (and logged) again."""
        if state.is_world_process_zero:
            keep_records_up_to(self.path, state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Append one JSON line per log record (main process only)."""
        if not logs or not state.is_world_process_zero:
            return
        record = {"step": state.global_step, **{k: _finite(v) for k, v in logs.items()}}
        if self.trainer is not None and self.num_samples and "reward" in logs:
            record["samples"] = completion_samples(self.trainer, self.num_samples)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def keep_records_up_to(path: str | os.PathLike, step: int) -> None:
    """Cut the metrics file at `path` back to the records of steps <= `step` (`step` 0: none), rewritten atomically.

    The final record of a run that ended (transformers' `train_runtime` summary) goes too: a resumed run writes its
    own at its end. A line cut short by a kill (the record being written) is dropped, with a warning.
    """
    path = os.fspath(path)
    kept, unreadable = [], 0
    if step > 0 and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    unreadable += 1
                    continue
                if record.get("step", 0) <= step and "train_runtime" not in record:
                    kept.append(line if line.endswith("\n") else line + "\n")
    if unreadable:
        logger.warning("%s: dropped %d line(s) that are not JSON (a record cut short by a kill).", path, unreadable)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _curve_label(key: str) -> str | None:
    """The plotted name of a log key: `reward`, or a reward function's name for `rewards/<name>/mean`."""
    if key == "reward":
        return "mean reward"
    if key.startswith("rewards/") and key.endswith("/mean"):
        return key[len("rewards/") : -len("/mean")]
    return None


class LivePlotCallback(TrainerCallback):
    """A reward / accuracy plot redrawn at every logging step: in Jupyter one image updated in place, elsewhere
    one text line per logging step.

    Curves: the mean (weighted) reward and each reward function's mean, e.g. `choice_accuracy` or
    `think_answer_format`. `add_reference(label, value)` draws a horizontal line such as the held-out accuracy
    before training. `figure_png()` gives the current plot as PNG bytes (e.g. to save it from a script).
    """

    def __init__(self, title: str = "GRPO training", notebook: bool | None = None) -> None:
        self.title = title
        self.notebook = in_notebook() if notebook is None else notebook
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.references: dict[str, float] = {}
        self._handle: Any = None

    def add_reference(self, label: str, value: float) -> None:
        """A dashed horizontal line (e.g. `"held-out accuracy before", 0.25`), shown from the next redraw."""
        self.references[label] = float(value)
        if self._handle is not None:
            self._redraw()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Record the reward curves of a training log record and redraw (or print them)."""
        if not logs or "reward" not in logs or not state.is_world_process_zero:
            return
        shown = []
        for key, value in logs.items():
            label = _curve_label(key)
            if label is not None and value is not None and math.isfinite(value):
                self.history.setdefault(label, []).append((state.global_step, float(value)))
                shown.append(f"{label} {value:.3f}")
        if self.notebook:
            self._redraw()
        else:
            print(f"step {state.global_step}/{state.max_steps}  " + "  ".join(shown), flush=True)

    def figure_png(self, dpi: int = 100) -> bytes:
        """The current plot as PNG bytes (matplotlib's Agg canvas: no GUI backend or pyplot state involved)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 3.6))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for label, points in self.history.items():
            steps, values = zip(*points) if points else ((), ())
            ax.plot(steps, values, marker="." if len(points) < 50 else None, label=label)
        for i, (label, value) in enumerate(self.references.items()):
            ax.axhline(value, linestyle="--", color=f"C{len(self.history) + i}", label=f"{label} ({value:.2f})")
        ax.set_xlabel("step")
        ax.set_ylabel("reward / accuracy")
        ax.set_title(self.title, fontsize=10)
        if self.history or self.references:
            ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        return buffer.getvalue()

    def _redraw(self) -> None:
        from IPython.display import Image, display

        image = Image(data=self.figure_png(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)


def _shown(value: Any, spec: str) -> str:
    """`value` formatted by `spec`; `–` for a value that is not a finite number (TRL logs None or NaN for a reward no
    function scored)."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, spec)
    return "–"


def reward_summary(logs: dict[str, Any], accuracy: str | None = None) -> dict[str, str]:
    """The few numbers worth watching in a training log record: the mean training reward, each reward function's
    mean under its own name when there are several (one function's mean is the reward itself: shown once), the one
    named `accuracy` first, the KL, and with tools the calls per rollout and the malformed ones, formatted (`–` where
    a value is None or NaN). These are training numbers, not the held-out accuracy the command prints before and after.

    >>> reward_summary({"reward": None, "rewards/score/mean": float("nan"), "kl": 0.0123})
    {'reward': '–', 'kl': '0.0123'}
    """
    shown = {}
    if "reward" in logs:
        shown["reward"] = _shown(logs["reward"], ".3f")
    means = {k[len("rewards/") : -len("/mean")]: v for k, v in logs.items() if k.startswith("rewards/") and
             k.endswith("/mean")}  # fmt: skip
    if len(means) > 1:
        for name in sorted(means, key=lambda n: n != accuracy):  # the accuracy reward first, the others as logged
            shown[name[:16]] = _shown(means[name], ".3f")
    if "kl" in logs:
        shown["kl"] = _shown(logs["kl"], ".3g")
    # A run with tools: calls per rollout, and the turns that opened a call and wrote none that parses (what sampling
    # breaks first).
    for key, name in (("tools/call_frequency", "calls"), ("tools/malformed_frequency", "malformed")):
        if key in logs:
            shown[name] = _shown(logs[key], ".2f")
    return shown


class RewardProgressBar(ProgressCallback):
    """transformers' training progress bar with `reward_summary` in its postfix; replaces `ProgressCallback` and
    `PrinterCallback`, which print every log record as a dict.

    Args:
        accuracy: the name of the reward reported as accuracy (shown first of the rewards), or None.
    """

    def __init__(self, accuracy: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.accuracy = accuracy

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Put the training record's summary in the bar's postfix (main process only)."""
        if state.is_world_process_zero and self.training_bar is not None and logs and "reward" in logs:
            self.training_bar.set_postfix(reward_summary(logs, self.accuracy), refresh=True)


def close_progress_bars(trainer: Any) -> None:
    """Close the trainer's progress bars (transformers closes them only when training ends normally), so a line
    printed after a run that stopped on an error is not followed by the bar tqdm redraws when it exits."""
    for callback in trainer.callback_handler.callbacks:
        for name in ("training_bar", "prediction_bar"):
            bar = getattr(callback, name, None)
            if bar is not None:
                bar.close()
                setattr(callback, name, None)


class RewardPrinter(TrainerCallback):
    """One short line per training log record, `step 10/400  reward 0.531  kl 0.0012`: the progress where no bar is
    wanted (`disable_tqdm`, logs read later).

    Args:
        accuracy: the name of the reward reported as accuracy (shown first of the rewards), or None.
    """

    def __init__(self, accuracy: str | None = None) -> None:
        self.accuracy = accuracy

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Print the training record's summary (main process only)."""
        if state.is_world_process_zero and logs and "reward" in logs:
            shown = "  ".join(f"{k} {v}" for k, v in reward_summary(logs, self.accuracy).items())
            print(f"step {state.global_step}/{state.max_steps}  {shown}", flush=True)


def plot_reward_curve(
    metrics_path: str | os.PathLike,
    png_path: str | os.PathLike,
    *,
    title: str,
    before: float = math.nan,
    after: float = math.nan,
    max_steps: int | None = None,
) -> None:
    """Draw `reward_curve_figure` to `png_path`. The PNG is written to a temporary name and moved into place, so a
    reader never sees half a file."""
    fig = reward_curve_figure(metrics_path, title=title, before=before, after=after, max_steps=max_steps)
    png_path = os.fspath(png_path)
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, png_path)


def reward_curve_figure(
    metrics_path: str | os.PathLike,
    *,
    title: str,
    before: float = math.nan,
    after: float = math.nan,
    max_steps: int | None = None,
) -> Any:
    """The mean training reward per logging step of `metrics_path` (`MetricsJsonlCallback`'s file), with the held-out
    accuracy `before` and `after` training as dashed lines (left out when NaN), as a matplotlib `Figure` drawn on
    the Agg canvas (no pyplot global state, no GUI backend). The step axis runs from 0 to `max_steps` (default: the
    last step logged) and the reward axis spans at least 0 to 1, so a short curve, even one point, is drawn where it
    lies."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, rewards = [], []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if isinstance(record.get("reward"), (int, float)):  # null: no reward function scored that step
                steps.append(record["step"])
                rewards.append(record["reward"])
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, rewards, marker=".", label="mean training reward")
    if not math.isnan(before):
        ax.axhline(before, color="gray", linestyle="--", label=f"held-out accuracy before ({before:.2f})")
    if not math.isnan(after):
        ax.axhline(after, color="green", linestyle="--", label=f"held-out accuracy after ({after:.2f})")
    # Matplotlib zooms onto the data: one point at step 5 made a 4.8-5.2 axis. Steps from 0, rewards from 0 to 1 at
    # least (further where a reward or an accuracy lies outside).
    ax.set_xlim(0, max([max_steps or 0, *steps, 1]))
    values = [v for v in (*rewards, before, after) if math.isfinite(v)]
    ax.set_ylim(min([0.0, *values]) - 0.05, max([1.0, *values]) + 0.05)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig

"""After a `vlm-grpo` run trains: the model to `final/`, the held-out accuracy after (with tools too), `eval.json` and the
reward plot (`finish`); and held-out accuracy with the tools, multi-turn (`with_tools`), before training as well."""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import TYPE_CHECKING, Any

from .args import TINY_PREFIX, ScriptArguments

if TYPE_CHECKING:
    from .task import Task

__all__ = ["ONE_TURN", "WARM_START_DIR", "finish", "warm_start_saved", "with_tools"]

ONE_TURN = "  (one turn, without tools)"
WARM_START_DIR = "warm-start"  # the model after --warm_start, where TRL loads the KL reference from


def warm_start_saved(script: Any, config: Any) -> bool:
    """Whether the run saves the warm-started model (`WARM_START_DIR`): a warm start, fully trained weights and a KL
    term (TRL builds a fully trained model's reference again from its config's path; with LoRA it is the adapter off)."""
    return bool(script.warm_start and config.beta and not script.use_peft)


def with_tools(trainer: Any, task: Task, when: str, seed: int) -> dict[str, float]:
    """Held-out accuracy with the tools, multi-turn, as the rollouts run (`evaluate_with_tools`), printed; its
    metrics under `with_tools/`."""
    from ..training.evaluation import evaluate_with_tools

    metrics = evaluate_with_tools(trainer, task.test, task.eval_funcs, seed=seed)
    print(f"held-out accuracy {when}, with tools: {metrics['accuracy']:.3f}  (multi-turn, as the rollouts run; "
          f"{metrics['tools/call_frequency']:.2f} tool calls per rollout, {metrics['tools/failure_frequency']:.0%} of "
          "them refused)", flush=True)  # fmt: skip
    return {f"with_tools/{k}": v for k, v in metrics.items()}


def _save_final(trainer: Any, processor: Any, final: str) -> None:
    """The trained model and its processor to `final`, written atomically by rank 0, with its model card (whose quick
    start loads `final`; the card TRL keeps in --output_dir for checkpoints is pointed there too); a failed write is
    one line (`vlm_grpo.training.checkpoint_writes.CheckpointWriteError`)."""
    from ..models.export import atomic_directory
    from ..training.callbacks import library_bars_off
    from ..training.checkpoint_writes import final_write_error

    # A collective (sharded weights are gathered on every rank); rank 0 writes.
    try:
        if trainer.accelerator.is_main_process:
            card = os.path.join(trainer.args.output_dir, "README.md")
            had_card = os.path.exists(card)
            with atomic_directory(final) as tmp, library_bars_off():
                trainer.save_model(tmp)
                processor.save_pretrained(tmp)
                name = os.path.basename(os.path.normpath(trainer.args.output_dir))  # as TRL names it
                trainer.create_model_card(model_name=name, model_dir=final)
                os.replace(card, os.path.join(tmp, "README.md"))
            if had_card:  # checkpoints wrote one: it now names final/ as well
                shutil.copyfile(os.path.join(final, "README.md"), card)
        else:
            with library_bars_off():
                trainer.save_model(final)  # joins the gather; writes nothing off rank 0
    except Exception as error:
        raise final_write_error(error, final, trainer.args.output_dir, trainer.model) from error
    trainer.accelerator.wait_for_everyone()


def finish(
    script: ScriptArguments, config: Any, task: Task, trainer: Any, processor: Any, before: dict, score: dict
) -> dict[str, float]:
    """After training: `final/`, the held-out accuracy after, `eval.json` and the reward plot; the metrics returned."""
    from ..models.sharded import full_weights
    from ..training.callbacks import plot_reward_curve
    from ..training.evaluation import evaluate

    # Saved before the held-out evaluation, so a failure there cannot lose it.
    _save_final(trainer, processor, os.path.join(config.output_dir, "final"))

    results: dict[str, float] = {}
    if task.test is not None:
        with full_weights(trainer.model_wrapped):  # a sharded model gathered once, not per layer per token
            after = evaluate(trainer.model, processor, task.test, task.eval_funcs, **score)
        chance = "" if task.chance is None else f"  chance {task.chance:.3f}"
        print(f"held-out accuracy after training:  {after['accuracy']:.3f}{chance}{ONE_TURN if script.tools else ''}",
              flush=True)  # fmt: skip
        if script.tools:
            with full_weights(trainer.model_wrapped):
                after |= with_tools(trainer, task, "after training", config.seed)
        results = {f"before/{k}": v for k, v in before.items()} | {f"after/{k}": v for k, v in after.items()}
    if not trainer.accelerator.is_main_process:
        return results
    tmp_json = os.path.join(config.output_dir, "eval.json.tmp")
    with open(tmp_json, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp_json, os.path.join(config.output_dir, "eval.json"))
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    plot_reward_curve(metrics_path, os.path.join(config.output_dir, "reward_curve.png"),
                      title=f"GRPO: {task.name} — {script.model}", before=before.get("accuracy", math.nan),
                      after=results.get("after/accuracy", math.nan), max_steps=trainer.state.max_steps)  # fmt: skip
    base = ", tiny-base/ (the model it started from)" if script.model.startswith(TINY_PREFIX) else ""
    if script.warm_start and os.path.isdir(os.path.join(config.output_dir, WARM_START_DIR)):
        base += f", {WARM_START_DIR}/ (after the warm start: GRPO's start and KL reference)"
    print(f"wrote {config.output_dir}/: metrics.jsonl, reward_curve.png, eval.json, final/{base}", flush=True)
    return results

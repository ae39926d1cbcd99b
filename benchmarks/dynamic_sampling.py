"""Dynamic sampling against plain GRPO: held-out accuracy by optimizer step and by wall time (CPU, tiny model).

    python benchmarks/dynamic_sampling.py OUT --steps 200 --eval_every 10

The task is the demo's (tiny Qwen2.5-VL from random init, which colour is the shape, 4 prompts x 16 completions
per step, lr 5e-4), with a known share of the training prompts (`--ungraded`, default half) ungraded: their reward
is 0 whatever the answer, so their groups always have zero reward variance. Held-out accuracy: greedy answers to 64
test prompts, scored by the colour reward. Both runs use the same seed; the clock excludes the held-out evaluations (run in
`torch.random.fork_rng`, so they leave the training's random stream alone). Writes OUT/dynamic_sampling.json and
prints a markdown table.

`train_and_evaluate` is also what tests/test_dynamic_sampling.py's learning check runs, with fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def train_and_evaluate(
    out_dir: str, dynamic: bool, steps: int, eval_every: int, ungraded: float = 0.5, seed: int = 0,
    max_sampling_rounds: int = 4, train_size: int = 512, test_size: int = 64,
) -> dict[str, Any]:  # fmt: skip
    """One run; returns the held-out accuracy every `eval_every` steps with the training wall time, and each logged
    step's metrics."""
    import torch
    from transformers import TrainerCallback

    from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.rewards import make_choice_reward
    from vlm_grpo.tiny import build_tiny_vlm
    from vlm_grpo.training.evaluation import evaluate
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    torch.set_num_threads(1)
    colors = answer_words("color", 1)
    choice = make_choice_reward(colors)

    def graded_choice(prompts, completions, answer, graded, **kwargs):
        scores = choice(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return [score if g else 0.0 for score, g in zip(scores, graded, strict=True)]

    train = make_visual_reasoning_dataset("color", train_size, seed=seed)
    every = round(1 / ungraded) if ungraded else 0  # ungraded: every `every`-th prompt
    train = train.add_column("graded", [not every or i % every != 0 for i in range(train_size)])
    test = make_visual_reasoning_dataset("color", test_size, seed=seed, split="test")
    path = build_tiny_vlm("qwen2_5_vl", os.path.join(out_dir, "tiny"), seed=seed, words=colors)
    model, processor = FastVisionModel.from_pretrained(path, full_finetuning=True)

    class HeldOut(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.paused, self.points = time.perf_counter(), 0.0, []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % eval_every:
                return
            began = time.perf_counter()
            with torch.random.fork_rng():
                accuracy = evaluate(kwargs["model"], processor, test, [choice], max_new_tokens=4)["accuracy"]
            self.points.append({"step": state.global_step, "wall_s": round(began - self.start - self.paused, 2),
                                "accuracy": accuracy})  # fmt: skip
            self.paused += time.perf_counter() - began

    config = VLMGRPOConfig(
        output_dir=os.path.join(out_dir, "dynamic" if dynamic else "plain"), per_device_train_batch_size=64,
        num_generations=16, max_completion_length=4, learning_rate=5e-4, lr_scheduler_type="constant", beta=0.04,
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=seed, dynamic_sampling=dynamic, max_sampling_rounds=max_sampling_rounds,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [graded_choice], args=config, train_dataset=train, processing_class=processor)
    held_out = HeldOut()
    trainer.add_callback(held_out)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    return {"dynamic": dynamic, "points": held_out.points, "logged": logged}


def _table(runs: list[dict[str, Any]]) -> str:
    rows = ["| step | plain: accuracy | plain: wall s | dynamic: accuracy | dynamic: wall s |", "|---|---|---|---|---|"]
    plain, dynamic = (next(r for r in runs if r["dynamic"] is d)["points"] for d in (False, True))
    for a, b in zip(plain, dynamic, strict=True):
        rows.append(
            f"| {a['step']} | {a['accuracy']:.3f} | {a['wall_s']:.1f} | {b['accuracy']:.3f} | {b['wall_s']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--ungraded", type=float, default=0.5, help="share of training prompts with a constant reward")
    parser.add_argument("--max_sampling_rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = (args.steps, args.eval_every, args.ungraded, args.seed, args.max_sampling_rounds)
    runs = [train_and_evaluate(args.out_dir, dynamic, *settings) for dynamic in (False, True)]
    with open(os.path.join(args.out_dir, "dynamic_sampling.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    print(_table(runs))


if __name__ == "__main__":
    main()

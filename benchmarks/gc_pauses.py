"""Python's garbage-collection pauses in each GRPO step, with `gc_freeze` on and off (off by default).

A full collection walks every object the collector tracks; after a first step that compiled the training layers there
are ~0.7 million on `--model tiny-deep` (the 3B's 36 decoder layers and 32 vision blocks at tiny widths, on CPU).
Each arm runs in its own process; the table lists every step's time (with the freeze that follows it) and the full
collections in it, and the objects the collector tracks and those frozen after it.

    python benchmarks/gc_pauses.py --steps 8            # CPU, ~3 minutes; results in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time


def run_arm(freeze: bool, steps: int, model: str) -> list[dict]:
    import torch
    from datasets import Dataset
    from PIL import Image
    from real_arch import build_checkpoint
    from transformers import TrainerCallback

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer

    torch.set_num_threads(1)
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    began: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        else:
            pauses[info["generation"]].append(time.perf_counter() - began.pop())

    gc.callbacks.append(timer)
    records: list[dict] = []

    class Steps(TrainerCallback):
        """A step's time runs from its begin to the next step's (or the run's end): the freeze that follows a step's
        end (a later callback's, with its collection) counts in the step it follows, as do the collections in it."""

        start: float | None = None

        def _close(self, state) -> None:
            if self.start is not None:
                records.append({"step": state.global_step, "step_s": time.perf_counter() - self.start,
                                "collections": {g: [len(p), 1000 * sum(p)] for g, p in pauses.items()},
                                "tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()})  # fmt: skip

        def on_step_begin(self, args, state, control, **kwargs):
            self._close(state)
            for p in pauses.values():
                p.clear()
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self._close(state)

    path = build_checkpoint(model, os.path.join(tempfile.gettempdir(), f"ckpt-{model}"))
    model_, processor = FastVisionModel.from_pretrained(path)
    model_ = FastVisionModel.get_peft_model(model_, r=16, lora_alpha=16)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "image": Image.new("RGB", (112, 112), (i * 40 % 255, 80, 160))} for i in range(16)]  # fmt: skip
    config = VLMGRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=16, max_steps=steps, report_to="none", save_strategy="no",
                           use_cpu=True, disable_tqdm=True, seed=0, compile_layers=True, gc_freeze=freeze)  # fmt: skip

    def reward(prompts, completions, **kwargs):
        return [float(len(str(c)) % 3) for c in completions]

    trainer = VLMGRPOTrainer(model_, [reward], args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=processor, callbacks=[Steps()])  # fmt: skip
    trainer.train()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default="tiny-deep", help="a real_arch.py name (tiny-deep on CPU)")
    p.add_argument("--arm", choices=("on", "off"), help=argparse.SUPPRESS)  # a worker process
    args = p.parse_args()
    if args.arm:
        print("RECORDS " + json.dumps(run_arm(args.arm == "on", args.steps, args.model)), flush=True)
        return
    arms = {}
    for arm in ("off", "on"):
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps), "--model",
                              args.model], capture_output=True, text=True, check=True).stdout  # fmt: skip
        arms[arm] = json.loads(next(line for line in out.splitlines() if line.startswith("RECORDS "))[8:])
    print(f"{args.model}, {args.steps} steps, 8 rows a step, compiled training layers, one CPU thread\n")
    print("| step | gc_freeze off: step s | full collections (ms) | objects tracked | gc_freeze on: step s "
          "| full collections (ms) | objects tracked / frozen |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for off, on in zip(arms["off"], arms["on"]):
        print(f"| {off['step']} | {off['step_s']:.2f} | {off['collections']['2'][0]} ({off['collections']['2'][1]:.0f}) "
              f"| {off['tracked']} | {on['step_s']:.2f} | {on['collections']['2'][0]} ({on['collections']['2'][1]:.0f}) "
              f"| {on['tracked']} / {on['frozen']} |")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

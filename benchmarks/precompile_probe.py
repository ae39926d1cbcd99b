"""Whether compiling the training layers on a one-layer copy of a model fills the compile caches for the whole model.

    python benchmarks/precompile_probe.py                       # CPU, tiny Qwen2.5-VL; about 2 minutes on 2 cores
    python benchmarks/precompile_probe.py --precompile_batch 2  # the copy's run with another batch size

Issue #48: on a fresh machine the first step spends 15-20 s compiling the training layers (`engine.compiled_layers`:
one graph per layer class, forward and backward), after the first generation. A background process compiling them
on a one-layer copy while the first generation runs would leave the training step to load them from Inductor's cache,
if the copy's graphs are the full model's. This probe runs one GRPO step (compiled layers on, LoRA, TRL's plain
generation) three times, each a fresh process with its own empty Inductor cache unless said:

1. `precompile`: the one-layer copy (one decoder layer, one vision block), another task and completion length;
2. `after precompile`: the full tiny model on the caches run 1 filled;
3. `fresh`: the full tiny model on empty caches.

It prints each run's seconds and Inductor's FX-graph cache hits and misses. GPU: `cold_start.py --precompiled`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # real_arch


def _step(path: str, task: str, batch: int, completion_length: int) -> dict:
    """One GRPO step on `path` with compiled training layers; Inductor's cache counters after it."""
    import torch._dynamo.utils

    from vlm_grpo.data import make_visual_reasoning_dataset
    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    torch.set_num_threads(1)
    model, processor = FastVisionModel.from_pretrained(path)
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, num_generations=2,
                         max_completion_length=completion_length, max_steps=1, report_to="none", save_strategy="no",
                         use_cpu=True, disable_tqdm=True, compile_layers=True, fast_generation=False)  # fmt: skip
    rows = make_visual_reasoning_dataset(task, 8, seed=0)
    trainer = VLMGRPOTrainer(model, [lambda completions, **kw: [float(len(c)) for c in completions]], args=args,
                             train_dataset=rows, processing_class=processor)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    inductor = torch._dynamo.utils.counters["inductor"]
    return {"seconds": time.perf_counter() - start, "hits": inductor.get("fxgraph_cache_hit", 0),
            "misses": inductor.get("fxgraph_cache_miss", 0)}  # fmt: skip


def _models(root: str) -> tuple[str, str]:
    """The tiny Qwen2.5-VL (two decoder layers, two vision blocks) and its one-layer copy (`real_arch.py`)."""
    from real_arch import build_checkpoint

    return build_checkpoint("tiny", os.path.join(root, "full")), build_checkpoint(
        "tiny-shallow", os.path.join(root, "shallow")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precompile_batch", type=int, default=8, help="rows per step of the one-layer copy's run")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # path task batch completion_length
    args = parser.parse_args(argv)
    if args.worker:
        path, task, batch, length = args.worker
        print("RESULT " + json.dumps(_step(path, task, int(batch), int(length))), flush=True)
        return
    root = tempfile.mkdtemp(prefix="precompile-probe-")
    full, shallow = _models(root)
    runs = [("precompile (one-layer copy, count task, 4 tokens)", shallow, "count", args.precompile_batch, 4, "pre"),
            ("after precompile (full model, colour task, 16 tokens)", full, "color", 8, 16, "pre"),
            ("fresh (full model, colour task, 16 tokens)", full, "color", 8, 16, "fresh")]  # fmt: skip
    lines = ["| run | rows | step s | FX-graph cache hits | misses |", "|---|---|---|---|---|"]
    for name, path, task, batch, length, caches in runs:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, caches), OMP_NUM_THREADS="1",
                   VLM_GRPO_CACHE=os.path.join(root, f"ours-{name[:5]}"))  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, task, str(batch), str(length)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(found[-1][len("RESULT ") :])
        lines.append(f"| {name} | {batch} | {r['seconds']:.1f} | {r['hits']} | {r['misses']} |")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

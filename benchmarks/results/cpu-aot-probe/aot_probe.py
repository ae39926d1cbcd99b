"""Would a saved, ahead-of-time compiled training forward skip Dynamo on a warm start? (issue #48, CPU probe)

    python benchmarks/results/cpu-aot-probe/aot_probe.py        # from the repository root; about 2 minutes on 2 cores

The tiny Qwen2.5-VL trainer (LoRA on both towers, checkpointing, whole-layer compiles), its first loss and backward
with compiled layers, each run in a new process with its own Inductor cache folder:

1. `compile, fresh`: torch.compile as the trainer does, empty caches;
2. `compile, cached`: the same on what run 1 left (Dynamo traces again, Inductor's code comes from its cache);
3. `aot, fresh`: the decoder layer's forward compiled ahead of time and saved (`vlm_grpo.engine.aot_layers`);
4. `aot, loaded`: run 3's file loaded: no Dynamo trace for that layer.

The vision MLPs compile as in runs 1-2 in every run. Prints each run's seconds and its worst gradient's relative
difference from the eager one.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]


def run(mode: str, folder: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from test_compiled_layers import _loss_and_grads
    from test_shared_prefix import _batch, _trainer

    from vlm_grpo.engine import compiled_layers
    from vlm_grpo.engine.aot_layers import AheadOfTime
    from vlm_grpo.tiny import build_tiny_vlm

    torch.manual_seed(0)
    tiny = pathlib.Path(folder) / "tiny"
    tiny.mkdir(exist_ok=True)
    trainer = _trainer(lambda family, **kw: build_tiny_vlm(family, tiny, seed=0, **kw), pathlib.Path(tempfile.mkdtemp()),
                       "qwen2_5_vl", lora="both", gc=True)  # fmt: skip
    inputs = _batch(trainer, "qwen2_5_vl")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    eager = _loss_and_grads(trainer, inputs)[1]
    compiled = compiled_layers.CompiledLayers()
    if mode != "compile":  # the decoder layer through `engine.aot_layers` (compiled and saved, or loaded)
        compiled.ahead = AheadOfTime(os.path.join(folder, "aot"))
    compiled.attach(trainer.model, unit="layers")
    start = time.perf_counter()
    grads = _loss_and_grads(trainer, inputs)[1]
    seconds = time.perf_counter() - start
    worst = max(((grads[k] - g).norm() / g.norm()).item() for k, g in eager.items())
    return {"seconds": seconds, "worst_grad_rel": worst, "same_parameters": set(grads) == set(eager)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        print(json.dumps(run(sys.argv[2], sys.argv[3])))
        return
    compile_dir, aot_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    rows = []
    for name, mode, folder in (("compile, fresh", "compile", compile_dir), ("compile, cached", "compile", compile_dir),
                               ("aot, fresh", "aot-save", aot_dir), ("aot, loaded", "aot-load", aot_dir)):  # fmt: skip
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"))
        out = subprocess.run([sys.executable, __file__, "--worker", mode, folder], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    print("| run | first compiled loss + backward s | worst gradient, relative to eager | same parameters |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['seconds']:.1f} | {r['worst_grad_rel']:.1e} | {r['same_parameters']} |")


if __name__ == "__main__":
    main()

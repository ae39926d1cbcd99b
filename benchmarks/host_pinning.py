"""How long pinning the LoRA merge's host backup takes, by method, and what it costs a GPU loop running beside it.

    python benchmarks/host_pinning.py                       # Qwen2.5-VL-3B's adapted weights (5.6 GiB)
    python benchmarks/host_pinning.py --model qwen2.5-vl-7b

`engine.lora_merge.BaseWeightBackup` keeps one pinned host copy of every weight LoRA is merged into. A cached first
step of the 3B spent 3.9 s in `torch.empty(..., pin_memory=True)` (`benchmarks/results/h200-vllm-3b-2x8-r3`). Each
method runs in a fresh process (torch's pinned allocator caches what it made):

- `per-tensor`: one `torch.empty(pin_memory=True)` per weight (the caching host allocator, `cudaHostAlloc`; each
  size rounded up to a power of two);
- `per-tensor-register`: the same with `pinned_use_cuda_host_register:True,pinned_num_register_threads:8` (malloc,
  pages mapped by 8 threads, then `cudaHostRegister`): what `engine.pinned_pool.use_fast_pinning` sets.

For each: the allocation's wall time, the same allocation on a background thread while the main thread launches small
kernels (how much slower those launches get: the driver lock `cudaHostAlloc` holds), and the host-to-device copy rate
of a restore from the buffers. Prints a markdown table; `--out` also writes it with the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

METHODS = ("per-tensor", "per-tensor-register")


def adapted_shapes(model: str) -> list[tuple[int, int]]:
    """The (out, in) shapes of the linear layers LoRA r=16 "all linear" adapts in the model (language and vision)."""
    if model == "qwen2.5-vl-3b":
        hidden, inter, layers, kv = 2048, 11008, 36, 256
    elif model == "qwen2.5-vl-7b":
        hidden, inter, layers, kv = 3584, 18944, 28, 512
    else:
        raise SystemExit(f"unknown model {model!r}")
    language = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                (hidden, inter)] * layers  # fmt: skip
    vision = [(3 * 1280, 1280), (1280, 1280), (3420, 1280), (3420, 1280), (1280, 3420)] * 32
    return language + vision


def _allocate(method: str, shapes: list[tuple[int, int]]) -> list:
    import torch

    if method == "per-tensor-register":
        from vlm_grpo.engine.pinned_pool import FAST_PINNING

        torch._C._accelerator_setAllocatorSettings(FAST_PINNING)
    return [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for shape in shapes]


def worker(method: str, model: str) -> dict:
    """One method in this process: allocation alone, then beside a kernel loop, then a restore's copy rate."""
    import torch

    shapes = adapted_shapes(model)
    device = torch.device("cuda")
    torch.ones(1, device=device)  # the context made before any timing
    x = torch.ones(64, 64, device=device)

    def kernel_loop(seconds: float) -> float:
        """Kernels launched per second over `seconds` (small ones: the rate is the host's launch rate)."""
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(100):
                x.mul_(1.0)
            n += 100
        torch.cuda.synchronize()
        return n / seconds

    alone_rate = kernel_loop(1.0)
    start = time.perf_counter()
    buffers = _allocate(method, shapes)
    alloc_s = time.perf_counter() - start
    nbytes = sum(b.numel() * b.element_size() for b in buffers)
    assert all(b.is_pinned() for b in buffers), "a buffer is not pinned"
    del buffers
    torch.cuda.empty_cache()
    empty = getattr(torch._C, "_host_emptyCache", None) or torch._C._accelerator_emptyHostCache
    empty()  # so the background run pins again

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(buffers=_allocate(method, shapes)))
    start = time.perf_counter()
    thread.start()
    n, launch_start = 0, time.perf_counter()
    while thread.is_alive():
        for _ in range(100):
            x.mul_(1.0)
        n += 100
    background_s = time.perf_counter() - start
    beside_rate = n / (time.perf_counter() - launch_start)
    buffers = result["buffers"]
    weights = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in buffers]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for w, b in zip(weights, buffers):
        w.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    copy_gbs = nbytes / (time.perf_counter() - start) / 1e9
    return {"method": method, "gib": nbytes / 2**30, "tensors": len(shapes), "alloc_s": alloc_s,
            "background_s": background_s, "launches_per_s_alone": alone_rate, "launches_per_s_beside": beside_rate,
            "restore_gb_per_s": copy_gbs}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-3b", choices=("qwen2.5-vl-3b", "qwen2.5-vl-7b"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=None, help="folder for host_pinning.json / host_pinning.md")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model)), flush=True)
        return
    rows = []
    for method in args.methods.split(","):
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--worker", method],
                              capture_output=True, text=True, check=False)  # fmt: skip
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"{method}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        rows.append(json.loads(line[0][7:]))
    table = [f"{args.model}: the LoRA merge's host backup, {rows[0]['tensors'] if rows else '?'} tensors", "",
             "| method | GiB | pinning s | pinning s on a thread | launches/s alone | launches/s beside it | restore GB/s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        table.append(f"| {r['method']} | {r['gib']:.2f} | {r['alloc_s']:.2f} | {r['background_s']:.2f} | "
                     f"{r['launches_per_s_alone']:.0f} | {r['launches_per_s_beside']:.0f} | "
                     f"{r['restore_gb_per_s']:.1f} |")  # fmt: skip
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_pinning.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "host_pinning.md"), "w") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()

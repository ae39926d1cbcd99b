"""DDP vs FSDP2 (vs ZeRO-3) on the GPUs of one host, plus a two-"machine" run: one invocation, one table.

    python benchmarks/scale_out.py OUT --runs 1gpu-3b ddp-3b fsdp2-3b fsdp2-3b-gather fsdp2-3b-resume    # 2 GPUs
    python benchmarks/scale_out.py OUT --runs ddp-3b-x4 fsdp2-7b-full ddp-7b-full fsdp2-32b-vllm-tp4 trl-fsdp2-32b \
        two-machines                                                                                         # 4 GPUs

Each run is `accelerate launch --config_file examples/accelerate/<config>.yaml benchmarks/distributed_train.py`
(or the CLI, for the two-machine run) with the flags listed in RUNS; the per-rank reports land in OUT/<run>/ and
the summary in OUT/scale_out.json. A run that fails is recorded with the tail of its error (an out-of-memory is
a result here: it is the figure beside the FSDP2 run that fits).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "benchmarks", "distributed_train.py")
# 448x448 images (256 image tokens), 64 new tokens, G=4 completions of 8 rows per GPU: a short but real step.
REAL = ["--image_size", "448", "--max_completion_length", "64", "--batch", "8", "--generations", "4"]
X4 = ["--num_processes", "4"]
# 32B: loaded in host memory on each rank (4 x 64 GB of the host's 512), so only FSDP2's shards reach the GPUs and
# vLLM, started before them, finds its share free; after training no check holds the whole model on a GPU (the first
# run trained its 3 steps, then went out of memory gathering all 64 GB beside vLLM to compare the sync's weights).
BIG = [*REAL, "--device_map", "cpu", "--stream_checks"]
# name -> (accelerate config, distributed_train.py flags, extra `accelerate launch` flags)
RUNS = {
    "1gpu-3b": ("ddp", ["--model", "qwen2.5-vl-3b", "--steps", "5", *REAL], ["--num_processes", "1"]),
    "ddp-3b": ("ddp", ["--model", "qwen2.5-vl-3b", "--steps", "5", *REAL], []),
    "ddp-3b-x4": ("ddp", ["--model", "qwen2.5-vl-3b", "--steps", "5", *REAL], X4),
    # FSDP2 as shipped: generation from the unsharded copy (compiled), the layers' training forward compiled.
    "fsdp2-3b": ("fsdp2", ["--model", "qwen2.5-vl-3b", "--steps", "5", "--save_steps", "3", "--export", *REAL], []),
    # The path before the copy: the shards gathered for each rollout, decoding eagerly.
    "fsdp2-3b-gather": ("fsdp2", ["--model", "qwen2.5-vl-3b", "--steps", "5", "--no_generation_copy", *REAL], []),
    "fsdp2-3b-resume": (
        "fsdp2",
        [
            "--model",
            "qwen2.5-vl-3b",
            "--steps",
            "5",
            "--resume",
            "{out}/fsdp2-3b/run/checkpoint-3",
            "--out_from",
            "fsdp2-3b",
            *REAL,
        ],
        [],
    ),
    "zero3-3b": ("zero3", ["--model", "qwen2.5-vl-3b", "--steps", "5", *REAL], []),
    # Full fine-tuning with fp32 master weights: 7.6 B x (4 weights + 4 grads + 8 Adam) bytes = 122 GB per replica
    # before activations and the reference model, so DDP cannot hold it on one 80 GB GPU; FSDP2 over 2 or 4 can.
    "fsdp2-7b-full": (
        "fsdp2",
        ["--model", "qwen2.5-vl-7b", "--full", "--dtype", "float32", "--steps", "3", "--lr", "1e-6", *REAL],
        X4,
    ),
    "ddp-7b-full": (
        "ddp",
        ["--model", "qwen2.5-vl-7b", "--full", "--dtype", "float32", "--steps", "3", "--lr", "1e-6", *REAL],
        X4,
    ),
    # A model one GPU cannot hold for generation (32B: 64 GB in bf16): FSDP2 training, rollouts through vLLM with
    # tensor parallelism over the 4 GPUs; beside it TRL's own FSDP2 path (generate through FSDP's hooks).
    "fsdp2-32b-vllm-tp4": (
        "fsdp2",
        ["--model", "qwen2.5-vl-32b", "--steps", "3", "--use_vllm", "--vllm_tp", "4", "--vllm_memory", "0.35", *BIG],
        X4,
    ),
    "trl-fsdp2-32b": ("fsdp2", ["--model", "qwen2.5-vl-32b", "--steps", "3", "--trl", *BIG], X4),
}


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a launcher and every rank it started (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _launch(config: str, args: list[str], out: str, timeout: int, extra: list[str] = (), env=None) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "examples", "accelerate", f"{config}.yaml"), *extra, TRAIN, out, *args]  # fmt: skip
    start = time.perf_counter()
    # Its own process group: a timeout kills accelerate's ranks too, not only the launcher (a rank left running kept
    # 53 GiB on a GPU and the next run died out of memory).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _, err = proc.communicate()
        rc = "timeout"
    result = {"rc": rc, "wall_s": round(time.perf_counter() - start, 1)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "stderr.log"), "w") as f:  # the whole traceback of a failed run, beside its summary
        f.write(err)
    ranks = (
        [os.path.join(out, f) for f in sorted(os.listdir(out)) if f.startswith("rank")] if os.path.isdir(out) else []
    )
    result["ranks"] = [_read_json(p) for p in ranks]
    if rc != 0:
        lines = [x for x in err.splitlines() if ("Error" in x or "out of memory" in x.lower()) and "Warning" not in x]
        result["error"] = lines[-6:] or err.splitlines()[-20:]
    return result


def _two_machines(out: str, timeout: int) -> dict:
    """Two accelerate "machines" (two GPUs each on a 4-GPU host, else one) meeting on localhost: the multi-node launch
    path, 3 CLI steps."""
    procs, start = [], time.perf_counter()
    import torch

    per_machine = 2 if torch.cuda.device_count() >= 4 else 1  # two "machines" of two GPUs each on a 4-GPU host
    for rank in (0, 1):
        gpus = ",".join(str(rank * per_machine + i) for i in range(per_machine))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "examples", "accelerate", "ddp.yaml"), "--num_machines", "2", "--machine_rank",
               str(rank), "--num_processes", str(2 * per_machine), "--main_process_ip", "127.0.0.1",
               "--main_process_port", "29655",
               "-m", "vlm_grpo.cli", "--output_dir", out, "--max_steps", "3", "--logging_steps", "1",
               "--train_size", "32", "--test_size", "8"]  # fmt: skip
        log = open(os.path.join(os.path.dirname(out), f"two-machines-rank{rank}.log"), "w")  # noqa: SIM115 (open while the process runs)
        procs.append(
            (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log)
        )
    rcs = []
    for proc, log in procs:
        try:
            rcs.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rcs.append("timeout")
        log.close()
    metrics = os.path.join(out, "metrics.jsonl")
    steps = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            steps = [json.loads(x).get("step") for x in f]
    final = sorted(os.listdir(os.path.join(out, "final"))) if os.path.isdir(os.path.join(out, "final")) else []
    return {"rc": rcs, "wall_s": round(time.perf_counter() - start, 1), "logged_steps": steps, "final": final}


def _row(name: str, result: dict) -> str:
    ranks = result.get("ranks") or []
    if not ranks:
        return f"| {name} | rc {result['rc']} | {' / '.join(result.get('error', []))[:300]} |"
    r = ranks[0]
    times = r["step_time_s"][1:] or r["step_time_s"]  # step 1 pays compilation / warm-up
    peaks = ", ".join(f"{x['peak_gib']:.1f}" for x in ranks if x.get("peak_gib") is not None)
    # a check after training that failed leaves no checksum: the row keeps the training's numbers and says so
    checked = all("checksum" in x for x in ranks)
    same = len({x["checksum"] for x in ranks}) == 1 if checked else f"check failed (rc {result.get('rc')})"
    lora = r.get("lora_b") or {}
    return (f"| {name} | {r['sharding'] or 'ddp'} | {r['steps']} | {sum(times) / len(times):.2f} | {peaks} | "
            f"{same} | {lora.get('vision_moved', '-')}/{lora.get('vision_total', '-')} + "
            f"{lora.get('language_moved', '-')}/{lora.get('language_total', '-')} | {r['fast_generation']['calls']} | "
            f"{r['shared_prefix_calls']} | {r.get('export') or ''} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--runs", nargs="+", default=["ddp-3b", "fsdp2-3b", "fsdp2-3b-resume", "two-machines"])
    parser.add_argument(
        "--timeout",
        type=int,
        default=300,
        help="seconds per run (fsdp2-3b with its export: 113 s with a warm compile cache)",
    )
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    summary_path = os.path.join(args.out_dir, "scale_out.json")
    summary = _read_json(summary_path) if os.path.exists(summary_path) else {}
    for name in args.runs:
        print(f"=== {name}", flush=True)
        if name == "two-machines":
            summary[name] = _two_machines(os.path.join(args.out_dir, name), args.timeout)
        else:
            config, flags, launch = RUNS[name]
            flags = [f.replace("{out}", args.out_dir) for f in flags]
            out = os.path.join(args.out_dir, name)
            if "--out_from" in flags:  # a resume runs in the directory of the run it continues
                i = flags.index("--out_from")
                out = os.path.join(args.out_dir, flags[i + 1])
                flags = flags[:i] + flags[i + 2 :]
                for f in os.listdir(out):
                    if f.startswith("rank"):
                        os.remove(os.path.join(out, f))
            summary[name] = _launch(config, flags, out, args.timeout, launch)
        print(json.dumps(summary[name])[:3000], flush=True)
        with open(summary_path + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(summary_path + ".tmp", summary_path)
    print(
        "| run | sharding | steps | s/step (2..) | peak GiB per GPU | same weights | lora_B moved (vision + language) "
        "| fast gen calls | shared-prefix calls | export |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in summary.items():
        if name != "two-machines":
            print(_row(name, result))
    if "two-machines" in summary:
        print("two machines:", json.dumps(summary["two-machines"]))


if __name__ == "__main__":
    main()

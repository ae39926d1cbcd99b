"""Where a fast-generation decode step's time goes, against the memory floor.

    python benchmarks/decode_profile.py --model qwen2.5-vl-3b --prompts 2,8 --num_generations 8 --tokens 256

The setup of `grpo_step.py`'s vlm-grpo run (a real architecture with random weights, LoRA r=16 on every linear layer
incl. the vision tower, a 448² image per prompt, completions forced to `--tokens`), through a real `VLMGRPOTrainer`
and TRL's own tokenisation. For each batch (prompts x num_generations rows), after a warm-up generation (the
compilation):
1. whole generations, timed (median of 3): ms per token, prefill and LoRA merge included;
2. the LoRA merge and copy-back alone, and the prefill alone (profiler label `fast_generation.prefill`);
3. one generation under torch.profiler: host time and device time of each phase (`fast_generation.sample`:
   logits processors, sampling and bookkeeping; `fast_generation.forward`: the compiled decode step), and the
   device kernels that take the most time;
4. the memory floor: the bytes a decode step must read (the language model's weights and `lm_head`) over the
   device-to-device copy bandwidth measured here.
Prints a table; writes `profile.md` and `profile.json` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

PHASES = ("fast_generation.prefill", "fast_generation.sample", "fast_generation.forward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-3b", help="qwen2.5-vl-3b or qwen2.5-vl-7b (random weights)")
    p.add_argument("--prompts", default="2", help="comma-separated prompts per batch, e.g. 2,8")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="forced new tokens per completion")
    p.add_argument("--image_size", type=int, default=448)
    p.add_argument("--load_in_4bit", action="store_true")
    p.add_argument("--no_merge", action="store_true", help="generate with LoRA unmerged")
    p.add_argument(
        "--merge_backup",
        default="device",
        choices=("device", "host"),
        help="where the base weights wait while LoRA is merged (VLMGRPOConfig.fast_generation_merge_backup)",
    )
    p.add_argument(
        "--no_grouped_attention",
        action="store_true",
        help="decode with transformers' sdpa (key/value heads copied per query head), the earlier path",
    )
    p.add_argument(
        "--cuda_graph",
        default="recorded",
        choices=("recorded", "compiler"),
        help="recorded: the decode step recorded by hand (engine/decode_graph.py); compiler: torch.compile's "
        "reduce-overhead CUDA graphs, the earlier path (FastGenerator.cuda_graph)",
    )
    p.add_argument(
        "--no_fused_qkv",
        action="store_true",
        help="q, k and v as three GEMMs, the earlier path (FastGenerator.fused_qkv; engine/fused_projections.py)",
    )
    p.add_argument(
        "--no_sample_in_graph",
        action="store_true",
        help="sample on the host after the recorded forward, the earlier path (FastGenerator.sample_in_graph; "
        "engine/token_loop.py)",
    )
    p.add_argument("--checkpoint_dir", default="/tmp/vlm-grpo-bench")
    p.add_argument("--out", default="benchmarks/results/decode-profile")
    return p.parse_args(argv)


def _sync() -> float:
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 10 copies of 2 GiB."""
    import torch

    src = torch.empty(2**30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start = _sync()
        dst.copy_(src)
        times.append(_sync() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def _decode_bytes(model) -> int:
    """Bytes of the weights every decode step reads: the language model's layers and `lm_head` (not the vision tower,
    not the input embeddings, which are a lookup)."""
    total = 0
    for name, param in model.named_parameters():
        if ".visual." in name or "embed_tokens" in name or "lora_" in name:
            continue
        total += param.numel() * param.element_size()
    return total


def _trainer(args, checkpoint, rows):
    from grpo_step import _dataset

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer

    model, processor = FastVisionModel.from_pretrained(checkpoint, load_in_4bit=args.load_in_4bit)
    model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16)
    dataset_args = argparse.Namespace(
        prompts=rows // args.num_generations, steps=1, image_size=args.image_size, video_frames=0
    )
    config = VLMGRPOConfig(
        output_dir="/tmp/decode-profile", per_device_train_batch_size=rows, num_generations=args.num_generations,
        max_completion_length=args.tokens, generation_kwargs={"min_new_tokens": args.tokens}, report_to="none",
        fast_generation_merge_lora=not args.no_merge, fast_generation_merge_backup=args.merge_backup,
    )  # fmt: skip
    rewards = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    return VLMGRPOTrainer(model, rewards, args=config, train_dataset=_dataset(dataset_args), processing_class=processor)


def _batch(trainer, num_generations):
    from trl.data_utils import prepare_multimodal_messages

    from vlm_grpo.data.rows import prepare_row

    prepared = [prepare_row(row) for row in trainer.train_dataset for _ in range(num_generations)]
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in prepared]
    return trainer._tokenize_prompts(prompts)


def profile_batch(args, checkpoint, prompts: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vlm_grpo.engine.lora_merge import merged_lora
    from vlm_grpo.models.modes import generating

    rows = prompts * args.num_generations
    trainer = _trainer(args, checkpoint, rows)
    model = trainer.accelerator.unwrap_model(trainer.model)
    batch = _batch(trainer, args.num_generations)
    generator = trainer.fast_generator
    generator.grouped_attention = not args.no_grouped_attention
    generator.cuda_graph = args.cuda_graph
    generator.fused_qkv = not args.no_fused_qkv
    generator.sample_in_graph = not args.no_sample_in_graph
    pad = trainer._tokenizer.pad_token_id

    def generate():
        with generating(model):
            return generator.generate(model, *batch, trainer.generation_config, pad)

    start = _sync()
    completions = generate()
    warmup = _sync() - start
    assert min(len(c) for c in completions) == args.tokens, "completions were not forced to --tokens"
    times = []
    for _ in range(3):
        start = _sync()
        generate()
        times.append(_sync() - start)
    merges = []
    for _ in range(3):
        start = _sync()
        with merged_lora(model, generator.backup()):
            torch.cuda.synchronize()
        merges.append(_sync() - start)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()

    def device_us(event) -> float:
        return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)

    # A labelled range appears twice with CUDA activity: as a host range (its CPU time) and as a device annotation
    # (its GPU time); take each from the entry that has it.
    phases = {}
    for name in PHASES:
        events = [e for e in prof.key_averages() if e.key == name]
        if events:
            phases[name] = {"calls": max(e.count for e in events),
                            "host_ms": max(e.cpu_time_total for e in events) / 1e3,
                            "device_ms": max(device_us(e) for e in events) / 1e3}  # fmt: skip
    kernels = sorted(
        (e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0),
        key=lambda e: e.self_device_time_total, reverse=True,
    )[:20]  # fmt: skip
    result = {
        "rows": rows, "tokens": args.tokens, "warmup_s": warmup, "generation_s": statistics.median(times),
        "ms_per_token": 1e3 * statistics.median(times) / args.tokens, "merge_ms": 1e3 * statistics.median(merges),
        "phases": phases,
        "kernels": [{"name": e.key[:90], "calls": e.count, "device_ms": e.self_device_time_total / 1e3}
                    for e in kernels],
        "decode_bytes": _decode_bytes(model), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip
    return result


def _markdown(args, env, bandwidth, results) -> str:
    lines = [
        (
            f"{args.model}, {args.image_size}² image per prompt, LoRA r=16 ({'unmerged' if args.no_merge else 'merged'} "
            f"while generating, base weights kept on the {args.merge_backup}), "
            f"{'4-bit' if args.load_in_4bit else 'bf16'}, {args.tokens} new tokens forced, "
            f"{'sdpa with copied key/value heads' if args.no_grouped_attention else 'grouped decode attention'}, "
            f"CUDA graph: {args.cuda_graph}, q/k/v {'as three GEMMs' if args.no_fused_qkv else 'as one GEMM'}, "
            f"sampling {'on the host' if args.no_sample_in_graph else 'inside the recorded step'}"
        ),
        "",
        (
            f"GPU: {env['gpu']}; torch {env['torch']}, transformers {env['transformers']}; copy bandwidth "
            f"{bandwidth / 1e12:.2f} TB/s (read + write)"
        ),
        "",
        (
            "| rows | ms/token (whole generation) | floor ms/token | prefill device ms | sample: host / device ms per step "
            "| forward: host / device ms per step | LoRA merge + restore ms | peak GiB |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        floor = 1e3 * r["decode_bytes"] / bandwidth
        ph = r["phases"]
        pre = ph.get("fast_generation.prefill", {})
        cells = []
        for name in ("fast_generation.sample", "fast_generation.forward"):
            p = ph.get(name)
            cells.append(f"{p['host_ms'] / p['calls']:.2f} / {p['device_ms'] / p['calls']:.2f}" if p else "-")
        lines.append(f"| {r['rows']} | {r['ms_per_token']:.2f} | {floor:.2f} | {pre.get('device_ms', 0):.0f} | "
                     f"{cells[0]} | {cells[1]} | {r['merge_ms']:.0f} | {r['peak_gib']:.1f} |")  # fmt: skip
    for r in results:
        lines += ["", f"Top device kernels, {r['rows']} rows (one generation):", "", "| kernel | calls | device ms |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| `{k['name']}` | {k['calls']} | {k['device_ms']:.1f} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers
    from real_arch import build_checkpoint

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_profile.py needs a CUDA GPU.")
    checkpoint = build_checkpoint(args.model, os.path.join(args.checkpoint_dir, args.model))
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": transformers.__version__}
    bandwidth = _copy_bandwidth()
    results = []
    for prompts in [int(p) for p in args.prompts.split(",")]:
        results.append(profile_batch(args, checkpoint, prompts))
        torch._dynamo.reset()  # compiled graphs hold the batch's model; without this the next batch's peak counts it
        torch.cuda.empty_cache()  # the batch's model and trainer are gone with its frame
        print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels"}), flush=True)
    table = _markdown(args, env, bandwidth, results)
    print(table, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"args": vars(args), "env": env, "bandwidth": bandwidth, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

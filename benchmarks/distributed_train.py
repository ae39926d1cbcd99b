"""A short GRPO run under `accelerate launch` with any config (DDP, FSDP2, ZeRO); each rank reports what it saw.

    accelerate launch --config_file examples/accelerate/fsdp2.yaml benchmarks/distributed_train.py OUT \
        --model qwen2.5-vl-3b --steps 5 --save_steps 3

Writes OUT/rank{R}.json: distributed type, steps, losses, KL, step time, peak GPU memory, how many `lora_B`
matrices (vision / language) moved off their zero init, a checksum of the gathered weights (equal on every
rank when the replicas / shards agree) and which fast paths served the run. `--resume` continues from the
given checkpoint; `--export` writes a merged checkpoint from the (sharded) model and checks its
logits against the adapter model's on rank 0.

`--dynamic_sampling` trains with `VLMGRPOConfig.dynamic_sampling` on a reward that is constant for half the prompts,
and records the rounds, the trained batches' `frac_reward_zero_std` and each rank's groups with differing rewards
per generation round.

`--model` is a tiny family (`qwen2_5_vl`, built in code: the CPU tests) or a real architecture with random
weights (`qwen2.5-vl-3b`, `qwen2.5-vl-7b`, from benchmarks/real_arch.py: the GPU runs).

On CPU, accelerate refuses FSDP (it only enables it for accelerator device types), so with no GPU this script
relabels the gloo process group's MULTI_CPU as MULTI_GPU before anything reads it: everything after that, the
sharding (`fully_shard` per decoder layer and vision block), checkpoints and the trainer, is the real code path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _allow_fsdp_on_cpu() -> None:
    import accelerate.state
    from accelerate.utils import DistributedType

    init = accelerate.state.PartialState.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU

    accelerate.state.PartialState.__init__ = patched


def _varied_reward(prompts, completions, **kwargs) -> list[float]:
    """Differs between completions of a prompt, so every group has an advantage and every step a gradient."""
    return [float(len(str(c)) % 5) for c in completions]


class _GradedReward:
    """`_varied_reward` on the even-numbered prompts, 0 on the others (their groups never differ: dynamic sampling
    drops them). Records, per call, the optimizer step and how many of this rank's groups had differing rewards."""

    __name__ = "graded_reward"

    def __init__(self, generations: int) -> None:
        self.generations, self.calls = generations, []

    def __call__(self, prompts, completions, number, trainer_state, **kwargs) -> list[float]:
        varied = _varied_reward(prompts, completions)
        rewards = [r if n % 2 == 0 else 0.0 for r, n in zip(varied, number, strict=True)]
        groups = [rewards[i : i + self.generations] for i in range(0, len(rewards), self.generations)]
        self.calls.append((trainer_state.global_step, sum(len(set(g)) > 1 for g in groups)))
        return rewards


def _model_and_data(
    name: str, out_dir: str, rank: int, image_size: int, full: bool, seed: int, dtype: torch.dtype, device_map=None
):
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    from vlm_grpo.models.loader import FastVisionModel

    if name.startswith("qwen2.5-vl-"):
        from real_arch import build_checkpoint

        path = os.path.join(os.environ.get("VLM_GRPO_BENCH_DIR", "/tmp/vlm-grpo-bench"), name)
        if rank == 0:
            build_checkpoint(name, path, seed=seed)  # written to a temporary name, renamed when complete
        while not os.path.exists(os.path.join(path, "config.json")):
            time.sleep(1)
    else:
        from vlm_grpo.tiny import build_tiny_vlm

        # Every rank builds the same seeded model in its own directory: no file races, identical weights.
        path = build_tiny_vlm(name, os.path.join(out_dir, f"model-rank{rank}"), seed=seed)
    model, processor = FastVisionModel.from_pretrained(path, full_finetuning=full, dtype=dtype, device_map=device_map)
    rng = np.random.default_rng(seed)
    rows = [{"prompt": [{"role": "user", "content": "What colour is the shape ?"}],
             "image": Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))}
            for _ in range(64)]  # fmt: skip
    for number, row in enumerate(rows):
        row["number"] = number
    return model, processor, Dataset.from_list(rows), path


def _vllm_sync_gap(trainer, full_weights) -> dict:
    """`engine.vllm_rollouts.merged_weights` on the sharded model (each weight gathered: a collective) against the
    same on the gathered model: the names a vLLM sync sends and the largest difference (0 when they agree)."""
    from vlm_grpo.engine.vllm_rollouts import merged_weights

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    sharded = {n: w.detach().float().clone() for n, w in merged_weights(model)}
    with full_weights(trainer.model_wrapped):
        whole = {n: w.detach().float().clone() for n, w in merged_weights(model)}
    return {"names": len(sharded), "same_names": set(sharded) == set(whole),
            "max_gap": max(float((sharded[n] - whole[n]).abs().max()) for n in whole)}  # fmt: skip


def _trl_trainer(model, reward, config, dataset, processor, args):
    """`trl.GRPOTrainer` with TRL's config fields of `config` and LoRA r16 on all linear layers, and the stand-ins for
    the attributes this script reports (TRL has no fast generator, shared-prefix scoring or generation copy)."""
    import dataclasses

    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from vlm_grpo.engine.generation_copy import GenerationCopy
    from vlm_grpo.families import core_model

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    # Our config's values for TRL's own fields, less those TRL derives from the others in __post_init__.
    derived = {"generation_batch_size"}
    given = {k: getattr(config, k) for k in names if not k.startswith("_") and k not in derived}
    trl_config = GRPOConfig(**given)
    peft_config = None if args.full else LoraConfig(r=16, lora_alpha=16, target_modules="all-linear")
    trainer = GRPOTrainer(core_model(model), [reward], args=trl_config, train_dataset=dataset,
                          processing_class=processor, peft_config=peft_config)  # fmt: skip
    trainer.fast_generator = type("NoFastGenerator", (), {"stats": {"calls": 0}})()
    trainer._fast_generation_fallbacks, trainer.shared_prefix_calls = set(), 0
    trainer.generation_copy = GenerationCopy()
    return trainer


def _compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process (the layers' training forward, the decode step)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _lora_b_moved(model) -> dict[str, int]:
    from vlm_grpo.models.hooks import VISION_TOWER_NAMES
    from vlm_grpo.models.sharded import whole

    counts = {"vision_total": 0, "vision_moved": 0, "language_total": 0, "language_moved": 0}
    for name, param in model.named_parameters():
        if "lora_B" in name:
            side = "vision" if any(f".{v}." in name for v in VISION_TOWER_NAMES) else "language"
            counts[f"{side}_total"] += 1
            counts[f"{side}_moved"] += int(bool(whole(param.detach()).abs().sum() > 0))  # a shard gathered alone
    return counts


def _write_record(out_dir: str, rank: int, record: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _check_export(trainer, processor, out_dir: str, final: str, base_path: str) -> dict[str, float]:
    """Merged export from the sharded model, checked in fp32 on rank 0: the merged checkpoint's logits against the
    trained model as saved (`final`: the adapter on the base checkpoint, or the full weights), both loaded in fp32,
    so the gap measures the export and not bf16 rounding; the adapter's own effect on the logits beside it."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from vlm_grpo.models.loader import FastVisionModel

    fp32 = torch.float32
    path = FastVisionModel.save_pretrained_merged(trainer.model, processor, os.path.join(out_dir, "merged"), dtype=fp32)
    result: dict[str, float] = {}
    if trainer.accelerator.is_main_process:
        device = trainer.accelerator.device
        inputs = processor(text=["What colour is the shape ?"], return_tensors="pt").to(device)

        def logits(model) -> torch.Tensor:
            with torch.no_grad():
                return model.to(device).eval()(**inputs).logits.float()

        merged = AutoModelForImageTextToText.from_pretrained(path, dtype=fp32)
        merged_logits = logits(merged)
        result["architectures"] = merged.config.architectures
        del merged
        if os.path.exists(os.path.join(final, "adapter_config.json")):
            base = AutoModelForImageTextToText.from_pretrained(base_path, dtype=fp32)
            base_logits = logits(base)
            trained_logits = logits(PeftModel.from_pretrained(base, final))
            result["adapter_effect"] = float((base_logits - trained_logits).abs().mean())
        else:
            trained_logits = logits(AutoModelForImageTextToText.from_pretrained(final, dtype=fp32))
        result["merged_gap"] = float((merged_logits - trained_logits).abs().mean())
        result["logit_scale"] = float(trained_logits.abs().mean())
    trainer.accelerator.wait_for_everyone()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="qwen2_5_vl")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA (vision + language)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    parser.add_argument("--export", action="store_true", help="merged export from the sharded model, checked")
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (rows)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dynamic_sampling", action="store_true",
                        help="dynamic sampling, with a reward constant on half the prompts")  # fmt: skip
    parser.add_argument(
        "--no_compile", action="store_true", help="eager fast generation (fast_generation_compile=False)"
    )
    parser.add_argument("--compile_layers", action="store_true",
                        help="compile the layers' training forward (compile_layers=True; on CPU too)")  # fmt: skip
    parser.add_argument("--use_vllm", action="store_true", help="rollouts through vLLM colocated on each GPU")
    parser.add_argument("--vllm_tp", type=int, default=1, help="vLLM tensor parallel size (divides the GPUs)")
    parser.add_argument("--vllm_memory", type=float, default=0.3, help="vLLM's share of each GPU")
    parser.add_argument("--device_map", default=None, choices=["cpu"],
                        help="cpu: load each rank's model in host memory (FSDP2 moves only its shards to the GPU: a "
                             "model one GPU cannot hold, with vLLM started before it)")  # fmt: skip
    parser.add_argument("--stream_checks", action="store_true",
                        help="after training, gather one weight at a time only: no check that holds the whole model "
                             "on a GPU (a 32B model beside vLLM); the vLLM-sync and copy gaps are skipped")  # fmt: skip
    parser.add_argument("--trl", action="store_true",
                        help="plain trl.GRPOTrainer on the transformers model with a LoRA peft_config (the baseline)")  # fmt: skip
    parser.add_argument("--no_generation_copy", action="store_true",
                        help="FSDP2: gather the shards for each rollout (fsdp_generation_copy=False)")  # fmt: skip
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights as loaded (default: bf16 on GPU, fp32 on CPU); bf16 compute either way on GPU",
    )
    args = parser.parse_args()

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            _allow_fsdp_on_cpu()

    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.models.sharded import full_weights, sharding, whole
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    # The model is built before the config: once the config has set up the process group, transformers'
    # save_pretrained writes on the main process only, and the other ranks' tiny checkpoints would lack weights.
    rank = int(os.environ.get("RANK", "0"))
    model, processor, dataset, base_path = _model_and_data(
        args.model,
        args.out_dir,
        rank,
        args.image_size,
        args.full,
        args.seed,
        getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")),
        args.device_map,
    )
    config = VLMGRPOConfig(
        output_dir=os.path.join(args.out_dir, "run"), per_device_train_batch_size=args.batch,
        num_generations=args.generations, max_completion_length=args.max_completion_length,
        generation_kwargs={"min_new_tokens": args.max_completion_length}, learning_rate=args.lr, beta=args.beta,
        max_steps=args.steps, logging_steps=1, report_to="none", disable_tqdm=True, seed=args.seed,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        fast_generation_compile=False if args.no_compile else None, fsdp_generation_copy=not args.no_generation_copy,
        compile_layers=True if args.compile_layers else None,
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=args.vllm_tp,
                vllm_gpu_memory_utilization=args.vllm_memory, vllm_max_model_length=4096) if args.use_vllm else {}),
        dynamic_sampling=args.dynamic_sampling, max_sampling_rounds=8,
    )  # fmt: skip
    reward = _GradedReward(args.generations) if args.dynamic_sampling else _varied_reward
    if args.trl:  # TRL as users run it: the transformers model, TRL's own LoRA wrapping, its generate / vLLM path
        trainer = _trl_trainer(model, reward, config, dataset, processor, args)
    else:
        if not args.full:
            model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16, random_state=args.seed)
        trainer = VLMGRPOTrainer(model, [reward], args=config, train_dataset=dataset, processing_class=processor)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume)
    wall = time.perf_counter() - start

    history = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in history]
    step_times = [h["step_time"] for h in history if "step_time" in h]
    record = {
        "rank": rank, "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type), "sharding": sharding(trainer.model_wrapped),
        "steps": trainer.state.global_step, "logged_steps": [h["step"] for h in history], "losses": losses,
        "finite": bool(losses) and all(math.isfinite(x) for x in losses), "kl": [h.get("kl") for h in history],
        "step_time_s": step_times, "train_wall_s": wall,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "fast_generation": trainer.fast_generator.stats, "fast_generation_fallbacks": sorted(trainer._fast_generation_fallbacks),
        "shared_prefix_calls": trainer.shared_prefix_calls, "compiled_graphs": _compiled_graphs(),
        "shared_prefix_fallbacks": getattr(trainer, "shared_prefix_fallbacks", {}),
        "frac_reward_zero_std": [h.get("frac_reward_zero_std") for h in history],
        "sampling_rounds": [h.get("dynamic_sampling/rounds") for h in history],
        "reward_calls": getattr(reward, "calls", None),
        # A full fine-tune's KL reference: loaded on the host (device_map None), then sharded like the policy
        "reference": None if not isinstance(trainer.ref_model, torch.nn.Module) else {
            "device_map": (trainer.args.model_init_kwargs or {}).get("device_map", "unset"),
            "sharding": sharding(trainer.ref_model)},
    }  # fmt: skip
    _write_record(args.out_dir, rank, record)  # the training's numbers first: a check below that fails leaves them
    if record["sharding"] == "fsdp2":  # every gather for generation was given back: the weights are shards again
        # (a LoRA base the generation copy shares is left whole by design: FSDP2 shards only the rest)
        params = list(trainer.model_wrapped.parameters())
        record["resharded"] = all(type(p).__name__ == "DTensor" for p in params if p.requires_grad)
        record["whole_frozen"] = sum(type(p).__name__ != "DTensor" for p in params)
    # The weights a vLLM sync sends, from the shards vs the gathered model. Not under ZeRO-3: there the sync is TRL's
    # own gather (`vllm_rollouts` declines to merge partitioned weights, whose local tensors are empty).
    if not args.full and not args.stream_checks and record["sharding"] != "zero3":
        record["vllm_sync"] = _vllm_sync_gap(trainer, full_weights)
    copy = trainer.generation_copy
    record["generation_copy"] = copy.stats()
    if copy.model is not None:  # refreshed to the final weights (a collective), compared below with the gathered ones
        copy.refreshed(trainer.model_wrapped, -1)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    # Every rank gathers (the whole model, or with --stream_checks one weight at a time: a collective each); the same
    # numbers on each when the shards agree.
    with contextlib.nullcontext() if args.stream_checks else full_weights(trainer.model_wrapped):
        record["checksum"] = float(sum(whole(p.detach()).double().sum() for p in unwrapped.parameters()))
        if copy.model is not None and not args.stream_checks:  # 0: the copy is the model (trainable weights
            own = dict(copy.model.named_parameters())  # refreshed, frozen ones untouched)
            record["copy_gap"] = max(float((own[n].float() - p.detach().float()).abs().max())
                                     for n, p in unwrapped.named_parameters())  # fmt: skip
        if record["sharding"] is None:  # replicas (DDP): bit-identical, not just equal sums
            digest = hashlib.sha256()
            for p in unwrapped.parameters():
                digest.update(p.detach().float().cpu().numpy().tobytes())
            record["weights_sha256"] = digest.hexdigest()
        if not args.full:
            record["lora_b"] = _lora_b_moved(unwrapped)
    final = os.path.join(args.out_dir, "final")
    trainer.save_model(final)  # what the CLI saves: gathered from the shards into plain files
    # (TRL's own save_model under FSDP2 with sharded state dicts writes no folder: recorded as none)
    record["final_files"] = sorted(os.listdir(final)) if os.path.isdir(final) else None
    if args.export:
        record["export"] = _check_export(trainer, processor, args.out_dir, final, base_path)
    _write_record(args.out_dir, rank, record)
    print(json.dumps(record), flush=True)
    # Every rank done, then the process group torn down before the interpreter exits: left to exit, gloo's threads
    # were seen to abort a rank ("terminate called without an active exception") after its work was written.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

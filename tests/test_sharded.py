"""More than one process: FSDP2 and DDP runs on CPU (gloo), through `accelerate launch` and the shipped configs.

The FSDP2 run uses accelerate's own sharding (`fully_shard` per decoder layer and vision block) and TRL's trainer;
benchmarks/distributed_train.py only relabels the CPU process group so that accelerate lets FSDP run on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vlm_grpo.models.sharded import full_weights, sharding, unsupported_reason
from vlm_grpo.training.generation_route import compile_setting as _compile_default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(
    args: list[str], port: int, config: str | None = None, machine: list[str] = ()
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]  # fmt: skip
    # Without a config: plain DDP. `--multi_gpu` is what starts two processes (torchrun); on CPU the trainer then
    # runs them as MULTI_CPU over gloo (`--cpu` would start a single process).
    launch += ["--config_file", os.path.join(ROOT, "examples", "accelerate", config)] if config else ["--multi_gpu"]
    result = subprocess.run(
        [*launch, *(machine or ["--num_machines", "1"]), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _records(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.trains
def test_fsdp2_trains_vision_and_language_lora_resumes_and_exports(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "distributed_train.py")
    out = tmp_path / "fsdp2"
    _launch([script, str(out), "--steps", "3", "--save_steps", "2", "--export"], 29571, config="fsdp2.yaml")
    first = _records(out)
    for r in first:
        assert r["sharding"] == "fsdp2" and r["world_size"] == 2 and r["steps"] == 3 and r["finite"]
        assert r["resharded"]  # the weights gathered for each rollout went back to shards
        assert all(kl > 0 for kl in r["kl"][1:])  # the adapter-disabled reference is computed under sharding
        # Gradients reach every adapter through the requires-grad hooks and checkpointing, vision tower included.
        assert r["lora_b"]["vision_moved"] == r["lora_b"]["vision_total"] > 0
        assert r["lora_b"]["language_moved"] == r["lora_b"]["language_total"] > 0
        # The fast paths served the sharded model: gathered-weight generation and shared-prefix scoring.
        assert r["fast_generation"]["calls"] == 3 and not r["fast_generation_fallbacks"]
        assert r["shared_prefix_calls"] > 0 and not r["shared_prefix_fallbacks"]
        # ...from the unsharded generation copy, refreshed once per step, equal to the model bit for bit at the end
        # (its adapters refreshed, its base untouched by the merges while generating). The frozen base is shared by
        # the copy and the model and left whole by FSDP2 (memory as under DDP): only the adapters are sharded.
        assert r["generation_copy"]["copy"] and r["generation_copy"]["refreshes"] == 3 and r["copy_gap"] == 0.0
        assert r["generation_copy"]["shared_weights"] == r["whole_frozen"] > 0
        # The weights a vLLM sync sends (LoRA merged out of place), gathered weight by weight from the shards.
        assert r["vllm_sync"]["same_names"] and r["vllm_sync"]["names"] > 0 and r["vllm_sync"]["max_gap"] == 0.0
    assert first[0]["checksum"] == first[1]["checksum"]  # the gathered shards are the same model on both ranks
    assert "adapter_model.safetensors" in first[0]["final_files"]  # save_model wrote the gathered adapter
    export = first[0]["export"]
    assert export["merged_gap"] < 1e-3 * export["adapter_effect"]  # the merged checkpoint is the adapted model

    # Resume from the mid-run checkpoint (step 2): the step count continues and step 3 is replayed exactly, here
    # generated from the gathered shards rather than the copy: the two paths give the same completions.
    for r in (0, 1):
        (out / f"rank{r}.json").unlink()
    resume = ["--resume", str(out / "run" / "checkpoint-2"), "--no_generation_copy"]
    _launch([script, str(out), "--steps", "4", *resume], 29572, config="fsdp2.yaml")
    resumed = _records(out)
    for r in resumed:
        assert r["logged_steps"] == [1, 2, 3, 4] and r["steps"] == 4 and r["finite"]
        assert r["fast_generation"]["calls"] == 2  # only steps 3 and 4 ran in this process
        assert r["generation_copy"] == {"copy": False, "refreshes": 0, "shared_weights": 0}
        assert r["losses"][2] == pytest.approx(first[0]["losses"][2], rel=1e-4, abs=1e-9)
    assert resumed[0]["checksum"] == resumed[1]["checksum"]


@pytest.mark.slow
@pytest.mark.trains
@pytest.mark.parametrize("family, port", [("qwen2_5_vl", 29573), ("qwen3_5", 29578)])
def test_cli_under_two_processes_writes_one_complete_final_model(tmp_path, family, port):
    # Qwen3.5: its recurrent layers' prompt cache is continued under DDP (`engine.prefix_cache`), not packed.
    out = tmp_path / "cli"
    result = _launch(["-m", "vlm_grpo.cli", "--model", f"tiny:{family}", "--output_dir", str(out), "--max_steps", "2",
                      "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "4",
                      "--train_size", "16", "--test_size", "4", "--logging_steps", "1"],
                     port)  # fmt: skip
    assert "Shared-prefix scoring off" not in result.stderr and "Fast generation is off" not in result.stderr
    # Every rank used to write its own temporary final/ and rename it into place: the last one (without weights) won.
    final = sorted(os.listdir(out / "final"))
    assert "model.safetensors" in final and "config.json" in final and "tokenizer.json" in final
    assert {"before/accuracy", "after/accuracy"} <= set(json.loads((out / "eval.json").read_text()))
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "reward" in r] == [1, 2]  # written once, by rank 0
    assert not [p for p in os.listdir(out) if ".tmp" in p]  # no leftover temporaries from other ranks


@pytest.mark.slow
@pytest.mark.trains
def test_fsdp2_trains_with_compiled_layers_as_it_does_eagerly(tmp_path):
    """The layers' training forward compiled before accelerate shards them (torchtitan's order) trains under FSDP2:
    the same losses and, up to the fused kernels' rounding, the same weights as the eager run. The eager run checks
    one gathered weight at a time (`--stream_checks`, as the 32B run beside vLLM does): the same checksum."""
    script = os.path.join(ROOT, "benchmarks", "distributed_train.py")
    runs = {}
    eager_flags = ["--stream_checks", "--device_map", "cpu"]
    for name, extra, port in (("eager", eager_flags, 29577), ("compiled", ["--compile_layers"], 29578)):
        _launch([script, str(tmp_path / name), "--steps", "2", *extra], port, config="fsdp2.yaml")
        runs[name] = _records(tmp_path / name)
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        assert compiled["sharding"] == "fsdp2" and compiled["finite"] and compiled["resharded"]
        assert compiled["compiled_graphs"] > eager["compiled_graphs"]  # the layers did compile
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4, abs=1e-9)
        assert compiled["checksum"] == pytest.approx(eager["checksum"], rel=1e-7)
        assert "vllm_sync" not in eager and "vllm_sync" in compiled  # the whole-model gather skipped when streaming
        assert eager["lora_b"]["language_moved"] == eager["lora_b"]["language_total"] > 0  # shards gathered one by one


@pytest.mark.slow
@pytest.mark.trains
def test_fsdp2_full_fine_tuning_trains_and_exports_the_unwrapped_architecture(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "distributed_train.py")
    _launch([script, str(tmp_path), "--full", "--steps", "2", "--lr", "1e-4", "--export"], 29575, config="fsdp2.yaml")
    records = _records(tmp_path)
    assert all(r["sharding"] == "fsdp2" and r["steps"] == 2 and r["finite"] and r["resharded"] for r in records)
    assert records[0]["checksum"] == records[1]["checksum"]
    # TRL's KL reference loads on the host, not with its "auto" (every rank's whole copy on the first GPUs), and is
    # sharded like the policy
    assert all(r["reference"] == {"device_map": None, "sharding": "fsdp2"} for r in records)
    export = records[0]["export"]
    # FSDP2 swaps the root's class for a generated FSDPQwen2_5_VL...; the checkpoint still names the real one.
    assert export["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert export["merged_gap"] < 1e-5 * export["logit_scale"]  # fp32 export of fp32 weights: the same model


@pytest.mark.slow
@pytest.mark.trains
def test_two_machines_on_one_host_train_as_one_ddp_run(tmp_path):
    """`--num_machines 2 --machine_rank 0/1` meeting on localhost: the multi-node launch path, one world of two."""
    from concurrent.futures import ThreadPoolExecutor

    script = os.path.join(ROOT, "benchmarks", "distributed_train.py")

    def machine(rank: int) -> subprocess.CompletedProcess:
        flags = ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        return _launch([script, str(tmp_path), "--steps", "3"], 29574, machine=flags)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(machine, (0, 1)))
    records = _records(tmp_path)
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["distributed_type"].endswith("MULTI_CPU") for r in records)
    assert all(r["steps"] == 3 and r["finite"] and r["fast_generation"]["calls"] == 3 for r in records)
    assert records[0]["checksum"] == records[1]["checksum"]  # DDP kept the two machines' replicas identical


def test_unsharded_models_pass_through_full_weights(tiny_dir):
    from vlm_grpo.models.loader import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    assert sharding(model) is None and unsupported_reason(model) is None
    before = {n: p.clone() for n, p in model.named_parameters()}
    with full_weights(model) as gathered:
        assert gathered is model
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_fast_generation_compile_defaults_off_for_sharded_models():
    from vlm_grpo.training.trainer import VLMGRPOConfig

    args = VLMGRPOConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert _compile_default(args, sharded=True) is False  # recompiling at every step's fresh gather costs more
    assert _compile_default(args, sharded=False) is None  # None: on for CUDA
    args.fast_generation_compile = True
    assert _compile_default(args, sharded=True) is True  # an explicit choice is kept


@pytest.mark.slow
@pytest.mark.trains
def test_dynamic_sampling_keeps_two_ranks_in_step_when_they_need_different_rounds(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "distributed_train.py")
    _launch([script, str(tmp_path), "--steps", "3", "--dynamic_sampling", "--full", "--lr", "1e-4"], 29576)
    records = _records(tmp_path)
    for r in records:
        assert r["steps"] == 3 and r["finite"] and r["logged_steps"] == [1, 2, 3]
        assert r["frac_reward_zero_std"] == [0.0, 0.0, 0.0]  # every trained batch: only groups whose rewards differ
    assert records[0]["weights_sha256"] == records[1]["weights_sha256"]  # bit-identical replicas
    calls = [[tuple(c) for c in r["reward_calls"]] for r in records]
    # The same rounds on both ranks (each round is one reward call per rank, at the same step)...
    assert [step for step, _ in calls[0]] == [step for step, _ in calls[1]]
    assert [sum(step == s for s, _ in calls[0]) for step in range(3)] == records[0]["sampling_rounds"]
    # ...though the ranks found their informative groups at different rounds: one waited on the other.
    assert any(a != b for (_, a), (_, b) in zip(calls[0], calls[1], strict=True))
    assert max(records[0]["sampling_rounds"]) > 1

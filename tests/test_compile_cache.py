"""Compiled code kept across processes (`vlm_grpo.engine.compile_cache`): a second run on a "fresh machine" (its own
empty inductor cache) compiles nothing, every graph a cache hit from the first run's saved artefacts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from vlm_grpo.engine.compile_cache import CHECKPOINT_FOLDER, CompileCache, artifact_key, default_cache_dir
from vlm_grpo.models.loader import FastVisionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One training step of a tiny Qwen2.5-VL with its layers compiled (compile_layers=True: on the CPU too), a checkpoint
# at step 1; prints the inductor counters and the cache's key.
_RUN = textwrap.dedent(
    """
    import json, logging, sys
    from torch._dynamo.utils import counters
    from vlm_grpo import VLMGRPOConfig, VLMGRPOTrainer
    from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
    from vlm_grpo.models.loader import FastVisionModel
    from vlm_grpo.rewards import make_choice_reward

    tiny, out, cache = sys.argv[1:4]
    said = logging.getLogger("vlm_grpo.engine.compile_cache")
    said.setLevel(logging.INFO)
    said.addHandler(logging.StreamHandler())
    model, processor = FastVisionModel.from_pretrained(tiny, full_finetuning=True)
    args = VLMGRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=2,
                         max_steps=1, save_strategy="steps", save_steps=1, report_to="none", use_cpu=True,
                         disable_tqdm=True, compile_layers=True, compile_layers_ahead_of_time=False,
                         compile_cache_dir=cache)  # torch.compile's layers: ahead of time keeps its own files
    trainer = VLMGRPOTrainer(model, [make_choice_reward(answer_words("color", 1))], args=args,
                             train_dataset=make_visual_reasoning_dataset("color", 8), processing_class=processor)
    trainer.train()
    print(json.dumps({"counters": dict(counters["inductor"]), "key": trainer.compile_cache.key}))
    """
)


def _run(tiny: str, out, cache, inductor) -> tuple[dict, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", _RUN, tiny, str(out), str(cache)], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
@pytest.mark.trains
def test_a_second_run_on_a_fresh_machine_reuses_the_first_runs_compiled_code(tiny_dir, tmp_path):
    tiny, cache = tiny_dir("qwen2_5_vl", words=answer_words_color()), tmp_path / "cache"
    first, _ = _run(tiny, tmp_path / "one", cache, tmp_path / "inductor-one")
    assert first["counters"].get("fxgraph_cache_miss", 0) > 0  # it compiled
    saved = cache / f"{first['key']}.bin"
    assert saved.stat().st_size > 0
    assert (tmp_path / "one" / "checkpoint-1" / CHECKPOINT_FOLDER / saved.name).read_bytes() == saved.read_bytes()
    # Another process with an empty inductor cache, as on a new node: every graph comes from the saved artefacts.
    second, log = _run(tiny, tmp_path / "two", cache, tmp_path / "inductor-two")
    assert second["key"] == first["key"] and "compiled artefacts from" in log
    assert second["counters"].get("fxgraph_cache_hit", 0) == first["counters"]["fxgraph_cache_miss"]
    assert second["counters"].get("fxgraph_cache_miss", 0) == 0


def answer_words_color() -> list[str]:
    from vlm_grpo.data import answer_words

    return answer_words("color", 1)


def test_the_key_follows_architecture_dtype_and_adapters(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), full_finetuning=True)
    again, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), full_finetuning=True)
    key = artifact_key(model)
    assert artifact_key(again) == key  # the same architecture from another path: the same compiled code
    other, _ = FastVisionModel.from_pretrained(tiny_dir("qwen3_vl"), full_finetuning=True)
    assert artifact_key(other) != key
    assert artifact_key(again.to(torch.bfloat16)) != key
    assert artifact_key(FastVisionModel.get_peft_model(model, r=4)) != key


def test_an_unreadable_file_is_ignored_and_none_turns_it_off(tmp_path, caplog, monkeypatch):
    cache = CompileCache(str(tmp_path), "abc")
    (tmp_path / "abc.bin").write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING):
        assert cache.load() is None  # compiling again is the fallback, never a failed run
    assert "could not be loaded" in caplog.text
    off = CompileCache.for_trainer(torch.nn.Linear(2, 2), SimpleNamespace(compile_cache_dir="none"))
    assert off.directory is None and off.load() is None and off.save() is None
    monkeypatch.setenv("VLM_GRPO_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == str(tmp_path / "mine" / "compile")
    assert CompileCache.for_trainer(torch.nn.Linear(2, 2), None).directory == str(tmp_path / "mine" / "compile")


def test_runs_that_compile_differently_keep_a_file_each():
    # compile_layers_unit / _dynamic / linear attention change what compiles: alternating runs must not overwrite
    # each other's artefacts (the cold start each was meant to save).
    model = torch.nn.Linear(2, 2)
    modules = CompileCache.for_trainer(model, SimpleNamespace(compile_layers_unit="modules")).key
    assert CompileCache.for_trainer(model, SimpleNamespace(compile_layers_unit="layers")).key != modules
    assert (
        CompileCache.for_trainer(model, SimpleNamespace(compile_layers_unit="modules", output_dir="x")).key == modules
    )

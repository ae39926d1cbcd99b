import json
import os

import pytest
from transformers import AutoModelForImageTextToText

from vlm_grpo.cli import main

pytestmark = pytest.mark.trains


def test_demo_runs_end_to_end_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    results = main(["--output_dir", str(out), "--max_steps", "3", "--train_size", "16", "--test_size", "8",
                    "--logging_steps", "1", "--disable_tqdm", "true"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "held-out accuracy before training" in printed and "held-out accuracy after training" in printed
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "reward" in r] == [1, 2, 3]
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert set(json.loads((out / "eval.json").read_text())) >= {"before/accuracy", "after/accuracy"}
    assert 0.0 <= results["after/accuracy"] <= 1.0
    model = AutoModelForImageTextToText.from_pretrained(out / "final")  # a plain transformers checkpoint
    assert model.config.model_type == "qwen2_5_vl"
    assert not [p for p in os.listdir(out) if ".tmp" in p]


def test_flags_load_from_yaml_and_lora_works(tmp_path):
    config = tmp_path / "recipe.yaml"
    out = tmp_path / "run"
    config.write_text(
        f"model: tiny:gemma3\noutput_dir: {out}\nmax_steps: 2\ntrain_size: 8\ntest_size: 4\nuse_peft: true\n"
        "lora_r: 4\nfinetune_language_layers: false\nlearning_rate: 0.001\ndisable_tqdm: true\n"
    )
    main(["--config", str(config)])
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and "vision_tower" in str(adapter["target_modules"])


def test_unknown_tiny_family_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="Unknown tiny family"):
        main(["--model", "tiny:llava", "--output_dir", str(tmp_path), "--max_steps", "1"])

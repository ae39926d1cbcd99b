"""The examples run as a user runs them: the Python recipe, the notebook (executed with nbclient), and every YAML
recipe through the CLI's parser, the CPU one through the installed console script."""

import base64
import glob
import io
import json
import os
import subprocess
import sys

import pytest
import yaml
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlm_grpo.cli.command import parse_args
from vlm_grpo.data import TASKS
from vlm_grpo.rewards import resolve_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "notebooks", "image_reasoning_grpo.ipynb")
RECIPES = sorted(glob.glob(os.path.join(EXAMPLES, "recipes", "*.yaml")))
ENV = {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _changed_tensors(before_dir: str, after_dir: str) -> int:
    """How many weights differ between two checkpoints (loaded by transformers: on-disk key names may differ)."""
    before = AutoModelForImageTextToText.from_pretrained(before_dir).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(after_dir).state_dict()
    assert set(after) == set(before)
    return sum(1 for k in before if (after[k].float() - before[k].float()).abs().max() > 1e-3)


# The Python recipe


@pytest.mark.trains
def test_example_script_trains_reports_accuracy_and_exports_a_merged_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "image_reasoning_grpo.py"), "--max_steps", "3", "--output_dir", str(out)],
        cwd=tmp_path, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    before = next(line for line in lines if line.startswith("held-out accuracy before training:"))
    after = next(line for line in lines if line.startswith("held-out accuracy after training:"))
    assert 0.0 <= float(before.split()[4]) <= 1.0 and 0.0 <= float(after.split()[4]) <= 1.0
    # LivePlotCallback's text fallback is the progress: one line per logging step, no raw log dicts.
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert "choice_accuracy" in proc.stdout and "{'loss'" not in proc.stdout + proc.stderr
    assert "FutureWarning" not in proc.stderr, proc.stderr[-3000:]
    # The merged export is a standalone checkpoint, and training changed the weights it holds.
    assert json.loads((out / "merged" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert _changed_tensors(str(out / "tiny-base"), str(out / "merged")) > 0


def test_example_script_is_short_enough_to_read_in_one_sitting():
    with open(os.path.join(EXAMPLES, "image_reasoning_grpo.py")) as f:
        source = f.read()
    assert len(source.splitlines()) <= 150
    for step in ("FastVisionModel.from_pretrained", "get_peft_model", "make_visual_reasoning_dataset",
                 "load_grpo_dataset", "think_answer_format", "VLMGRPOTrainer", "evaluate(", "save_pretrained_merged"):  # fmt: skip
        assert step in source, step


# The notebook


def _read_notebook():
    import nbformat

    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_committed_without_outputs_and_has_a_parameters_cell():
    notebook = _read_notebook()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    parameters = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "VLM_GRPO_MAX_STEPS" in parameters[0].source


def _png(data: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    assert image.format == "PNG"
    return image


@pytest.mark.trains
def test_notebook_runs_with_a_live_plot_and_a_before_after_table(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    for key, value in {**ENV, "VLM_GRPO_MAX_STEPS": "3"}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = _read_notebook()
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    train_cell = next(cell for cell in notebook.cells if "trainer.train()" in cell.source)
    plots = [out for out in train_cell.outputs if "image/png" in out.get("data", {})]
    assert len(plots) == 1, [out.get("data", {}).keys() for out in train_cell.outputs]  # one image, redrawn in place
    assert plots[0].output_type == "display_data"
    width, height = _png(plots[0]["data"]["image/png"]).size
    assert width > 300 and height > 200

    table_cell = next(cell for cell in notebook.cells if "CompletionTable(" in cell.source)
    html = table_cell.outputs[0]["data"]["text/html"]
    assert html.count("<tr>") == 1 + 6 and "before training" in html and "after training" in html
    thumbnails = [part.split('"')[0] for part in html.split('src="data:image/png;base64,')[1:]]
    assert len(thumbnails) == 6 and all(_png(t).size[0] <= 96 for t in thumbnails)
    assert (tmp_path / "runs" / "notebook" / "merged" / "config.json").exists()


# The YAML recipes


def test_there_are_the_four_kinds_of_recipe():
    names = [os.path.basename(p) for p in RECIPES]
    assert "cpu_smoke.yaml" in names
    kinds = {"count": False, "geometry": False, "grounding": False}
    for path in RECIPES:
        script, _ = parse_args(["--config", path])
        kinds["count"] |= script.task == "count" and "Qwen2.5-VL-3B" in script.model
        kinds["geometry"] |= (script.dataset or "").endswith("geometry3k") and "answer_accuracy" in (
            script.reward_funcs or []
        )
        kinds["grounding"] |= "iou" in (script.reward_funcs or [])
    assert all(kinds.values()), kinds


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_parses_and_says_what_it_is_for_and_what_it_needs(path):
    with open(path) as f:
        text = f.read()
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 4 and "What for:" in "\n".join(header) and "Hardware:" in "\n".join(header)
    # Every key is a flag of the command (a typo would make TrlParser fail here, not on the user's GPU).
    keys = set(yaml.safe_load(text))
    script, config = parse_args(["--config", path])
    assert keys <= set(vars(script)) | set(vars(config)), keys - set(vars(script)) - set(vars(config))
    funcs = [resolve_reward(name) for name in script.reward_funcs or []]
    if config.reward_weights is not None:
        assert len(config.reward_weights) == len(funcs)
    if script.dataset is None:
        assert script.task in TASKS
    if script.prompt_template is not None:
        assert "{prompt}" in script.prompt_template and "<answer>" in script.prompt_template
    assert config.per_device_train_batch_size % config.num_generations == 0
    assert "GPU" in "\n".join(header)


@pytest.fixture(scope="module")
def cpu_recipe_run(tmp_path_factory):
    """The CPU recipe for 2 steps through the installed console script, logging every step."""
    from test_cli import vlm_grpo

    out = tmp_path_factory.mktemp("cpu-recipe") / "run"
    proc = vlm_grpo("--config", os.path.join(EXAMPLES, "recipes", "cpu_smoke.yaml"), "--max_steps", "2",
                    "--logging_steps", "1", "--train_size", "16", "--test_size", "8", "--output_dir", str(out))  # fmt: skip
    return proc, out


@pytest.mark.trains
def test_cpu_recipe_runs_through_the_console_script(cpu_recipe_run):
    proc, out = cpu_recipe_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy after training" in proc.stdout
    assert set(json.loads((out / "eval.json").read_text())) >= {"before/accuracy", "after/accuracy"}
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.trains
def test_metrics_jsonl_holds_sample_completions_with_their_rewards(cpu_recipe_run):
    proc, out = cpu_recipe_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in records if "reward" in r]
    assert [r["step"] for r in training] == [1, 2]
    for record in training:
        samples = record["samples"]
        assert len(samples) == 4  # the default when num_completions_to_print is unset
        for sample in samples:
            assert sample["prompt"] == "What colour is the shape? Answer with one word."
            assert isinstance(sample["completion"], str)
            assert set(sample["rewards"]) == {"choice_accuracy"} and sample["rewards"]["choice_accuracy"] in (0.0, 1.0)
            assert isinstance(sample["advantage"], float)
            # The reward's own parse of the completion rides along (TRL's log_extra column): a reward of 1.0 means
            # the completion named exactly one colour.
            if sample["rewards"]["choice_accuracy"] == 1.0:
                assert sample["choice_accuracy_pred"] in ("red", "green", "blue", "yellow")


def test_readme_examples_section_links_every_example():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Examples") : readme.index("\n## ", readme.index("## Examples") + 1)]
    shipped = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(EXAMPLES, "**", "*.*"), recursive=True)]
    assert len(shipped) >= 6
    for path in shipped:
        assert f"]({path})" in section, path
    assert "vlm-grpo --config" in section

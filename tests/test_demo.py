"""The demo's settings are written once (`vlm_grpo.cli.demo.DEMO`): the command's defaults, the example script, the
notebook and the CPU recipe (a YAML users read, so it spells the values out) all agree with it."""

import dataclasses
import os

import yaml

from vlm_grpo.cli.command import parse_args
from vlm_grpo.cli.demo import DEMO
from vlm_grpo.data.tasks import TASK_SPECS
from vlm_grpo.training.trainer import VLMGRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_RECIPE = os.path.join(ROOT, "examples", "recipes", "cpu_smoke.yaml")
# The CPU recipe is the demo shortened (its header says so): fewer rows and steps, its own output directory.
SHORTENED = {"train_size", "test_size", "max_steps", "output_dir"}
# How the command shows progress is not part of the recipe.
NOT_IN_RECIPE = {"disable_tqdm"}


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_cpu_recipe_is_the_demo_shortened():
    recipe = yaml.safe_load(_read(CPU_RECIPE))
    demo = dataclasses.asdict(DEMO)
    assert set(recipe) <= set(demo), set(recipe) - set(demo)  # every key is a demo setting
    assert set(demo) - set(recipe) == NOT_IN_RECIPE  # and every demo setting is spelled out
    differ = {k: (recipe[k], demo[k]) for k in recipe if k not in SHORTENED and recipe[k] != demo[k]}
    assert not differ, f"cpu_smoke.yaml disagrees with vlm_grpo.cli.demo.DEMO (yaml, DEMO): {differ}"
    for key in SHORTENED - {"output_dir"}:
        assert 0 < recipe[key] < demo[key], key


def test_command_defaults_are_the_demo(tmp_path):
    script, config = parse_args([])
    assert {k: getattr(script, k) for k in ("model", "task", "difficulty", "train_size")} == {
        "model": DEMO.model, "task": DEMO.task, "difficulty": DEMO.difficulty, "train_size": DEMO.train_size,
    }  # fmt: skip
    # No --image_size: the task's own canvas, the demo's for its task.
    assert script.image_size is None and TASK_SPECS[DEMO.task].image_size == DEMO.image_size
    assert script.test_size is None  # means DEMO.test_size for a synthetic task, 0.1 of the rows for --dataset
    # The same values through VLMGRPOConfig's own normalisation (report_to "none" -> [], enums for strategies).
    expected = VLMGRPOConfig(use_cpu=True, **DEMO.training_args())
    for key in DEMO.training_args():
        assert getattr(config, key) == getattr(expected, key), key
    assert config.learning_rate == 5e-4 and config.num_generations == 16  # the values docs/demo.md argues for


def test_batch_is_whole_groups():
    assert DEMO.prompts_per_step * DEMO.num_generations == DEMO.per_device_train_batch_size
    assert DEMO.prompts_per_step == 4


def test_example_script_and_notebook_read_the_demo_rather_than_repeat_it():
    import nbformat

    script = _read("examples/image_reasoning_grpo.py")
    notebook = nbformat.reads(_read("examples/notebooks/image_reasoning_grpo.ipynb"), as_version=4)
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    for source in (script, code):
        assert "from vlm_grpo.cli.demo import DEMO" in source
        for setting in ("DEMO.learning_rate", "DEMO.num_generations", "DEMO.max_completion_length"):
            assert setting in source, setting
        code_only = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments may name it
        assert "5e-4" not in code_only and "0.0005" not in code_only  # the demo's learning rate is not set again

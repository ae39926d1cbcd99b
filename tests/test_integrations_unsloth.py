"""Unsloth interop. The unsloth_zoo tests run in CI's second environment (unsloth + its pinned stack).

Unsloth's FastVisionModel cannot load a model on a CPU-only machine (it queries CUDA device properties), so
the patch is tested on `unsloth_zoo.peft_utils` directly, on a PEFT-wrapped tiny VLM.
"""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
from conftest import TRL_TRAINS_HERE, image_batch, lora_b_grads

from vlm_grpo.compat import checkpointing_settings, enable_checkpointing

HAS_UNSLOTH_ZOO = importlib.util.find_spec("unsloth_zoo") is not None
needs_zoo = pytest.mark.skipif(
    not HAS_UNSLOTH_ZOO, reason="unsloth_zoo not installed (CI's unsloth environment has it)"
)


def test_importing_vlm_grpo_never_imports_unsloth_zoo():
    code = (
        "import sys, vlm_grpo, vlm_grpo.training.trainer, vlm_grpo.models.loader, vlm_grpo.rewards, vlm_grpo.cli.command, vlm_grpo.training.evaluation\n"
        "import vlm_grpo.integrations.unsloth\n"
        "from vlm_grpo import VLMGRPOTrainer, FastVisionModel\n"
        "print([m for m in sys.modules if m.startswith(('unsloth', 'unsloth_zoo'))])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(HAS_UNSLOTH_ZOO, reason="checks the behaviour without unsloth_zoo")
def test_patch_is_a_no_op_without_unsloth_zoo():
    from vlm_grpo.integrations.unsloth import is_patched, patch_unsloth_zoo

    assert patch_unsloth_zoo() is False and not is_patched()


@pytest.fixture
def peft_utils(monkeypatch):
    monkeypatch.setenv("UNSLOTH_ZOO_DISABLE_GPU_INIT", os.environ.get("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1"))
    import unsloth_zoo.peft_utils as module

    from vlm_grpo.integrations.unsloth import unpatch_unsloth_zoo

    yield module
    unpatch_unsloth_zoo()


def _peft_tiny(tiny_dir, reentrant=True):
    """A tiny Qwen2.5-VL with LoRA on vision and language layers, checkpointed, and no vlm_grpo hooks on it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlm_grpo.media.processor import load_processor
    from vlm_grpo.models.loader import select_lora_modules

    path = tiny_dir("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(path)
    names = select_lora_modules(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=names))
    enable_checkpointing(model, {"use_reentrant": reentrant})
    model.base_model.model.disable_input_require_grads()  # frozen inputs, as Unsloth leaves them
    model.train()
    return model, load_processor(path, "qwen2_5_vl")


@needs_zoo
def test_patched_unsloth_zoo_trains_every_lora_b_from_logits(peft_utils, tiny_dir):
    from vlm_grpo.integrations.unsloth import is_patched, patch_unsloth_zoo

    assert patch_unsloth_zoo() is True and is_patched()
    model, processor = _peft_tiny(tiny_dir)
    peft_utils.requires_grad_for_gradient_checkpointing(model)  # what Unsloth's get_peft_model calls
    grads = lora_b_grads(model, image_batch(processor))
    assert any(".visual.blocks." in n for n in grads) and any(".language_model." in n for n in grads)
    zero = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not zero, zero


@needs_zoo
def test_patch_is_idempotent_and_rebinds_earlier_imports(peft_utils):
    from vlm_grpo.integrations.unsloth import patch_unsloth_zoo

    original = peft_utils.requires_grad_for_gradient_checkpointing
    early = types.ModuleType("imported_unsloth_zoo_before_vlm_grpo")
    early.requires_grad_for_gradient_checkpointing = original  # `from unsloth_zoo.peft_utils import ...`
    sys.modules[early.__name__] = early
    try:
        assert patch_unsloth_zoo() and patch_unsloth_zoo()
        patched = peft_utils.requires_grad_for_gradient_checkpointing
        assert patched is not original and getattr(patched, "_vlm_grpo_patched", False)
        assert early.requires_grad_for_gradient_checkpointing is patched
    finally:
        del sys.modules[early.__name__]


@needs_zoo
def test_trainer_replaces_hooks_unsloth_registered_before_the_patch(peft_utils, tiny_dir, tmp_path, caplog):
    from vlm_grpo.data import make_visual_reasoning_dataset
    from vlm_grpo.integrations.unsloth import is_patched
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    model, processor = _peft_tiny(tiny_dir)
    peft_utils.requires_grad_for_gradient_checkpointing(model)  # Unsloth's own hooks, unpatched
    assert not is_patched()

    def unsloth_hooks():
        return [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
                if getattr(h, "__module__", "") == "unsloth_zoo.peft_utils"]  # fmt: skip

    assert unsloth_hooks()
    config = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        **checkpointing_settings(True, {"use_reentrant": True}),
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer = VLMGRPOTrainer(
            model, [lambda prompts, completions, **kw: [float(len(str(c))) for c in completions]], args=config,
            train_dataset=make_visual_reasoning_dataset("color", 4), processing_class=processor,
        )  # fmt: skip
    assert is_patched() and not unsloth_hooks()
    assert "replaced" in caplog.text and "patch_unsloth_zoo" in caplog.text
    if TRL_TRAINS_HERE:  # Unsloth's pinned TRL (1.15) cannot run GRPO steps on CPU
        trainer.train()
    grads = lora_b_grads(trainer.model, image_batch(processor))
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())

"""`vlm_grpo.engine.lora_merge`: LoRA merged into the base weights while generating, the same completions as the
adapter, the base weights back bit for bit, and where their backup is kept. (A restore deferred to overlap the next
forward runs only on a GPU: `tests/gpu/test_gpu_lora_merge.py`.)"""

from __future__ import annotations

import pytest
import torch
from test_fast_generation import ROWS, _batch, _fast, _plain, _trainer

from vlm_grpo.engine.fast_generation import FastGenerator
from vlm_grpo.engine.lora_merge import BaseWeightBackup, choose_backup, merged_lora
from vlm_grpo.models.loader import FastVisionModel


def test_merged_lora_generates_like_the_adapter_and_restores_weights_bit_exactly(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, lora_b=0.5)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    batch = _batch(trainer, ROWS, 2)
    plain = _plain(trainer, batch, 2)  # unmerged adapter, TRL's path
    base_only = None
    with model.disable_adapter():
        base_only = _plain(trainer, batch, 2)
    assert plain != base_only  # the adapter changes the completions, so merging is visible
    assert trainer.fast_generator.merge_lora
    assert _fast(trainer, batch) == plain
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], w) for n, w in before.items())
    with merged_lora(model) as merged:  # inside the block the merged weights differ from the originals
        assert merged and any(not torch.equal(after[n], w) for n, w in before.items())
    assert all(torch.equal(after[n], w) for n, w in before.items())


def test_merging_turns_off_only_the_merged_adapters_and_leaves_frozen_ones_frozen(tiny_dir, tmp_path):
    # The merge sets each merged layer's own flag instead of PEFT's `disable_adapter()`, which would also re-enable
    # gradients on every adapter when the block ends (and walks the model twice per generation).
    trainer = _trainer(tiny_dir, tmp_path, lora_b=0.5)
    model = trainer.model
    lora = [m for m in model.modules() if hasattr(m, "lora_A")]
    frozen = [p for n, p in model.named_parameters() if "lora_" in n and ".visual." in n]
    assert lora and frozen
    for param in frozen:  # the user froze the vision adapters
        param.requires_grad_(False)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    with merged_lora(model) as merged:
        assert merged and all(m.disable_adapters for m in lora)
    assert not any(m.disable_adapters for m in lora)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    batch = _batch(trainer, ROWS, 2)
    assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert not any(p.requires_grad for p in frozen)


def test_a_host_backup_restores_bit_exactly_and_is_refreshed_only_when_a_weight_changes(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, lora_b=0.5)
    trainer.fast_generator.merge_backup = "host"
    model = trainer.model
    bases = {n: p for n, p in model.named_parameters() if "base_layer" in n and p.dim() == 2}
    before = {n: p.detach().clone() for n, p in bases.items()}
    batch = _batch(trainer, ROWS, 2)
    plain = _plain(trainer, batch, 2)
    assert _fast(trainer, batch) == plain  # merged from, and restored from, the host copy
    backup = trainer.fast_generator.backup()
    # The text attention layers' q/k/v are merged into stacked copies instead (engine.fused_projections): no backup.
    stacked = 3 * len(trainer.fast_generator.fused_projections(model).sites)
    assert stacked > 0 and backup.where == "host" and backup.host_refreshes == len(bases) - stacked
    assert all(torch.equal(bases[n], w) for n, w in before.items())
    assert _fast(trainer, batch) == plain
    assert backup.host_refreshes == len(bases) - stacked  # frozen weights: the copy made once is reused
    weight = next(iter(bases.values()))
    with torch.no_grad():  # a base weight changed in place (say, a user unfroze it): its copy must follow
        weight.mul_(1.5)
    changed = weight.detach().clone()
    with merged_lora(model, backup) as merged:
        assert merged and not torch.equal(weight, changed)
    # This merge (no stacked copies) backs up the q/k/v weights too, for the first time, and the changed one again.
    assert torch.equal(weight, changed) and backup.host_refreshes == len(bases) + 1
    with pytest.raises(ValueError, match="auto, device, host"):
        BaseWeightBackup("gpu")
    with pytest.raises(ValueError, match="recorded, compiler, off"):
        FastGenerator(cuda_graph="trees")


def test_auto_keeps_the_backup_on_the_host_only_for_gpu_weights_that_fit_in_host_memory(monkeypatch):
    gpu, gib = torch.device("cuda"), 2**30
    assert choose_backup(gib, torch.device("cpu"))[0] == "device"  # CPU weights: "host" would be a second RAM copy
    assert choose_backup(gib, gpu)[0] == "host"
    where, why = choose_backup(2**50, gpu)  # a petabyte of weights does not fit: the copy stays on the GPU
    assert where == "device" and "GiB of host memory available" in why
    fits_once = choose_backup(gib, gpu)[1].split("; ")[1]
    available = float(fits_once.split()[0]) * gib
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # eight local ranks each pin their own copy
    assert choose_backup(int(available / 8), gpu)[0] == "device"
    assert choose_backup(int(available / 32), gpu)[0] == "host"
    backup = BaseWeightBackup()  # "auto" by default, settled on the first merge
    assert backup.where is None and backup.resolve([torch.zeros(4, 4)]) == "device"


def test_a_lora_bias_is_not_merged_away(tiny_dir):
    # Merging disables the adapters for the block; a LoRA bias would go with them, so such adapters generate unmerged.
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, lora_bias=True)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)  # weights and biases: a trained-looking adapter
    with merged_lora(model) as merged:
        assert not merged


def test_a_restore_is_deferred_only_for_gpu_weights_and_never_after_an_error(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backup = BaseWeightBackup("host")

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) for m in model.modules())

    hooks_before = hooks()

    def restored() -> bool:
        return hooks() == hooks_before and all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    with merged_lora(model, backup, defer_restore=True) as merged:  # CPU weights: nothing to overlap, restored now
        assert merged and not restored()
    assert restored() and backup._pending is None
    with pytest.raises(RuntimeError, match="generation failed"), merged_lora(model, backup, defer_restore=True):
        raise RuntimeError("generation failed")
    assert restored()


def test_weights_read_without_calling_their_layer_keep_the_restore_from_being_deferred(tiny_dir):
    from vlm_grpo.engine.lora_merge import _embedding_weights

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, target_modules=["lm_head", "o_proj"])
    head = model.get_output_embeddings()
    assert hasattr(head, "lora_A")  # the LM head has an adapter: a fused loss reads its weight directly
    embeddings = _embedding_weights(model)
    assert id(head.get_base_layer().weight) in embeddings
    assert id(model.get_input_embeddings().weight) in embeddings
    backup = BaseWeightBackup("host")
    with merged_lora(model, backup, defer_restore=True) as merged:  # (on CPU the restore itself is not deferred)
        assert merged
        readers = {id(weight): reader for weight, _, reader in backup._saved}
    assert readers[id(head.get_base_layer().weight)] is None  # no reader: a deferred restore would not be waited for
    assert sum(reader is not None for reader in readers.values()) == len(readers) - 1  # the o_proj layers have theirs


def test_a_model_with_a_compiled_module_never_defers_its_restore(tiny_dir):
    # Dynamo does not run the hooks of the modules inside a compiled one: no layer would wait for its weight's copy.
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    backup = BaseWeightBackup("host")
    with merged_lora(model, backup, defer_restore=True):  # (on CPU the restore itself is not deferred)
        assert all(reader is not None for *_, reader in backup._saved)
    layer = next(m for n, m in model.named_modules() if n.endswith("language_model.layers.0"))
    layer.compile()  # regional compilation, as accelerate does it
    with merged_lora(model, backup, defer_restore=True):
        assert backup._saved and all(reader is None for *_, reader in backup._saved)

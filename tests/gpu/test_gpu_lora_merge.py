"""A restore of the base weights deferred to overlap the next forward (`vlm_grpo.engine.lora_merge.DeferredRestore`)
on a GPU: every layer's forward waits for its own weight's copy, and a training step leaves the base weights as they
were, with no hook left behind.

Skipped without CUDA. Run on a GPU machine with:  python -m pytest tests/gpu -q -s
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_each_layer_waits_for_its_own_weights_copy(tiny_dir):
    from vlm_grpo import FastVisionModel
    from vlm_grpo.engine.lora_merge import BaseWeightBackup, merged_lora

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4).cuda()
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = _hooks(model)
    ids = torch.randint(10, 50, (2, 16), device="cuda")  # plain text tokens of the tiny vocabulary (56)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        backup = BaseWeightBackup("host")

        def merged_then_held_back() -> None:  # merge and restore, the copies held back ~0.5 s on their stream
            backup._stream = backup._stream or torch.cuda.Stream()
            with torch.cuda.stream(backup._stream):
                torch.cuda._sleep(1_000_000_000)
            with merged_lora(model, backup, defer_restore=True) as merged:
                assert merged
            assert backup._pending is not None and _hooks(model) > hooks  # deferred: one waiting hook per weight

        # The last layer merged, called on its own first: it waits for its own copy (the last one queued).
        merged_then_held_back()
        name, last = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A")][-1]
        x = torch.randn(4, last.in_features, device="cuda", dtype=last.get_base_layer().weight.dtype)
        base = before[f"{name}.base_layer.weight"]
        assert torch.equal(last.get_base_layer()(x), torch.nn.functional.linear(x, base))
        backup.wait()
        assert _hooks(model) == hooks and backup._pending is None
        # A whole forward right after generation: every layer waits for its own weight.
        merged_then_held_back()
        assert torch.equal(model(input_ids=ids).logits, expected)  # merged weights read by a layer would differ
        backup.wait()  # the vision layers' hooks (this forward had no image) go too
        assert _hooks(model) == hooks and backup._pending is None
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_training_step_leaves_the_base_weights_whole_and_no_hooks(tiny_dir, tmp_path):
    from test_gpu_decode_graph import _setup

    from vlm_grpo import FastVisionModel

    trainer, _, _ = _setup(tiny_dir, tmp_path, do_sample=True)
    trainer.fast_generator.merge_backup = "host"
    model = trainer.model
    FastVisionModel.for_training(model)
    bases = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    hooks = _hooks(model)
    trainer.train()
    assert trainer.fast_generator.stats["calls"] == 1 and trainer.fast_generator.backup().where == "host"
    assert _hooks(model) == hooks and trainer.fast_generator.backup()._pending is None
    assert all(torch.equal(p, bases[n]) for n, p in model.named_parameters() if n in bases)


def test_the_first_merges_keep_a_gpu_copy_while_the_host_copy_is_pinned_then_restore_from_it(tiny_dir, monkeypatch):
    from vlm_grpo import FastVisionModel
    from vlm_grpo.engine import pinned_pool
    from vlm_grpo.engine.lora_merge import BaseWeightBackup, merged_lora

    monkeypatch.setattr(pinned_pool, "POOL_MIN_BYTES", 0)  # the tiny model's weights count as a large model's
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4).cuda()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    import threading

    from vlm_grpo.engine.pinned_pool import PinnedPool

    release, allocate = threading.Event(), PinnedPool._allocate
    monkeypatch.setattr(
        PinnedPool, "_allocate", lambda self, specs, pin: (release.wait(30), allocate(self, specs, pin))
    )
    backup = BaseWeightBackup("auto")  # "host" for a GPU model that fits in host memory
    for step in range(3):  # a GPU copy while pinning, then the pinned copies
        if step == 1:
            release.set()
            backup._pool._thread.join()
        with merged_lora(model, backup, defer_restore=True) as merged:
            assert merged and backup.now == ("device" if step == 0 else "host")
        backup.wait()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert backup._host and all(entry[1].is_pinned() for entry in backup._host.values())

"""`vlm_grpo.engine.prefix_cache` under activation checkpointing: the prompt-cache scorer keeps no more for backward
than TRL's plain path (its prompt forward is checkpointed too), with the same loss and gradients
(`tests/test_shared_prefix.py` compares those for every family, Qwen3.5 included)."""

from __future__ import annotations

import pytest
import torch
from test_shared_prefix import _batch, _trainer


def _kept_for_backward(trainer, inputs) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes of the distinct storages autograd keeps for its backward (what checkpointing recomputes
    instead is not kept: its own hooks, inside these, take those tensors)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    trainer.model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), sum(storages.values())


@pytest.mark.trains
def test_the_prompt_cache_scorer_keeps_no_more_for_backward_than_trl(tiny_dir, tmp_path):
    # Its prompt forward ran unchecked: 12.9 MB kept here against TRL's 2.2 MB, on the H100 Qwen3.5-4B's training peak
    # 23.5 GiB against TRL's 15.3.
    trainer = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", gc=True)
    inputs = _batch(trainer, "qwen3_5")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss normalises by it
    kept = {}
    for shared in (False, True):
        trainer.args.shared_prefix = shared
        calls = trainer.shared_prefix_calls
        kept[shared] = _kept_for_backward(trainer, inputs)
        assert trainer.shared_prefix_calls == calls + shared  # the prompt-cache path served the second
    (plain_loss, plain_bytes), (loss, prefix_bytes) = kept[False], kept[True]
    assert abs(loss - plain_loss) <= 1e-3 * abs(plain_loss) + 1e-6
    assert 0 < prefix_bytes <= plain_bytes, (prefix_bytes, plain_bytes)


@pytest.mark.trains
def test_reentrant_checkpointing_falls_back_to_trl_with_its_reason_and_the_same_gradients(tiny_dir, tmp_path):
    # Reentrant checkpointing runs a layer's forward without gradients, so the prompt's cache would reach the
    # continuation detached: 70 LoRA weights' gradients wrong and nothing raised, had the path served it.
    trainer = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", gc="reentrant")
    inputs = _batch(trainer, "qwen3_5")
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    grads = {}
    for shared in (False, True):
        trainer.args.shared_prefix = shared
        model.zero_grad()
        trainer.compute_loss(model, inputs).backward()
        grads[shared] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any("reentrant" in reason for reason in trainer.shared_prefix_fallbacks), trainer.shared_prefix_fallbacks
    assert set(grads[True]) == set(grads[False]) and len(grads[False]) > 70
    for name, grad in grads[False].items():
        assert (grads[True][name] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, name


@pytest.mark.trains
def test_a_reentrant_checkpoint_applied_outside_transformers_is_caught_by_the_detached_cache(tiny_dir, tmp_path):
    # torch's own reentrant wrapper (as FSDP setups apply it) leaves transformers' checkpointing settings off, so the
    # settings say nothing: the prompt's cache coming out without gradients does (80 of 80 gradients were wrong).
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    trainer = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", gc=False)
    inputs = _batch(trainer, "qwen3_5")
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1

    def grads(shared):
        trainer.args.shared_prefix = shared
        model.zero_grad()
        trainer.compute_loss(model, inputs).backward()
        return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip

    reference = grads(False)
    reentrant = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=reentrant, check_fn=lambda m: type(m).__name__ == "Qwen3_5DecoderLayer"
    )
    calls = trainer.shared_prefix_calls
    served = grads(True)
    assert trainer.shared_prefix_calls == calls  # declined
    assert any("without gradients" in reason for reason in trainer.shared_prefix_fallbacks)
    assert set(served) == set(reference)
    for name, grad in reference.items():
        assert (served[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, name

"""`vlm_grpo.engine.pinned_pool`: host buffers made on a background thread, and the merge's backup kept on the GPU until
they are ready. (The pinning itself needs a GPU; on the CPU the same thread allocates plain host memory.)"""

from __future__ import annotations

import logging
import threading

import torch

from vlm_grpo.engine import pinned_pool
from vlm_grpo.engine.lora_merge import BaseWeightBackup, merged_lora
from vlm_grpo.engine.pinned_pool import PinnedPool, room_on_device
from vlm_grpo.models.loader import FastVisionModel


def _model(tiny_dir):
    """A tiny Qwen2.5-VL with LoRA whose adapters change the weights they are merged into."""
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False)
    return model


def test_the_pool_hands_out_each_buffer_once_and_only_for_its_shape_and_dtype():
    pool = PinnedPool([(1, torch.Size([2, 3]), torch.bfloat16), (2, torch.Size([4]), torch.float32)], pin=False)
    first = pool.take(1, torch.Size([2, 3]), torch.bfloat16)
    assert pool.ready() and first.shape == (2, 3) and first.dtype == torch.bfloat16 and first.device.type == "cpu"
    assert pool.take(1, torch.Size([2, 3]), torch.bfloat16) is None  # handed out once
    assert pool.take(2, torch.Size([5]), torch.float32) is None and not pool._buffers  # a weight that changed shape
    assert not room_on_device(1, torch.device("cpu"))  # never a second copy in host memory "on the device"


def test_a_failed_background_allocation_is_said_and_left_to_the_caller(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("cannot pin memory")

    monkeypatch.setattr(torch, "empty", refuse)
    pool = PinnedPool([(1, torch.Size([2]), torch.float32)], pin=False)
    with caplog.at_level(logging.WARNING):
        assert pool.take(1, torch.Size([2]), torch.float32) is None
    assert "cannot pin memory" in caplog.text


def test_merges_keep_a_gpu_copy_until_the_host_buffers_are_made_then_use_them(tiny_dir, monkeypatch):
    model = _model(tiny_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # A GPU with room (the CPU test's stand-in), and pinning that takes until the test lets it finish.
    monkeypatch.setattr(pinned_pool, "room_on_device", lambda needed, device: True)
    monkeypatch.setattr(pinned_pool, "POOL_MIN_BYTES", 0)  # the tiny model's weights count as a large model's
    release, allocate = threading.Event(), PinnedPool._allocate

    def slow(self, specs, pin):
        release.wait(30)
        allocate(self, specs, pin)

    monkeypatch.setattr(PinnedPool, "_allocate", slow)
    backup = BaseWeightBackup("auto")
    backup.where = "host"  # what "auto" chooses for GPU weights that fit in host memory

    def restored() -> bool:
        return all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    with merged_lora(model, backup) as merged:  # the first merge: buffers not made yet, a copy beside each weight
        assert merged and not restored() and backup.now == "device" and backup._pool is not None
    assert restored() and backup.host_refreshes == 0 and not backup._host
    release.set()
    backup._pool._thread.join()
    made = {id(b) for b in backup._pool._buffers.values()}
    with merged_lora(model, backup) as merged:  # buffers made: the host copies go into them
        assert merged and backup.now == "host"
    assert restored() and backup.host_refreshes == len(made) > 0 and backup._pool is None
    assert {id(entry[1]) for entry in backup._host.values()} == made
    with merged_lora(model, backup):  # and are reused, as before
        pass
    assert restored() and backup.host_refreshes == len(made)


def test_small_models_pin_their_backup_in_place(tiny_dir, monkeypatch):
    model = _model(tiny_dir)
    monkeypatch.setattr(pinned_pool, "room_on_device", lambda needed, device: True)
    backup = BaseWeightBackup("host")
    with merged_lora(model, backup) as merged:  # well under POOL_MIN_BYTES: pinned at once, as it always was
        assert merged and backup.now == "host" and backup._pool is None
    assert backup.host_refreshes > 0


def test_host_asked_by_name_never_takes_gpu_memory_and_no_room_means_pinning_in_place(tiny_dir, monkeypatch):
    model = _model(tiny_dir)
    monkeypatch.setattr(pinned_pool, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(pinned_pool, "room_on_device", lambda needed, device: True)
    backup = BaseWeightBackup("host")  # asked by name: a GPU copy would break that promise
    with merged_lora(model, backup):
        assert backup.now == "host" and backup._pool is None
    monkeypatch.setattr(pinned_pool, "room_on_device", lambda needed, device: False)
    backup = BaseWeightBackup("auto")
    backup.where = "host"
    with merged_lora(model, backup):  # no room on the GPU: pinned in place, as before
        assert backup.now == "host" and backup._pool is None
    assert backup.host_refreshes > 0


def test_buffers_left_in_the_pool_are_freed_after_the_first_host_merge(tiny_dir, monkeypatch):
    model = _model(tiny_dir)
    monkeypatch.setattr(pinned_pool, "POOL_MIN_BYTES", 0)
    room = [True]
    monkeypatch.setattr(pinned_pool, "room_on_device", lambda needed, device: room[0])
    backup = BaseWeightBackup("auto")
    backup.where = "host"
    with merged_lora(model, backup):
        pool = backup._pool
        assert pool is not None
    pool._thread.join()
    pool._buffers[-1] = torch.empty(3)  # a buffer no merged weight takes (one the next merges no longer need)
    room[0] = False
    with merged_lora(model, backup):
        assert backup.now == "host"
    assert backup._pool is None and backup.host_refreshes > 0


def _fresh_fast_pinning(monkeypatch, settings: str, cuda: bool = True) -> None:
    """`use_fast_pinning` not yet run in this process, torch's allocator settings `settings`, a GPU there or not."""
    monkeypatch.setattr(pinned_pool, "_fast_pinning", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for name in pinned_pool.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch._C._accelerator_setAllocatorSettings(settings)


def test_fast_pinning_keeps_the_users_allocator_settings_and_adds_its_own_once(monkeypatch):
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        _fresh_fast_pinning(monkeypatch, "max_split_size_mb:512")
        assert pinned_pool.use_fast_pinning().startswith("set")
        # torch's parser resets what a settings string leaves out: the user's own setting is passed again, first.
        assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:512," + pinned_pool.FAST_PINNING
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:256")
        assert pinned_pool.use_fast_pinning().startswith("set")  # once per process: not applied again
        assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:256"
    finally:
        torch._C._accelerator_setAllocatorSettings(before)


def test_fast_pinning_leaves_a_users_own_pinning_settings_and_machines_without_cuda(monkeypatch):
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        _fresh_fast_pinning(monkeypatch, "pinned_num_register_threads:4")
        assert "left to the allocator settings given" in pinned_pool.use_fast_pinning()
        assert torch._C._accelerator_getAllocatorSettings() == "pinned_num_register_threads:4"
        _fresh_fast_pinning(monkeypatch, "", cuda=False)
        assert pinned_pool.use_fast_pinning() == "no CUDA"
        # Where torch has no record of its settings, the environment's are the user's.
        _fresh_fast_pinning(monkeypatch, "")
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:False")
        assert "left to the allocator settings given" in pinned_pool.use_fast_pinning()
    finally:
        torch._C._accelerator_setAllocatorSettings(before)

"""`vlm_grpo.training.gc_freeze`: a real tiny GRPO run freezes what lives all run after its first step, and after a step
that compiled, and gives it back to the collector when `train()` ends, also when it fails."""

import gc

import pytest
from datasets import Dataset
from PIL import Image
from transformers import TrainerCallback

from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer
from vlm_grpo.training.gc_freeze import FreezeLongLived


@pytest.fixture(autouse=True)
def _unfrozen():
    """Each test starts and ends with nothing frozen, so a failed one leaves no frozen objects to the next."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _rows(n: int = 4) -> Dataset:
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Colour {i}?"}], "image": image}
                              for i in range(n)])  # fmt: skip


class _FrozenCounts(TrainerCallback):
    """Records gc's frozen-object count as each step begins: what the steps before it left frozen."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.counts.append(gc.get_freeze_count())


def _trainer(tiny_dir, tmp_path, reward, **config) -> tuple[VLMGRPOTrainer, _FrozenCounts]:
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), full_finetuning=True)
    args = VLMGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                         max_completion_length=3, max_steps=3, report_to="none", save_strategy="no", use_cpu=True,
                         disable_tqdm=True, **{"gc_freeze": True, **config})  # fmt: skip
    counts = _FrozenCounts()
    trainer = VLMGRPOTrainer(model, [reward], args=args, train_dataset=_rows(), processing_class=processor,
                             callbacks=[counts])  # fmt: skip
    return trainer, counts


def _length(prompts, completions, **kwargs):
    return [float(len(str(c))) for c in completions]


@pytest.mark.trains
def test_the_run_is_frozen_after_its_first_step_and_unfrozen_after(tiny_dir, tmp_path):
    trainer, counts = _trainer(tiny_dir, tmp_path, _length)
    trainer.train()
    # Nothing before the first step; after it the model, TRL's trainer, the datasets... (~0.6 million objects).
    assert counts.counts[0] == 0 and len(counts.counts) == 3 and min(counts.counts[1:]) > 10_000, counts.counts
    assert gc.get_freeze_count() == 0  # given back when train() ended


@pytest.mark.trains
@pytest.mark.parametrize("setting", [False, None])  # None: on where training runs on a GPU, off for this CPU run
def test_off_freezes_nothing(tiny_dir, tmp_path, setting):
    trainer, counts = _trainer(tiny_dir, tmp_path, _length, gc_freeze=setting)
    assert trainer.gc_freeze.enabled is False
    trainer.train()
    assert counts.counts == [0, 0, 0]


@pytest.mark.trains
def test_a_failed_run_gives_back_what_it_froze(tiny_dir, tmp_path):
    calls = []

    def fails_on_the_second_step(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the reward broke")
        return _length(prompts, completions)

    trainer, counts = _trainer(tiny_dir, tmp_path, fails_on_the_second_step)
    with pytest.raises(Exception, match="the reward broke"):
        trainer.train()
    assert counts.counts[1] > 10_000 and gc.get_freeze_count() == 0  # frozen in step 2, given back as it failed


def test_a_step_that_compiled_freezes_again_and_others_do_not():
    # The callback alone, between steps that compile a real function with torch.compile or compile nothing: objects made
    # after a freeze are frozen only by a later step that compiled (frozen objects leave gc.get_objects()).
    import torch

    callback, state = FreezeLongLived(), type("State", (), {"global_step": 1})()
    callback.on_step_end(None, state, None)  # the first step: frozen whatever it compiled
    first = gc.get_freeze_count()
    kept = type("Made", (), {})()  # a new long-lived object, tracked by the collector

    def frozen() -> bool:
        return not any(o is kept for o in gc.get_objects())

    callback.on_step_end(None, state, None)  # nothing compiled: no new freeze
    # `<=`: a frozen object that dies leaves the permanent generation (CI once saw the count fall by 2 here); a freeze
    # would have taken `kept` with it
    assert gc.get_freeze_count() <= first and not frozen()
    torch.compile(lambda x: x * 3 + 1)(torch.ones(3))
    callback.on_step_end(None, state, None)  # compiled: frozen again, the new object with it
    assert gc.get_freeze_count() > first and frozen()
    callback.release()
    assert gc.get_freeze_count() == 0 and not frozen()


def test_off_by_default_and_none_follows_where_training_runs(tmp_path):
    import torch

    assert VLMGRPOConfig(output_dir=str(tmp_path)).gc_freeze is False  # until a GPU run measures it
    assert FreezeLongLived.as_configured(None, torch.device("cuda", 0)).enabled
    assert not FreezeLongLived.as_configured(None, torch.device("cpu")).enabled
    assert FreezeLongLived.as_configured(True, torch.device("cpu")).enabled
    assert not FreezeLongLived.as_configured(False, torch.device("cuda", 0)).enabled


def test_what_others_froze_before_training_is_said_when_the_run_freezes(caplog):
    others = [type("Theirs", (), {})() for _ in range(3)]
    gc.freeze()
    callback = FreezeLongLived()
    with caplog.at_level("INFO", logger="vlm_grpo.training.gc_freeze"):
        callback.on_step_end(None, type("State", (), {"global_step": 1})(), None)
    assert (
        len(others) == 3 and "frozen before training" in caplog.text and "are unfrozen when train() ends" in caplog.text
    )

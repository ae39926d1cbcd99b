"""vlm_grpo.compat speaks the installed transformers' names, quietly; the deprecation guard catches our own calls."""

import contextlib
import importlib
import inspect
import sys
import types
import warnings

import deprecation_guard
import pytest
import torch

from vlm_grpo.compat import (
    CHECKPOINTING_ARG,
    cache_kwarg,
    checkpointing_from_args,
    checkpointing_settings,
    disable_checkpointing,
    enable_checkpointing,
    is_checkpointing,
)
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.models.modes import checkpointing_mode
from vlm_grpo.training.trainer import VLMGRPOConfig


@contextlib.contextmanager
def no_deprecation_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    deprecations = [str(w.message) for w in caught if issubclass(w.category, deprecation_guard.DEPRECATIONS)]
    assert not deprecations


def test_cache_kwarg_is_the_name_the_forward_takes(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    name = cache_kwarg(model)
    assert name in inspect.signature(type(model).forward).parameters
    peft_model = FastVisionModel.get_peft_model(model, r=4)
    assert cache_kwarg(peft_model) == name  # looked up on the model inside PEFT's wrapper


def test_a_forward_with_a_cache_under_that_name_is_quiet_and_fills_it(tiny_dir):
    from transformers import DynamicCache

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    ids = processor.tokenizer("red green blue", return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    with no_deprecation_warnings(), torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == ids.shape[1]


def test_checkpointing_switches_quietly_and_round_trips(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    with no_deprecation_warnings():
        enable_checkpointing(model, {"use_reentrant": True})
        assert is_checkpointing(model) and checkpointing_mode(model) == "reentrant"
        disable_checkpointing(model)
        assert not is_checkpointing(model)
        disable_checkpointing(model)  # off already: a no-op
        FastVisionModel.for_training(model)
        assert checkpointing_mode(model) is True
        FastVisionModel.for_inference(model)
        assert not is_checkpointing(model)


def test_config_defaults_are_quiet_and_checkpoint_non_reentrant(tmp_path):
    with no_deprecation_warnings():
        config = VLMGRPOConfig(output_dir=str(tmp_path))
    assert checkpointing_from_args(config) == (True, {"use_reentrant": False})


@pytest.mark.parametrize("enabled", [False, True])
def test_config_takes_checkpointing_under_this_installs_name(tmp_path, enabled):
    with no_deprecation_warnings():
        config = VLMGRPOConfig(output_dir=str(tmp_path), **checkpointing_settings(enabled, {"use_reentrant": True}))
    assert checkpointing_from_args(config) == (enabled, {"use_reentrant": True})


def test_the_old_config_name_is_still_honoured(tmp_path):
    # A user's `gradient_checkpointing=False` must not be lost to our default; where it is a deprecated alias,
    # transformers says so (their code to change, not ours to hide).
    renamed = CHECKPOINTING_ARG != "gradient_checkpointing"
    with pytest.warns(FutureWarning, match="gradient_checkpointing") if renamed else contextlib.nullcontext():
        config = VLMGRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False)
    assert checkpointing_from_args(config)[0] is False


# ----- the guard in tests/deprecation_guard.py -----


def _library_function(function, library: str):
    """`function` as if defined in a third-party module `library` (its module name and file are the library's)."""
    code = function.__code__.replace(co_filename=f"<{library}>")
    return types.FunctionType(code, {"__name__": library, "warnings": warnings})


def _old_api():
    warnings.warn("old_api is deprecated", FutureWarning)


def _uses_old_api(f):
    f()


LIBRARY = {"old_api": _library_function(_old_api, "somelib")}
OTHER = {"uses_old_api": _library_function(_uses_old_api, "otherlib")}


def test_guard_names_our_line_when_we_call_a_deprecated_api():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard sees the call even where filters hide the warning
        line = sys._getframe().f_lineno + 1
        LIBRARY["old_api"]()
    found, deprecation_guard.found[:] = list(deprecation_guard.found), []  # caught: this test must not fail for it
    assert found == [f"tests/test_compat.py:{line}: old_api is deprecated"]


def test_guard_leaves_a_libraries_own_deprecated_call_to_the_filters():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OTHER["uses_old_api"](LIBRARY["old_api"])  # another library calls it: theirs to fix
    assert deprecation_guard.found == []


def test_guard_leaves_a_plumbing_librarys_deprecation_raised_under_another_library_to_the_filters():
    # torch deprecates its own API; bitsandbytes calls it as it is imported by a test: bitsandbytes' to fix.
    torch_api = _library_function(_old_api, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OTHER["uses_old_api"](torch_api)
    assert deprecation_guard.found == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        line = sys._getframe().f_lineno + 1
        torch_api()  # called by us: ours
    found, deprecation_guard.found[:] = list(deprecation_guard.found), []
    assert found == [f"tests/test_compat.py:{line}: old_api is deprecated"]


def test_guard_leaves_a_librarys_deprecated_call_made_as_it_is_imported_to_the_filters(tmp_path, monkeypatch):
    # torch.compile's first use imports torch.utils.mkldnn, whose class body calls torch's own deprecated
    # `torch.jit.script_method`: torch's call, though the only non-torch frame on the stack is the test's.
    package = tmp_path / "somelib_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import warnings\nwarnings.warn('old_api is deprecated', FutureWarning)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("somelib_pkg")
    monkeypatch.delitem(sys.modules, "somelib_pkg")
    assert deprecation_guard.found == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_training_a_bitsandbytes_model_on_a_cpu_is_refused_before_the_first_step(tiny_dir, tmp_path):
    # On a CPU with AVX512-BF16, bitsandbytes repacks 4-bit weights at the first forward without gradients (the
    # rollouts'), then fails inside its 4-bit matmul in that layout in the first backward. In the stored layout it
    # trains (tests/test_quantized_generation.py switches the repacking off).
    pytest.importorskip("bitsandbytes")
    from datasets import Dataset
    from PIL import Image

    from vlm_grpo.models.loader import FastVisionModel, _bitsandbytes_runs_on_cpu
    from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

    if not _bitsandbytes_runs_on_cpu():
        pytest.skip("this bitsandbytes has no CPU backend (< 0.46): it cannot even load here")
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"), load_in_4bit=True)
    if not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules()):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes keeps the stored layout, which trains")
    model = FastVisionModel.get_peft_model(model, r=4)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
             "images": [Image.new("RGB", (56, 56), "red")]}] * 2  # fmt: skip
    args = VLMGRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=2, report_to="none", use_cpu=True)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [lambda completions, **kw: [0.0] * len(completions)], args=args,
                             train_dataset=Dataset.from_list(rows), processing_class=processor)  # fmt: skip
    with pytest.raises(RuntimeError, match="repacks 4-bit weights into an inference-only layout"):
        trainer.train()
    assert trainer.state.global_step == 0

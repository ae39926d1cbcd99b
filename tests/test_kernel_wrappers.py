"""`vlm_grpo.engine.kernel_wrappers`: a decoder layer holding transformers' hub-kernel wrappers (transformers >= 5.25
with `kernels`) is compiled ahead of time, saved and loaded like any other; the key tells their forwards apart."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from vlm_grpo import FastVisionModel
from vlm_grpo.engine import kernel_wrappers
from vlm_grpo.engine.aot_keys import signature_key
from vlm_grpo.engine.aot_layers import AheadOfTime, no_marks


def _first_layer_and_its_call(tiny_dir):
    torch.manual_seed(0)
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    model.train()
    layer = model.get_base_model().model.language_model.layers[0]
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, a, k: seen.update(call=(a, k)), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    hook.remove()
    args, kwargs = seen["call"]
    return layer, (args[0].detach().requires_grad_(),), kwargs


def _output(result):
    return result[0] if isinstance(result, tuple) else result


def test_a_layer_with_hub_kernel_wrappers_is_saved_and_a_later_process_loads_it(tiny_dir, tmp_path, fresh_dynamo):
    # transformers 5.25's wrapped `apply_rotary_pos_emb` made torch refuse to save every decoder layer of Qwen-VL.
    layer, args, kwargs = _first_layer_and_its_call(tiny_dir)
    expected = _output(layer(*args, **kwargs))
    ahead = AheadOfTime(str(tmp_path))
    out = ahead.call(layer, args, kwargs, None, no_marks, lambda: pytest.fail("fell back to torch.compile"))
    assert ahead.compiled == 1 and ahead.events == [] and list(tmp_path.glob("*.aot")), ahead.events
    torch._dynamo.reset()  # as a later process: nothing traced in memory
    later = AheadOfTime(str(tmp_path))
    again = later.call(layer, args, kwargs, None, no_marks, lambda: pytest.fail("fell back to torch.compile"))
    assert (later.loaded, later.compiled) == (1, 0) and later.events == []
    torch.testing.assert_close(_output(out), expected)
    torch.testing.assert_close(_output(again), expected)


def test_a_named_wrapper_class_pickles_by_where_its_wrapper_lives():
    wrappers = [
        (module, name, value)
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("transformers.models.")
        for name, value in list(vars(module).items())
        if kernel_wrappers.wrapped_function(value) is not None
    ]
    if not wrappers:
        pytest.skip("this transformers wraps no function in a hub-kernel wrapper (< 5.25, or no `kernels`)")
    module, name, wrapper = wrappers[0]
    assert kernel_wrappers.wrapped_function(wrapper).__name__ == name  # what the key hashes for it
    holder = torch.nn.Module()
    holder.__class__ = type("Holder", (torch.nn.Module,), {"__module__": module.__name__})
    kernel_wrappers.name_wrappers(holder)
    kind = type(wrapper)
    assert kind.__module__ == "vlm_grpo.engine.kernel_wrappers" and "<locals>" not in kind.__qualname__
    assert pickle.loads(pickle.dumps(kind)) is kind
    with pytest.raises(AttributeError):
        kernel_wrappers.something_else  # noqa: B018


def test_the_key_tells_a_wrapper_running_a_hub_kernel_from_one_running_the_wrapped_function(tiny_dir):
    layer, args, kwargs = _first_layer_and_its_call(tiny_dir)
    attention = layer.self_attn
    private = attention.__dict__.get("_kernel_funcs")
    if not private:
        pytest.skip("this transformers keeps no hub-kernel wrappers in its attention (< 5.25, or no `kernels`)")
    key = signature_key(layer, args, kwargs)
    wrapper = next(iter(private.values()))
    wrapper.forward = lambda *a, **k: pytest.fail("not called")  # as `kernelize` puts a hub kernel's forward there
    try:
        assert signature_key(layer, args, kwargs) != key
    finally:
        del wrapper.forward
    assert signature_key(layer, args, kwargs) == key

"""`vlm_grpo.engine.aot_layers`: layers' training forwards compiled ahead of time, saved, and loaded by a later
trainer with no Dynamo trace (a trainer loads them in `tests/test_background_compile.py`), giving the eager gradients;
a signature's key covers what a loaded function's dropped guards would have checked; whatever it cannot serve falls
back to torch.compile, said once."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from test_compiled_layers import _assert_the_eager_loss_and_gradients, _eager_baseline, _loss_and_grads
from torch._dynamo.utils import counters

from vlm_grpo.engine.aot_keys import signature_key
from vlm_grpo.engine.aot_layers import AheadOfTime, ahead_of_time
from vlm_grpo.engine.compiled_layers import CompiledLayers
from vlm_grpo.training.trainer import VLMGRPOConfig


def test_the_key_covers_what_a_loaded_functions_dropped_guards_would_have_checked():
    layers = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()) for _ in range(2)]
    x = torch.randn(2, 3, 4)
    key = signature_key(layers[0], (x,), {"mask": None})
    assert signature_key(layers[1], (torch.randn(2, 9, 4),), {"mask": None}) == key  # another layer, another length
    other_activation = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    differs = [
        signature_key(other_activation, (x,), {"mask": None}),  # an object identity Dynamo would have guarded
        signature_key(layers[0], (x.clone().requires_grad_(),), {"mask": None}),
        signature_key(layers[0], (x.double(),), {"mask": None}),
        signature_key(layers[0], (x,), {"mask": torch.ones(2, 3)}),
        signature_key(layers[0], (x,), {}),
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # global state: dropped from a saved function's guards
        differs.append(signature_key(layers[0], (x,), {"mask": None}))
    assert key not in differs and len(set(differs)) == len(differs)


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        torch._dynamo.graph_break()  # not one graph: aot_compile (fullgraph) refuses it
        return y.relu()


def test_a_layer_that_breaks_the_graph_runs_through_torch_compile_said_once(tmp_path, caplog, fresh_dynamo):
    ahead, layer, calls = AheadOfTime(str(tmp_path)), _Breaks(), []

    def fallback():
        calls.append(1)
        return layer(x)

    x = torch.randn(2, 3, 4, requires_grad=True)
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        for _ in range(2):
            out = ahead.call(layer, (x,), {}, None, lambda *_: None, fallback)
    assert torch.equal(out, layer(x)) and len(calls) == 2
    assert caplog.text.count("compiled by torch.compile instead") == 1 and ahead.compiled == 0
    assert not os.listdir(tmp_path)


def test_a_torn_file_is_said_and_compiled_again(tmp_path, caplog, fresh_dynamo):
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
    x = torch.randn(2, 3, 4, requires_grad=True)
    path = tmp_path / f"{signature_key(layer, (x,), {})}-0.aot"
    path.write_bytes(b"not a compiled function")
    ahead = AheadOfTime(str(tmp_path))
    # torch 2.11's default (the GPU machine's; 2.13 turned it on): `aot_compile` existed only with it on, and every
    # layer fell back to torch.compile there.
    with (
        caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"),
        torch._dynamo.config.patch(enable_aot_compile=False),
    ):
        out = ahead.call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("compiled, not fallen back"))
    assert "could not be loaded" in caplog.text and (ahead.loaded, ahead.compiled) == (0, 1)
    assert torch.allclose(out, layer(x)) and path.read_bytes() != b"not a compiled function"


class _Fails:
    """Stands in for a loaded function whose call passes its guards and then raises (a torch version's bug in running
    it): the real thing cannot be made to on demand."""

    def __init__(self, error: Exception, served: int = 0) -> None:
        self.error, self.served = error, served

    def __call__(self, *args, **kwargs):
        if self.served:
            self.served -= 1
            return "served"
        raise self.error


def test_a_function_that_fails_its_first_call_falls_back_said_and_later_failures_are_the_steps_error(tmp_path, caplog):
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    key = signature_key(layer, (x,), {})

    def call(ahead, function):
        ahead._entries[key] = [function]
        return ahead.call(layer, (x,), {}, None, lambda *_: None, lambda: "torch.compile")

    ahead = AheadOfTime(str(tmp_path))
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        assert call(ahead, _Fails(RuntimeError("CUDA error: an illegal memory access"))) == "torch.compile"
    assert "its first call raised RuntimeError: CUDA error" in caplog.text and "illegal memory" in ahead.events[0]
    assert ahead.call(layer, (x,), {}, None, lambda *_: None, lambda: "torch.compile") == "torch.compile"  # given up
    later = AheadOfTime(str(tmp_path))
    with pytest.raises(torch.OutOfMemoryError):  # memory running out is the step's error, first call or not
        call(later, _Fails(torch.OutOfMemoryError("CUDA out of memory")))
    served = _Fails(ValueError("a later failure"), served=1)
    assert call(later, served) == "served"
    with pytest.raises(ValueError, match="a later failure"):  # it has served a call: not hidden behind a fallback
        later.call(layer, (x,), {}, None, lambda *_: None, lambda: "torch.compile")


def test_ahead_of_time_needs_dynamic_lengths_and_the_compile_cache_and_is_on_by_default_where_it_can_be(tmp_path):
    with pytest.raises(ValueError, match="compile_layers_ahead_of_time compiles with the lengths dynamic"):
        VLMGRPOConfig(output_dir=str(tmp_path), compile_layers_ahead_of_time=True, compile_layers_dynamic="auto")
    with pytest.raises(ValueError, match="compile_cache_dir='none' turns off: set a folder"):
        VLMGRPOConfig(output_dir=str(tmp_path), compile_layers_ahead_of_time=True, compile_cache_dir="none")
    on = [VLMGRPOConfig(output_dir=str(tmp_path), **setting) for setting in ({}, {"compile_layers_unit": "modules"})]
    assert all(ahead_of_time(config) for config in on)
    assert not ahead_of_time(on[0], sharded=True)  # FSDP2's per-layer classes cannot be saved
    assert not ahead_of_time(VLMGRPOConfig(output_dir=str(tmp_path), compile_layers_dynamic="auto"))


def test_a_loaded_function_its_guards_refuse_gets_a_function_of_its_own(tmp_path, fresh_dynamo):
    # eval() is not in the file's key but in the saved guards: the function traced in training mode (dropout on)
    # refuses the call, and one compiled for it serves it.
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    x = torch.randn(2, 3, 4, requires_grad=True)
    AheadOfTime(str(tmp_path)).call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    later = AheadOfTime(str(tmp_path))
    layer.eval()
    out = later.call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    assert (later.loaded, later.compiled) == (1, 1) and len(os.listdir(tmp_path)) == 2
    assert torch.allclose(out, layer(x))  # no dropout: the eval-mode forward, not the loaded training one
    layer.train()  # two functions now: each is asked first, and the training one serves this call
    later.call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    assert later.compiled == 1


def test_a_file_compiled_from_other_sources_is_said_and_compiled_again(tmp_path, caplog, monkeypatch, fresh_dynamo):
    from vlm_grpo.engine import aot_layers

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
    x = torch.randn(2, 3, 4, requires_grad=True)
    AheadOfTime(str(tmp_path)).call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    # As if torch.nn's sources had changed since (an upgrade in place, an edited file): what the file inlined is stale.
    monkeypatch.setattr(aot_layers, "_CURRENT_SOURCE", dict.fromkeys(["torch.nn.modules.linear"], "changed"))
    later = AheadOfTime(str(tmp_path))
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        out = later.call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    assert "compiled from another version of torch.nn.modules.linear" in caplog.text
    assert (later.loaded, later.compiled) == (0, 1) and torch.allclose(out, layer(x))


def test_a_file_inlining_a_module_edited_while_this_process_runs_is_compiled_again(
    tmp_path, caplog, monkeypatch, fresh_dynamo
):
    # A new process (or a later run) would read the edited file; this process runs what it imported before the edit.
    from vlm_grpo.engine import aot_layers

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
    x = torch.randn(2, 3, 4, requires_grad=True)
    AheadOfTime(str(tmp_path)).call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    monkeypatch.setattr(aot_layers, "_CURRENT_SOURCE", {})
    monkeypatch.setattr(aot_layers, "_STARTED", 0.0)  # every file now reads as changed after this process started
    later = AheadOfTime(str(tmp_path))
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        later.call(layer, (x,), {}, None, lambda *_: None, lambda: pytest.fail("fell back"))
    assert "compiled from another version of" in caplog.text and (later.loaded, later.compiled) == (0, 1)


def test_a_function_patched_into_a_layers_module_changes_the_key(monkeypatch):
    from vlm_grpo.engine.aot_keys import _module_globals

    x = torch.randn(2, 3, 4)
    key = signature_key(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), (x,), {})
    # Dynamo's own globals (its compiled frames, named anew in every process) are not a patch.
    monkeypatch.setattr(torch.nn.modules.activation, "__compiled_fn_1_0a1b", lambda t: t, raising=False)
    _module_globals.cache_clear()
    try:
        assert signature_key(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), (x,), {}) == key
        monkeypatch.setattr(torch.nn.modules.activation, "silu", lambda t: t * 0, raising=False)  # a library's patch
        _module_globals.cache_clear()
        assert signature_key(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), (x,), {}) != key
    finally:
        _module_globals.cache_clear()


def test_the_key_is_the_same_in_another_process():
    # A later run is another process: a key holding anything per process (a code object's repr has its address) would
    # never find the file the first run saved.
    code = ("import torch\nfrom vlm_grpo.engine.aot_keys import signature_key\n"
            "print(signature_key(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), (torch.zeros(2, 3, 4),), "
            "{'mask': None}))")  # fmt: skip
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
    here = signature_key(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), (torch.zeros(2, 3, 4),), {"mask": None}
    )
    assert other == here


@pytest.mark.trains
def test_qwen3_5s_mlps_compiled_apart_are_compiled_ahead_of_time_once_for_every_row_count_and_free_their_tensors(
    tiny_dir, tmp_path, fresh_dynamo
):
    # Parts are compiled ahead of time too. Qwen3.5 keeps its layers' parts (its prompt-cache scoring gives every
    # attention a cache, and those calls run as written); its MLPs are called with a row per prompt, then a row per
    # completion: one function serves both. (A function compiled on views guarded their base: a fresh MLP input has
    # none, and every call was refused.)
    trainer, inputs, eager_loss, eager = _eager_baseline(tiny_dir, tmp_path, "qwen3_5")
    compiled = CompiledLayers()
    compiled.ahead = ahead = AheadOfTime(str(tmp_path / "aot"))
    assert compiled.attach(trainer.model) > 0
    for _ in range(2):
        _assert_the_eager_loss_and_gradients(*_loss_and_grads(trainer, inputs), eager_loss, eager)
    # The decoder's MLP and the vision blocks' MLP, one function each; no other graph, none in the second step.
    assert (ahead.compiled, ahead.loaded) == (2, 0) and counters["stats"]["unique_graphs"] == 2
    # Checkpointing stops a recomputation by raising through a layer's call. Re-raised from a helper, the error held
    # the helper's frame and the frame the error: every frame's tensors stayed alive until Python's cycle collector
    # ran (on an H200, Qwen3.5-4B's training peak was 62 GiB, not 16). Nothing of a step is left to that collector.
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        _loss_and_grads(trainer, inputs)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not left, f"{len(left)} tensors of the step are held by reference cycles"
    compiled.detach()

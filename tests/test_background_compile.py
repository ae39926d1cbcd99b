"""`vlm_grpo.engine.background_compile`: a layer found in no cache is compiled ahead of time by another process while
it trains as written (the eager results), and the step after that process is done loads it; a process that would
compile something else (a patch made at run time) or a layer that cannot be written is said, and the layer compiles in
the training process.

PYTEST_DONT_REWRITE: a compile process imports this module as written, and the key of a layer whose class is defined
here hashes the code of the functions it holds: pytest's assertion rewriting (of this module and of the test helpers
it would import at its top) would give every such layer another key there."""

from __future__ import annotations

import functools
import glob
import os
import sys
import tempfile

import pytest
import torch
from torch._dynamo.utils import counters

from vlm_grpo.engine import aot_keys, background_compile
from vlm_grpo.engine.aot_layers import AheadOfTime, no_marks


@pytest.mark.trains
def test_by_default_another_process_compiles_the_layer_while_it_trains_as_written_the_next_step_and_run_load_it(
    tiny_dir, tmp_path, fresh_dynamo
):
    # Here, not at the top: this module's globals are in the key of the layers defined here (the module docstring).
    from test_compiled_layers import _assert_the_eager_loss_and_gradients, _loss_and_grads
    from test_shared_prefix import _batch, _trainer

    # The defaults: ahead of time, in the background (`engine.background_compile`). GLM-4V: its modeling file wraps
    # no function in a hub kernel, so torch can save its layers with every transformers release (5.25 wraps most
    # decoders' `apply_rotary_pos_emb`: `test_a_layer_torch_cannot_save_...`).
    trainer = _trainer(tiny_dir, tmp_path, "glm4v", lora="both", gc=True, compile_layers=True,
                       compile_cache_dir=str(tmp_path / "cache"))  # fmt: skip
    inputs = _batch(trainer, "glm4v")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.compiled_layers.detach()
    eager_loss, eager = _loss_and_grads(trainer, inputs)
    trainer._compile_layers()
    ahead = trainer.compiled_layers.ahead
    assert ahead is not None and ahead.background is not None
    counters.clear()
    loss, grads = _loss_and_grads(trainer, inputs)  # as written while the other processes compile
    # The decoder layer and the vision blocks' MLP (compiled by parts): a process each, nothing compiled here.
    assert len(ahead.background.pending()) == 2 and (ahead.compiled, ahead.loaded) == (0, 0)
    assert counters["stats"]["unique_graphs"] == 0
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for name, grad in eager.items():  # exactly the eager gradients
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    ahead.background.wait(timeout=900)
    trainer.callback_handler.on_step_begin(trainer.args, trainer.state, trainer.control)  # the next step's start
    assert not ahead.background.pending() and (ahead.compiled, ahead.loaded) == (0, 0)  # loaded at their next call
    counters.clear()
    _assert_the_eager_loss_and_gradients(*_loss_and_grads(trainer, inputs), eager_loss, eager)
    # Loaded, and their guards took the calls: no trace, nothing compiled here.
    assert (ahead.compiled, ahead.loaded) == (0, 2) and counters["stats"]["unique_graphs"] == 0, ahead.events
    folder = trainer.compile_cache.layers_folder()
    assert len(glob.glob(os.path.join(folder, "*.aot"))) == 2 and not glob.glob(os.path.join(folder, "*.log"))
    # A later trainer (a new AheadOfTime, Dynamo's caches empty): both are loaded from the cache, nothing is traced.
    trainer.compiled_layers.detach()
    trainer.compiled_layers.ahead = None
    torch._dynamo.reset()
    counters.clear()
    trainer._compile_layers()
    later = trainer.compiled_layers.ahead
    assert later is not ahead
    _assert_the_eager_loss_and_gradients(*_loss_and_grads(trainer, inputs), eager_loss, eager)
    assert (later.compiled, later.loaded) == (0, 2) and not later.background.pending()
    assert counters["stats"]["unique_graphs"] == 0
    trainer.compiled_layers.detach()


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class _UsesAGlobal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _double(self.linear(x))


def test_a_layer_patched_at_run_time_is_compiled_here_not_by_a_process_without_the_patch(
    tmp_path, monkeypatch, caplog, fresh_dynamo
):
    # A new process imports this module unpatched: it computes another key, so it must not compile (its function
    # would double where this process triples).
    monkeypatch.setattr(sys.modules[__name__], "_double", lambda x: 3 * x)
    monkeypatch.setattr(aot_keys, "_module_globals", aot_keys._module_globals.__wrapped__)  # not cached
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    expected = layer(x)
    ahead = AheadOfTime(str(tmp_path), background=True)
    out = ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # as written while the other process runs
    ahead.background.wait(timeout=600)
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        assert ahead.adopt() == 0
    assert "did not compile a layer" in caplog.text and "another signature key" in caplog.text
    out = ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    assert (ahead.compiled, ahead.loaded) == (1, 0) and not list(tmp_path.glob("*.job"))
    torch.testing.assert_close(out, expected)


def _wrapped(function):
    class Func(torch.nn.Module):  # a class defined in a function, as `kernels`' hub-kernel wrapper of a function
        def forward(self, *args):
            return function(*args)

        def __reduce__(self):  # picklable by its maker, as `kernels`' (a job file for the other process holds it)
            return _wrapped, (function,)

    return Func()


class _CallsAWrappedFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        # Not a submodule: as transformers 5.25's attention holds its wrapped `apply_rotary_pos_emb` (`kernels`).
        self.__dict__["_kernel_funcs"] = {"sin": _wrapped(torch.sin)}

    def forward(self, x):
        return self._kernel_funcs["sin"](self.linear(x))


def test_a_layer_torch_cannot_save_falls_back_to_torch_compile_said_once_not_compiled_again_here(
    tmp_path, caplog, fresh_dynamo
):
    # torch refuses to save a function whose guards hold an object of a class defined in a function. The other
    # process fails so; compiling here would fail the same way, so torch.compile takes the signature at once.
    layer, x = _CallsAWrappedFunction(), torch.randn(2, 3, 4, requires_grad=True)
    ahead, fallbacks = AheadOfTime(str(tmp_path), background=True), []

    def fallback():
        fallbacks.append(1)
        return layer(x)

    expected = layer(x)
    counters.clear()
    torch.testing.assert_close(ahead.call(layer, (x,), {}, None, no_marks, fallback), expected, rtol=0, atol=0)
    ahead.background.wait(timeout=600)
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        assert ahead.adopt() == 0
        for _ in range(2):
            torch.testing.assert_close(ahead.call(layer, (x,), {}, None, no_marks, fallback), expected)
    assert caplog.text.count("compiled by torch.compile instead") == 1 and "local scope" in caplog.text
    assert len(ahead.events) == 1 and counters["stats"]["calls_captured"] == 0  # not traced here in vain
    assert len(fallbacks) == 2 and (ahead.compiled, ahead.loaded) == (0, 0), (fallbacks, ahead.compiled, ahead.loaded)
    assert not list(tmp_path.glob("*.aot")), list(tmp_path.iterdir())


def test_a_function_compiled_under_autocast_is_loaded_at_its_next_call_and_takes_calls_under_autocast(
    tmp_path, fresh_dynamo
):
    # The training step runs under autocast (bf16 on a GPU). torch rebuilds a loaded function's guards on the dispatch
    # keys of the context it is loaded in: loaded at the step's start, outside autocast, it refused every call inside
    # (an H200 run compiled every layer in the trainer at its second step).
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    ahead = AheadOfTime(str(tmp_path), background=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    ahead.background.wait(timeout=600)
    assert ahead.adopt() == 1  # outside autocast, as a step's start is
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    assert (ahead.compiled, ahead.loaded) == (0, 1) and ahead.events == []
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_layer_that_cannot_be_written_for_another_process_is_said_and_compiled_here(tmp_path, caplog, fresh_dynamo):
    class Local(torch.nn.Module):  # a class made at run time: another process cannot import it
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    layer, x, calls = Local(), torch.randn(2, 3, 4, requires_grad=True), []
    layer.forward = own = functools.partial(Local.forward, layer)  # as this package's training forward is set

    def fallback():  # torch.compile: an ahead-of-time function of such a class cannot be saved either
        calls.append(1)
        return layer(x)

    ahead = AheadOfTime(str(tmp_path), background=True)
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        out = ahead.call(layer, (x,), {}, None, no_marks, fallback)
    assert "could not be written for another process" in caplog.text and "compiles in this process" in caplog.text
    assert calls == [1] and not ahead.background.pending()
    torch.testing.assert_close(out, layer.linear(x).relu())
    assert vars(layer)["forward"] is own  # set aside while the layer was written, then put back


def test_a_process_that_cannot_start_is_said_and_leaves_no_copy_of_the_layer(tmp_path, caplog, fresh_dynamo):
    (tmp_path / "file").write_text("")  # where the function's folder would be: it cannot be made
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    ahead = AheadOfTime(str(tmp_path / "file" / "aot"), background=True)
    jobs = set(glob.glob(os.path.join(tempfile.gettempdir(), "vlm-grpo-layer-*.job")))
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        out = ahead.call(layer, (x,), {}, None, no_marks, lambda: layer(x))  # compiled here, its file not saved
    assert "another process could not be started" in caplog.text and not ahead.background.pending()
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "vlm-grpo-layer-*.job"))) == jobs
    torch.testing.assert_close(out, layer(x))


def test_global_state_a_process_cannot_take_is_said_and_compiled_here(tmp_path, monkeypatch, caplog, fresh_dynamo):
    # The process would compile a function whose guards refuse every call of this process: it refuses instead.
    monkeypatch.setattr(background_compile, "_DEVICE_TYPES", ("cuda",))  # the CPU's autocast is not sent
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    ahead = AheadOfTime(str(tmp_path), background=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
        ahead.background.wait()
        with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
            assert ahead.adopt() == 0
        assert "cannot take the trainer's guarded global state (autocast_state differ)" in caplog.text
        out = ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
        assert (ahead.compiled, ahead.loaded) == (1, 0)
        torch.testing.assert_close(out, layer(x))


def test_a_process_past_its_deadline_is_stopped_and_its_layer_compiled_here(tmp_path, monkeypatch, caplog):
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    ahead = AheadOfTime(str(tmp_path), background=True)
    ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    (running,) = ahead.background._running.values()
    monkeypatch.setattr(background_compile, "DEADLINE_S", 0.0)
    with caplog.at_level("WARNING", logger="vlm_grpo.engine.aot_layers"):
        assert ahead.adopt() == 0
    assert "still compiling after 0 s, stopped" in caplog.text and running.process.returncode is not None
    assert not os.path.exists(running.job_file)


def test_processes_still_running_are_stopped_with_their_files(tmp_path):
    layer, x = _UsesAGlobal(), torch.randn(2, 3, 4, requires_grad=True)
    ahead = AheadOfTime(str(tmp_path), background=True)
    ahead.call(layer, (x,), {}, None, no_marks, lambda: pytest.fail("not torch.compile"))
    (running,) = ahead.background._running.values()
    ahead.background.stop()  # what this process's exit does
    assert running.process.returncode is not None and not ahead.background.pending()
    assert not os.path.exists(running.job_file) and not os.path.exists(running.log_file)

"""The decode step compiled per decoder layer: the plain path's tokens, one graph for every layer, nothing between the
layers that a recorded CUDA graph would refuse, and the whole-model compile where a layer reads the cache by index."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch._dynamo.utils
from test_fast_generation import ROWS, _batch, _fast, _plain, _trainer
from torch.overrides import TorchFunctionMode

from vlm_grpo.engine.decode_attention import decode_attention
from vlm_grpo.engine.regional_decode import DecodeCompiler, decoder_layers, layer_view, unsupported_reason
from vlm_grpo.models.loader import FastVisionModel

# Families whose every decoder layer writes the cache through `cache.update(..., layer_idx)`: M-RoPE (Qwen2.5-VL),
# deepstack features added in early layers (Qwen3-VL), sliding and full layers taking turns (Gemma 3), another text
# model behind a connector (Idefics3).
REGIONAL = ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"]


def _compiled(trainer):
    trainer.fast_generator.compile = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    return trainer.fast_generator


@pytest.mark.parametrize("family", REGIONAL)
def test_per_layer_compile_gives_the_plain_paths_tokens_with_one_graph_per_layer_kind(tiny_dir, tmp_path, family):
    trainer = _trainer(tiny_dir, tmp_path, family, generations=2)
    generator = _compiled(trainer)
    batch = _batch(trainer, [ROWS[0]], 2)
    assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert generator._compiler.fallback_reason is None  # compiled per layer, not as one graph
    layers = decoder_layers(trainer.model)
    assert len(layers) >= 2 and all("forward" not in vars(layer) for layer in layers)  # the class forward is back
    if family != "gemma3":
        # Every layer runs the class's compiled forward: one graph serves them all, and the code between the layers is
        # not compiled. (Gemma 3's sliding layers keep their length in a Python int that the graph guards on, so on
        # CPU, where every token runs Python, each token recompiles as the whole-model compile does; on a GPU only the
        # two calls before the recording run Python.)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_the_whole_model_compile_when_asked_gives_the_same_tokens(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    generator = _compiled(trainer)
    generator.regional_compile = False
    batch = _batch(trainer, [ROWS[2]], 2)
    assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert generator._compiler.fallback_reason == "regional_compile is off"


def test_a_hybrid_models_linear_attention_layers_compile_per_layer_too(tiny_dir, tmp_path):
    # Qwen3.5's linear-attention layers read `cache.layers[self.layer_idx]` and its conv and recurrent states: with
    # their own view and index 0, one graph serves the linear-attention layers and one the full-attention ones.
    trainer = _trainer(tiny_dir, tmp_path, "qwen3_5", generations=2)
    generator = _compiled(trainer)
    batch = _batch(trainer, [ROWS[0]], 2)
    assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert generator._compiler.fallback_reason is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert [m.layer_idx for m in trainer.model.modules() if hasattr(m, "layer_idx")] == list(range(len(
        decoder_layers(trainer.model))))  # fmt: skip


def test_a_model_whose_layers_differ_compiles_whole_with_the_reason_logged(tiny_dir, tmp_path, caplog):
    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    generator = _compiled(trainer)
    layers = decoder_layers(trainer.model)
    layers[1].__class__ = type("OtherLayer", (type(layers[1]),), {})
    batch = _batch(trainer, [ROWS[0]], 2)
    with caplog.at_level("INFO", logger="vlm_grpo.engine.regional_decode"):
        assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert generator._compiler.fallback_reason == "the decoder layers are not all of one class"
    assert any("one whole graph" in r.getMessage() for r in caplog.records)


def test_a_layers_view_of_the_cache_writes_that_layer_at_index_zero():
    from transformers import Qwen2Config, StaticCache

    config = Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
                         vocab_size=32, intermediate_size=32)  # fmt: skip
    cache, ref = StaticCache(config=config, max_cache_len=8), StaticCache(config=config, max_cache_len=8)
    keys = torch.randn(1, 1, 4, 8)
    out = layer_view(cache, 2).update(keys, keys + 1, 0)  # the layer asks for index 0 of its view: layer 2 is written
    expected = ref.update(keys, keys + 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert torch.equal(cache.layers[2].values, ref.layers[2].values) and cache.layers[2].keys[:, :, :4].any()
    assert not any(layer.keys is not None and layer.keys.any() for layer in cache.layers[:2])
    assert len(cache.layers) == 3  # the cache itself keeps its layers


def test_reasons_name_what_keeps_the_whole_model_compile(tiny_dir):
    from transformers import AutoModelForImageTextToText, StaticCache

    model = AutoModelForImageTextToText.from_pretrained(tiny_dir("qwen2_5_vl"))
    cache = StaticCache(config=model.config, max_cache_len=8)
    assert unsupported_reason(model, cache) is None
    assert "one layer per decoder layer" in unsupported_reason(model, object())
    cache.offloading = True
    assert "offloads" in unsupported_reason(model, cache)
    layer = decoder_layers(model)[-1]  # any layer, not only the first
    layer.forward = layer.forward
    assert "already replaced" in unsupported_reason(model, StaticCache(config=model.config, max_cache_len=8))
    compiler = DecodeCompiler()
    assert compiler.call(model, cache, "reduce-overhead") is not None  # the whole model, compiled lazily
    assert "reduce-overhead" in compiler.fallback_reason
    del layer.forward
    # A family not checked for uses of `layer_idx` beyond the cache (Gemma 3n keys shared states by it).
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                        num_hidden_layers=2, vocab_size=32, intermediate_size=32))  # fmt: skip
    assert "family" in unsupported_reason(text, StaticCache(config=text.config, max_cache_len=8))


# What synchronises the host with the device: a CUDA graph refuses it while recording.
SYNCS = {"item", "__bool__", "tolist", "nonzero", "__int__", "__float__", "__index__", "cpu"}


class _Syncs(TorchFunctionMode):
    """Records each tensor operation that would synchronise with the device, with the line that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
            self.calls.append(f"{name} at {caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", REGIONAL)
def test_the_code_between_the_layers_never_waits_on_the_device(tiny_dir, tmp_path, family):
    # On a GPU the step runs uncompiled between the layers and is recorded as one CUDA graph (`engine.decode_graph`):
    # a host synchronisation there would fail the recording. The layers themselves are checked here uncompiled.
    from transformers import StaticCache

    trainer = _trainer(tiny_dir, tmp_path, family, generations=2)
    model = trainer.model
    FastVisionModel.for_inference(model)  # as the fast path decodes: no checkpointing (it drops the cache)
    config = model.config
    cache = StaticCache(config=config, max_cache_len=16)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.zeros(1, 16, dtype=torch.long)
    mask[:, :5] = 1
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask[:, :4], use_cache=True, **{_cache_name(model): cache})
        spy = _Syncs()
        with decode_attention(model), spy:
            model(input_ids=ids[:, :1], attention_mask=mask, position_ids=_positions(model, 4),
                  cache_position=torch.tensor([4]), use_cache=True, logits_to_keep=1, **{_cache_name(model): cache})  # fmt: skip
    assert spy.calls == []


def _cache_name(model):
    from vlm_grpo.compat import cache_kwarg

    return cache_kwarg(model)


def _positions(model, position):
    """The decode positions the fast path passes: 3-D (M-RoPE) for Qwen-VL, else one row."""
    rows = 3 if "qwen" in type(model.config).__name__.lower() else 1
    positions = torch.full((1, 1), position)
    return positions.expand(rows, 1, 1) if rows == 3 else positions


@pytest.mark.slow  # nine compiled decode graphs, ~60 s on 2 cores
def test_more_batch_sizes_than_dynamos_default_limit_all_run_compiled(tiny_dir, tmp_path):
    # A tool rollout's later turns decode as many batch sizes as rows still call tools: past Dynamo's default of 8
    # graphs per function the layers would run uncompiled (slowly, and with no error).
    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    _compiled(trainer)
    sizes = range(1, 10)
    for size in sizes:
        batch = _batch(trainer, [ROWS[0]], size)
        assert _fast(trainer, batch) == _plain(trainer, batch, size)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(sizes)
    assert torch._dynamo.config.recompile_limit == 8  # the limit is raised for the decode step alone


@pytest.mark.parametrize("unit", ["modules", "layers"])
def test_the_compiled_training_forwards_do_not_make_each_layer_compile_again(tiny_dir, tmp_path, unit):
    # On a GPU the layers' attention and MLP carry compiled training forwards (`engine.compiled_layers`): one object
    # per module, which Dynamo guarded by identity, so each of the 3B's 36 layers compiled its own decode graph
    # (measured: 39 graphs, 35 s of a fresh first step's generation). They are set aside while the step decodes; with
    # unit="layers" the decoder layers' own forwards are those, and the decode still compiles per layer, not whole.
    from vlm_grpo.engine.compiled_layers import CompiledLayers, is_training_forward

    trainer = _trainer(tiny_dir, tmp_path, generations=2, lora_b=0.05)
    compiled = CompiledLayers()
    assert compiled.attach(trainer.model, unit=unit) > 0
    generator = _compiled(trainer)
    batch = _batch(trainer, [ROWS[0]], 2)
    assert _fast(trainer, batch) == _plain(trainer, batch, 2)
    assert generator._compiler.fallback_reason is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert all(is_training_forward(vars(module).get("forward")) for module in compiled.modules)  # back for training
    layers = set(decoder_layers(trainer.model))
    assert (unit == "layers") == any(module in layers for module in compiled.modules)


def test_a_step_that_raises_leaves_the_layers_as_they_were(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, generations=2)
    model = trainer.model
    layers = decoder_layers(model)
    indices = [m.layer_idx for m in model.modules() if hasattr(m, "layer_idx")]
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(RuntimeError, match="inside the step"), DecodeCompiler().layers_compiled(model, cache):
        assert all("forward" in vars(layer) for layer in layers)
        assert {m.layer_idx for m in model.modules() if hasattr(m, "layer_idx")} == {0}
        raise RuntimeError("inside the step")
    assert all("forward" not in vars(layer) for layer in layers)
    assert [m.layer_idx for m in model.modules() if hasattr(m, "layer_idx")] == indices


def test_the_cache_is_replaced_by_the_view_however_a_layer_receives_it():
    from vlm_grpo.engine.regional_decode import _layer_forward

    cache, view, hidden = object(), object(), torch.zeros(1)
    seen = _layer_forward(lambda layer, *args, **kwargs: (args, kwargs), "layer", cache, view, hidden, cache,
                          past_key_values=cache, cache=cache, other=1)  # fmt: skip
    assert seen == ((hidden, view), {"past_key_values": view, "cache": view, "other": 1})

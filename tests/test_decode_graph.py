"""`vlm_grpo.engine.decode_graph` on CPU: what a recording depends on. (Recording and replaying need CUDA:
`tests/gpu/test_gpu_decode_graph.py` checks the tokens, one recording reused across generations, and a new one after a
weight moved.)"""

from __future__ import annotations

import torch

from vlm_grpo.engine.decode_graph import DecodeGraphs, _cache_signature
from vlm_grpo.models.loader import FastVisionModel


def test_recordings_are_dropped_when_a_weight_moves_or_a_module_is_replaced_and_only_then(tiny_dir):
    from transformers import StaticCache

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    cache = StaticCache(config=model.config, max_cache_len=16)
    graphs = DecodeGraphs()

    def begin_keeps_recordings() -> bool:
        graphs.recordings[(id(cache), "a recording")] = None  # what `step` would have recorded, read after `begin`
        graphs.begin(model, cache)
        return (id(cache), "a recording") in graphs.recordings

    graphs.begin(model, cache)
    assert begin_keeps_recordings()  # nothing moved: recordings replay across generations
    with torch.no_grad():
        for param in model.parameters():  # weights changed in place (an optimizer step, a merge) stay put
            param.add_(1.0)
    assert begin_keeps_recordings()
    o_proj = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.o_proj"))
    o_proj.base_layer.weight.data = o_proj.base_layer.weight.data.clone()  # re-allocated (sharded, offloaded)
    assert not begin_keeps_recordings()
    assert begin_keeps_recordings()
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
    attention.o_proj = torch.nn.Linear(o_proj.in_features, o_proj.out_features)  # a module swapped in
    assert not begin_keeps_recordings()
    # Each cache's recordings depend on its own tensors only: the training and evaluation batches take turns.
    other = StaticCache(config=model.config, max_cache_len=32)
    graphs.begin(model, other)
    graphs.recordings[(id(other), "shape")] = None
    assert begin_keeps_recordings() and (id(other), "shape") in graphs.recordings
    text = model.config.get_text_config(decoder=True)
    states = torch.zeros(1, text.num_key_value_heads, 1, text.hidden_size // text.num_attention_heads)
    other.update(states, states, 0)  # the cache allocates its tensors on first use: they are read by a recording
    assert len(_cache_signature(other)) == 2
    graphs.begin(model, other)
    assert (id(other), "shape") not in graphs.recordings and (id(cache), "a recording") in graphs.recordings


def test_forgetting_an_object_drops_the_recordings_that_read_it():
    # A cache, buffers or sampler its owner drops takes its recordings with it (their memory is freed now, and a new
    # object given the same id never replays them).
    graphs = DecodeGraphs()
    cache, buffers, sampler = object(), object(), object()
    graphs.recordings[(id(cache), id(buffers), id(sampler))] = None
    graphs.recordings[(id(cache), id(buffers), None)] = None
    graphs.forget(sampler)
    assert list(graphs.recordings) == [(id(cache), id(buffers), None)]
    graphs.forget(buffers)
    assert not graphs.recordings

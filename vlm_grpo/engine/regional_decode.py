"""The decode step compiled one decoder layer at a time: one graph per layer class serves every layer of the model.

Why: compiling the whole one-token forward unrolls every decoder layer into one graph, so Dynamo traces and Inductor
compiles each of them. On an H100 (Qwen2.5-VL-3B, 36 layers) that was ~57 s of the fresh first step's 80 s, and a
second process still paid ~20 s of tracing with Inductor's cache warm. Compiled per layer, the first layer's call
compiles and the other 35 reuse its graph (their weights and cache are the graph's inputs, not constants), as
regional compilation in torch's and diffusers' recipes does. The code between the layers (embedding, rotary
positions, the mask, the final norm and `lm_head`) runs as written: with recorded CUDA graphs
(`engine.decode_graph`) a replay launches its kernels without Python, so only their few kernels remain.

What stands in the way in transformers' layers is the cache: a layer reads and writes its part as
`cache.update(key, value, self.layer_idx, ...)` (linear-attention layers also as `cache.layers[self.layer_idx]`),
and Dynamo specialises on the index, so every layer would compile again. For the call each layer is handed its own
view of the cache (`layer_view`: the cache object with its one layer as `layers[0]`) and its modules' `layer_idx` are
0, so every layer asks for index 0 of its own view; the indices are put back after.

Taken only for the families vlm-grpo lists (their model code reads `layer_idx` for the cache alone, checked on
transformers 5.17 and 5.24), where every decoder layer is one class and the cache keeps one preallocated layer per
decoder layer (static attention layers, sliding or not, and linear-attention states, as Qwen3.5's), with no
offloading and no Unsloth kernels (`unsupported_reason`). The tokens are the whole-model compile's and the eager
forward's up to float rounding (tests: the plain path's tokens on Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3 and
Qwen3.5, one graph over the layers, no host synchronisation between the layers, which a recording would refuse).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..families import core_model, find_family
from ..integrations.unsloth import uses_unsloth
from .compiled_layers import is_training_forward, training_forwards_aside

__all__ = ["DecodeCompiler", "decoder_layers", "layer_view", "unsupported_reason"]

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # graphs of one decoder layer class: (batch size, cache length) pairs


def layer_view(cache: Any, index: int) -> Any:
    """`cache` as decoder layer `index` sees it with its `layer_idx` set to 0: a shallow copy whose only layer is that
    layer's (the tensors and the layer object are the cache's own, so what the layer writes lands in the cache)."""
    view = copy.copy(cache)
    view.layers = [cache.layers[index]]
    return view


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's layers of `model` (PEFT-wrapped or not), in order; empty where there is no `layers` list."""
    base = core_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def unsupported_reason(model: nn.Module, cache: Any) -> str | None:
    """Why the decode step of `model` with `cache` compiles as one whole graph rather than per layer (None: per layer)."""
    layers = decoder_layers(model)
    if not layers:
        return "the text decoder has no `layers` list"
    if len({type(layer) for layer in layers}) != 1:
        return "the decoder layers are not all of one class"
    if find_family(core_model(model)) is None:
        # Checked family by family: only cache calls read `layer_idx` (Gemma 3n, say, keys shared states by it).
        return "the model's family is not one vlm-grpo lists (its layers may read `layer_idx` beyond the cache)"
    if uses_unsloth(model):
        return "Unsloth patches the layers' forwards with its own kernels"
    if any("forward" in vars(layer) and not is_training_forward(vars(layer)["forward"]) for layer in layers):
        return "the decoder layers' forward is already replaced"
    cache_layers = getattr(cache, "layers", None)
    if not isinstance(cache_layers, list) or len(cache_layers) != len(layers):
        return "the cache does not keep one layer per decoder layer"
    if getattr(cache, "offloading", False):
        return "the cache offloads its layers"
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        return "the cache grows its layers as they are first written"
    if not all(isinstance(getattr(m, "layer_idx", 0), int) for layer in layers for m in layer.modules()):
        return "a decoder layer's `layer_idx` is not a number"
    return None


class DecodeCompiler:
    """The compiled forward a decode step calls: per decoder layer where `unsupported_reason` allows, else the whole
    model (the compiled callables are kept, one per layer class or per model and mode)."""

    def __init__(self) -> None:
        self.fallback_reason: str | None = None  # why the last call compiled the whole model (None: per layer)
        self._whole: Callable[..., Any] | None = None
        self._whole_key: tuple[int, str] | None = None
        self._layer_forwards: dict[type, Callable[..., Any]] = {}

    def call(self, model: nn.Module, cache: Any, mode: str, regional: bool = True) -> Callable[..., Any]:
        """`model`'s forward for a decode step on `cache`: its layers compiled (Inductor's kernels, no CUDA graphs of the
        compiler's) when `regional` and `mode` is "default", else the whole forward compiled with `mode`."""
        reason = "regional_compile is off" if not regional else None
        if reason is None and mode != "default":
            reason = f"torch.compile's {mode} CUDA graphs would record each layer's graph apart"
        reason = reason or unsupported_reason(model, cache)
        if regional and reason is not None and reason != self.fallback_reason:
            logger.info("The decode step compiles as one whole graph (slower to compile): %s.", reason)
        self.fallback_reason = reason
        if reason is None:
            return functools.partial(self._layered_call, model, cache)
        if self._whole is None or self._whole_key != (id(model), mode):
            self._whole, self._whole_key = torch.compile(model.__call__, mode=mode, dynamic=False), (id(model), mode)
        return self._whole

    def _layered_call(self, model: nn.Module, cache: Any, /, **inputs: Any) -> Any:
        # Each (batch, cache length) compiles the layer again: a tool rollout's later turns decode as many batch sizes
        # as rows still calling tools. Dynamo's default of 8 graphs per function would then run the layers uncompiled;
        # per layer a compile costs seconds, so more are allowed here.
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with self.layers_compiled(model, cache), torch._dynamo.config.patch(recompile_limit=limit):
            return model(**inputs)

    @contextlib.contextmanager
    def layers_compiled(self, model: nn.Module, cache: Any) -> Iterator[None]:
        """Inside the block each decoder layer runs its class's compiled forward on its own `layer_view` of `cache`,
        with its modules' `layer_idx` at 0 (both undone after: the class's forward and the indices are back)."""
        layers = decoder_layers(model)
        kind = type(layers[0])
        compiled = self._layer_forwards.get(kind)
        if compiled is None:
            compiled = self._layer_forwards[kind] = torch.compile(kind.forward, dynamic=False)
        indexed = [(m, m.layer_idx) for layer in layers for m in layer.modules() if hasattr(m, "layer_idx")]
        views = [layer_view(cache, index) for index in range(len(layers))]  # before anything on the model changes
        # The compiled training forwards (a whole layer's too, `compile_layers_unit="layers"`) set aside first, so
        # that what the block puts on the layers is undone before they come back.
        with training_forwards_aside(layers):
            try:
                for layer, view in zip(layers, views, strict=True):
                    layer.forward = functools.partial(_layer_forward, compiled, layer, cache, view)
                for module, _ in indexed:
                    module.layer_idx = 0  # every layer asks for the only layer of its view
                yield
            finally:
                for module, index in indexed:
                    module.layer_idx = index
                for layer in layers:
                    forward = vars(layer).get("forward")
                    if isinstance(forward, functools.partial) and forward.func is _layer_forward:
                        del vars(layer)["forward"]  # ours only


def _layer_forward(compiled: Callable[..., Any], layer: nn.Module, cache: Any, view: Any, /, *args: Any,
                   **kwargs: Any) -> Any:  # fmt: skip
    """One decoder layer's forward through the compiled class forward, the cache replaced by the layer's own view
    wherever it is passed (by keyword, under whichever name, or by position)."""
    args = tuple(view if a is cache else a for a in args)
    kwargs = {k: view if v is cache else v for k, v in kwargs.items()}
    if not torch.is_grad_enabled():
        # An input hook that marks the embeddings as requiring grad (PEFT's, for checkpointing with frozen inputs)
        # does so under no_grad too: without this the first layer would compile a graph of its own.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    return compiled(layer, *args, **kwargs)

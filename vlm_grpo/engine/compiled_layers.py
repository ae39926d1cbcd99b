"""The training forward and backward of each layer's attention and MLP compiled, instead of run op by op from Python.

Why: a GRPO step's training phase is host-bound. On an H100 (3B, 448², 2 x 8 rows, LoRA r=16 on every linear layer,
gradient checkpointing) its forward and backward launched ~19 000 kernels that kept the GPU busy for 0.26 s of a
0.91 s phase: the rest was Python (PEFT's LoRA forward per layer, transformers' modules, the checkpoint's recompute)
and one small kernel after another (`benchmarks/step_profile.py`). Compiled, a layer's attention or MLP is one call
whose kernels are fused (the LoRA products, rotary, activation and adds), forward and backward.

What is compiled: the `self_attn` and `mlp` children of every checkpointable layer (transformers'
`GradientCheckpointingLayer`: decoder layers and vision blocks; Qwen-VL's vision attention is left alone, it reads
its window lengths on the host). Each child keeps its own module: its forward is `torch.compile` of its class's
forward, called with the module as an argument, so one graph per class serves every layer (the weights are graph
inputs, not constants) and compilation does not grow with depth. Checkpointing stays transformers': the checkpoint
wraps the layer around the compiled children, and the recomputation in backward calls them again. With
`compile_layers_unit="layers"` (the default) a layer with both children (and no linear attention) is compiled whole
instead, the same way: one graph call a layer rather than two, its norms and residual adds fused in (`UNITS`); a model
with recurrent layers keeps its layers' parts (its prompt-cache scoring passes every layer a cache, and such calls run
as written), and so does a layer found with module hooks inside at a training call (transformers' output capture:
traced, they break the graph). Its compiled code is a copy of the class forward's, so the decode step's graphs of that
forward (`engine.regional_decode`) do not count against the training graphs' recompile limit. By default either unit is
compiled ahead of time, kept for later runs (`engine.aot_layers`), by another process while it runs as written.

When: only with gradients on and outside any other compilation, i.e. the policy's forward in the loss and its
recomputation, and not for a call given a KV cache (Qwen3.5's prompt-cache scoring: Dynamo would compile one graph
per layer, as the module finds its cache layer by `layer_idx`). Generation (compiled its own way), reference and
old-policy log-probs (no gradients; they also run while the base weights come back from a merge, each layer waiting on
a module hook that compiled code would skip: the trainer joins that restore before any forward with gradients) run the
modules as written. Module hooks registered inside these modules after their first training step do not run in the
training forward (Dynamo does not guard on hooks): `compile_layers=False` for such hooks. Not with reentrant
checkpointing: its first forward runs without gradients (eager), its recomputation compiled (a dropout: another mask).

Linear-attention layers (Qwen3.5's gated delta net, `linear_attn`) are compiled too when asked (`compile_linear_attention`,
off by default: compiled in the trainer's process), their convolution and chunked scan left eager (called through
`torch.compiler.disable`: graph breaks). Compiled, the scan's loop over 64-token chunks unrolls into one graph per
length, and Inductor's convolution backward guards on the length: either recompiles at every new length (measured).

`compiled_layers` decides whether a model can take it (`unsupported_reason`); the results are the eager ones up to
float rounding of fused kernels (tests: loss and every gradient against the eager modules).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..families import core_model
from ..integrations.unsloth import uses_unsloth
from ..models.modes import checkpointing_mode
from .aot_keys import LEFT_EAGER_MARK
from .aot_layers import AheadOfTime, ahead_of_time, in_background, no_marks, traced
from .prefix_cache import serves
from .quantized_generation import is_quantized_linear

__all__ = ["COMPILED_CHILDREN", "SHAPE_MODES", "UNITS", "CompiledLayers", "detach_all", "is_training_forward",
           "shape_mode_error", "training_forwards_aside", "unit_error", "unsupported_reason"]  # fmt: skip

logger = logging.getLogger(__name__)

# The children of a checkpointable layer that are compiled (the attention and the MLP of transformers' layers).
COMPILED_CHILDREN = ("self_attn", "mlp")
# The linear-attention child (Qwen3.5), compiled on request, and the functions its forward calls by name that stay
# eager: the short causal convolution and the chunked gated delta rule.
LINEAR_ATTENTION_CHILD = "linear_attn"
LEFT_EAGER = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


def _checkpointable_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the layers of `model` are left uncompiled (None: they can be compiled)."""
    if not _checkpointable_layers(model):
        return "the model has no transformers GradientCheckpointingLayer layers"
    if uses_unsloth(model):
        return "Unsloth patches the layers' forwards with its own kernels"
    if any(is_quantized_linear(m) for m in model.modules()):
        return "4-bit / 8-bit (bitsandbytes) layers do not compile"
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return "modules of the model are already compiled"
    quantizer = getattr(core_model(model), "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return f"{type(quantizer).__name__} weights cannot be compiled"
    if checkpointing_mode(model) == "reentrant":
        return "reentrant checkpointing runs the first forward without gradients (eager), the recomputation compiled"
    return None


# How the compiled layers treat sizes (`VLMGRPOConfig.compile_layers_dynamic`): torch.compile's `dynamic` for each.
# "length" (the default): the rows' length (the sizes of every input that equal the hidden states' next-to-last size)
# and their count (the first dimension, where 2 or more) marked dynamic from the first call, the rest static: one
# compile, the graph "auto" reaches at its first new length.
# Sizes that meet a weight's (the hidden size, the heads) are specialised by their guards all the same, and so are
# sizes of 0 or 1. "auto" (torch's default): a static graph first and, at the first new length, one with the sizes
# that changed as symbols: a second compile mid-run (an H100 soak: two more graphs between steps 4 and 100). On fresh
# H200s the 3B's first training phase (where these compile) took 17.2 s with "length", 18.6 s with "auto"; on the CPU
# three lengths compiled in 16.1 s against 20.9 s (14.6 + 6.3). "all" (`dynamic=True`): every size a symbol from the
# first compile (on an H200 the 3B's took 78 s).
SHAPE_MODES = {"auto": None, "length": None, "all": True}


# What one compiled training forward covers (`VLMGRPOConfig.compile_layers_unit`). "layers" (the default): each layer
# with both (decoder layers, SigLIP vision layers) as one graph, its norms and residual adds fused in (Qwen-VL vision
# blocks, whose attention reads window lengths on the host, models with recurrent layers, and layers with module hooks
# inside keep their parts). "modules": each layer's attention and MLP apart (H200, 3B: 0.84 s of training, not 0.67).
UNITS = ("modules", "layers")


def unit_error(value: Any) -> str:
    """The one line that refuses `value` as `compile_layers_unit`."""
    return f"compile_layers_unit must be one of {', '.join(map(repr, UNITS))}, got {value!r}."


def shape_mode_error(value: Any) -> str:
    """The one line that refuses `value` as `compile_layers_dynamic`."""
    return f"compile_layers_dynamic must be one of {', '.join(map(repr, SHAPE_MODES))}, got {value!r}."


@functools.cache
def _compiled(forward: Any, dynamic: bool | None = None, own_code: bool = False) -> Any:
    # One compiled function per class forward (and `dynamic` setting), shared by every instance. A whole layer's is
    # compiled as a copy with a code object of its own: Dynamo keeps its graphs, and counts them against its recompile
    # limit, per code object, and the decode step compiles a decoder layer's class forward too (`engine.regional_decode`,
    # a graph per batch size, its limit raised to 64): sharing one, the training layer found 8 graphs there and ran
    # uncompiled. (transformers 5.24 also gives every checkpointable layer class the same wrapper code.)
    return torch.compile(_own_code(forward) if own_code else forward, dynamic=dynamic)


def _own_code(function: Any) -> Any:
    """`function` with a copy of its code object (same globals, defaults, closure and attributes)."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)  # fmt: skip
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    copy.__dict__.update(function.__dict__)
    return copy


def _mark_length_dynamic(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark, on every tensor argument (and those in tuples: rotary cos / sin), each dimension whose size is the rows'
    length (the hidden states' next-to-last size: [rows, length, hidden], or [patches, hidden] for vision blocks), and
    the first dimension where it is the row count (2 or more: Qwen3.5's prompt-cache scoring calls the MLP with one row
    per prompt, then one per completion; a static count compiled it twice, 2.3 s of a fresh H200 first step)."""
    tensors = [a for v in (*args, *kwargs.values()) for a in (v if isinstance(v, (tuple, list)) else (v,))]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    hidden = kwargs.get("hidden_states", tensors[0] if tensors else None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[-2] < 2:
        return
    length = hidden.shape[-2]
    rows = hidden.shape[0] if hidden.dim() == 3 and hidden.shape[0] > 1 else None
    for t in tensors:
        for dim, size in enumerate(t.shape):
            if size == length or (dim == 0 and size == rows):
                torch._dynamo.maybe_mark_dynamic(t, dim)


class CompiledLayers(TrainerCallback):
    """Compiled attention / MLP forwards on a model's layers (`attach`), removable (`detach`); as a transformers
    callback it takes at each step's start what compile processes finished (`AheadOfTime.adopt`; each loads at its
    next call)."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self._said: set[str] = set()
        self._unit = "modules"
        self.ahead: AheadOfTime | None = None  # ahead-of-time compiled training forwards (`engine.aot_layers`)

    def attach_as_configured(self, model: nn.Module, config: Any, blocked_by: str | None = None,
                             layers_folder: str | None = None, sharded: bool = False) -> None:  # fmt: skip
        """`attach` as the trainer's config asks (`VLMGRPOConfig.compile_layers`, `compile_linear_attention`,
        `compile_layers_dynamic`, `compile_layers_unit`; a plain GRPOConfig gets their defaults): None is on for a
        model on a GPU (where the training phase is host-bound), False off. `blocked_by` names a trainer setting that
        rules it out (torch_compile, sharded layers); that, or what `unsupported_reason` finds, leaves the layers
        uncompiled, said once when they were asked for by name. `layers_folder`: where `compile_layers_ahead_of_time`
        keeps its functions (`engine.aot_layers`; None: the compile cache is off, so is that; not by default
        when `sharded` by FSDP2, whose per-layer classes cannot be saved). Idempotent;
        compiled forwards another trainer left on the model are removed first (this config decides)."""
        setting = getattr(config, "compile_layers", None)
        if not self.modules:
            detach_all(model)
        if setting is False or (setting is None and next(model.parameters()).device.type != "cuda"):
            return
        reason = blocked_by or unsupported_reason(model)
        if reason is not None:
            if setting and reason not in self._said:  # asked for by name: say why not, once
                self._said.add(reason)
                logger.warning("compile_layers=True, but the layers are left uncompiled: %s.", reason)
            return
        before = len(self.modules)
        if ahead_of_time(config, sharded) and layers_folder is not None:
            background = in_background(config)
            if self.ahead is None or (self.ahead.folder, bool(self.ahead.background)) != (layers_folder, background):
                self.ahead = AheadOfTime(layers_folder, background)
        else:
            self.ahead = None
        count = self.attach(model, getattr(config, "compile_linear_attention", True),
                            getattr(config, "compile_layers_dynamic", "length"),
                            getattr(config, "compile_layers_unit", "layers"))  # fmt: skip
        if count != before:
            logger.info("Compiled the training forward of %d layers / attention / MLP modules (the first step compiles "
                        "them).", count)  # fmt: skip

    def attach(self, model: nn.Module, linear_attention: bool = False, shapes: str = "length",
               unit: str = "layers") -> int:  # fmt: skip
        """Give the `COMPILED_CHILDREN` of every checkpointable layer of `model` (and with `linear_attention` its
        `LINEAR_ATTENTION_CHILD`) their compiled training forward, or with `unit="layers"` each layer that has both
        children and no linear attention its own (`UNITS`); returns how many modules have one. Idempotent; a module
        whose forward someone else replaced is left alone."""
        if unit not in UNITS:
            raise ValueError(unit_error(unit))
        if self.modules and unit != self._unit:  # compiled forwards of two units would nest: this call's unit decides
            self.detach()
        self._unit = unit
        if unit == "layers" and serves(model):
            # The prompt-cache scorer hands a hybrid model's attention layers their cache in every training forward,
            # and a call given a cache runs as written: whole, those layers would lose their MLP's compiled forward too.
            if "hybrid" not in self._said:
                self._said.add("hybrid")
                logger.info("compile_layers_unit='layers': a model with recurrent layers keeps 'modules' (its prompt-"
                            "cache scoring passes a cache to every layer).")  # fmt: skip
            unit = "modules"
        names = (*COMPILED_CHILDREN, LINEAR_ATTENTION_CHILD) if linear_attention else COMPILED_CHILDREN
        for layer in _checkpointable_layers(model):
            if unit == "layers" and _whole(layer) and "forward" not in layer.__dict__:
                layer.forward = _TrainingForward(layer, shapes, whole=True, ahead=self.ahead)
                self.modules.append(layer)
                continue
            if is_training_forward(whole := layer.__dict__.get("forward")):  # whole already: this call's store
                whole.ahead = self.ahead
                continue
            for name in names:
                child = getattr(layer, name, None)
                # Not the linear attention ahead of time: its eager convolution and scan break the graph.
                ahead = None if name == LINEAR_ATTENTION_CHILD else self.ahead
                if is_training_forward(part := getattr(child, "__dict__", {}).get("forward")):
                    part.ahead = ahead  # this call's store
                elif isinstance(child, nn.Module) and "forward" not in child.__dict__:
                    if name == LINEAR_ATTENTION_CHILD:
                        _leave_eager(child)
                    child.forward = _TrainingForward(child, shapes, ahead=ahead)
                    self.modules.append(child)
        return len(self.modules)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ahead is not None:
            self.ahead.adopt()

    def detach(self) -> None:
        """Put the modules' own forwards back."""
        for child in self.modules:
            _remove(child)
        self.modules = []


def _whole(layer: nn.Module) -> bool:
    """Whether `layer` compiles whole under `unit="layers"`: both `COMPILED_CHILDREN` are modules and it has no
    linear attention (Qwen3.5's gated delta net layers keep their children's forwards: a whole layer would unroll
    the chunked scan's loop)."""
    children = (getattr(layer, name, None) for name in COMPILED_CHILDREN)
    return all(isinstance(c, nn.Module) for c in children) and getattr(layer, LINEAR_ATTENTION_CHILD, None) is None


def is_training_forward(forward: Any) -> bool:
    """Whether `forward` (a module's instance `forward`) is a compiled training forward of this module's."""
    return isinstance(forward, _TrainingForward)


def _leave_eager(module: nn.Module) -> None:
    """Have the forward of `module` call the `LEFT_EAGER` functions of its transformers module through
    `torch.compiler.disable`: compiled code breaks the graph there and runs them as written (outside compilation the
    wrapper calls them unchanged). Set once per transformers module, so for every model of that family."""
    source = sys.modules[type(module).__module__]
    for name in LEFT_EAGER:
        function = getattr(source, name, None)
        if callable(function) and getattr(function, LEFT_EAGER_MARK, None) is None:
            eager = torch.compiler.disable(function)
            setattr(eager, LEFT_EAGER_MARK, function)
            setattr(source, name, eager)


def detach_all(model: nn.Module) -> int:
    """Remove every compiled training forward from `model`, whoever attached it (a trainer that used the model
    before); returns how many were removed."""
    removed = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), _TrainingForward)]
    for module in removed:
        _remove(module)
    return len(removed)


@contextlib.contextmanager
def training_forwards_aside(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside the block the compiled training forwards of `modules` and their children are set aside (put back
    after). Without gradients they run the class's forward anyway; code compiled around them (the per-layer decode
    step, `engine.regional_decode`) would otherwise guard on each one's identity and compile once per layer."""
    aside = [(m, m.__dict__.pop("forward")) for root in modules for m in root.modules()
             if isinstance(m.__dict__.get("forward"), _TrainingForward)]  # fmt: skip
    try:
        yield
    finally:
        for module, forward in aside:
            module.__dict__["forward"] = forward


def _remove(module: nn.Module) -> None:
    forward = module.__dict__.get("forward")
    if isinstance(forward, _TrainingForward):  # ours only: another forward stays
        del module.__dict__["forward"]
        for part in forward.parts:  # a whole layer split by hooks inside it: its parts' forwards too
            _remove(part)


class _TrainingForward:
    """A module's forward: its class's compiled forward when gradients are on (and nothing else is compiling), its
    own forward otherwise."""

    def __init__(self, module: nn.Module, shapes: str = "length", whole: bool = False,
                 ahead: AheadOfTime | None = None) -> None:  # fmt: skip
        if shapes not in SHAPE_MODES:
            raise ValueError(shape_mode_error(shapes))
        self.module, self.shapes, self.whole = module, shapes, whole  # whole: a layer (`compile_layers_unit`)
        self.ahead = ahead  # functions compiled ahead of time (`engine.aot_layers`)
        self.parts: list[nn.Module] = []  # a whole layer's children given forwards of their own (`_split`)
        self._inside = [m for m in module.modules() if m is not module] if whole else []

    def __getstate__(self) -> dict[str, Any]:
        # Without its functions (they cannot be pickled): Dynamo pickles this with an ahead-of-time function's guards.
        return {**vars(self), "ahead": None}

    @property
    def forward(self) -> Any:
        # Read at each call, not at attach: FSDP2 gives a sharded layer a subclass of its own, and transformers 5.24's
        # checkpointing wrapper checkpoints only as the class's outermost forward (a stored one would not checkpoint).
        return type(self.module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.forward
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _given_cache(kwargs):
            if self.whole and (self.parts or _hooked(self._inside)):
                return self._split(forward)(self.module, *args, **kwargs)
            if self.ahead is not None:  # no marks on the call's tensors: a loaded function's guards refuse them
                mark = _mark_length_dynamic if self.shapes == "length" else no_marks  # module-level: picklable
                return self.ahead.call(self.module, args, kwargs, SHAPE_MODES[self.shapes], mark,
                                       lambda: self._compiled_call(forward, args, kwargs))  # fmt: skip
            return self._compiled_call(forward, args, kwargs)
        return forward(self.module, *args, **kwargs)

    def _compiled_call(self, forward: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.shapes == "length":
            _mark_length_dynamic(args, kwargs)
        with traced():
            return _compiled(forward, SHAPE_MODES[self.shapes], self.whole)(self.module, *args, **kwargs)

    def _split(self, forward: Any) -> Any:
        """Give this whole layer's children their own compiled forwards (once) and return the layer's eager forward.
        Hooks on modules inside a layer (transformers' output capture, installed at the first forward that asks for
        hidden states or router logits) are inside its graph when compiled whole, and Dynamo breaks the graph at the
        `ContextVar` they read: the layer ran mostly uncompiled. Compiled by parts, the hooks on the attention and the
        MLP run outside their graphs, as with `unit="modules"` (hooks deeper inside still break those)."""
        if not self.parts:
            for name in COMPILED_CHILDREN:
                child = getattr(self.module, name)
                if "forward" not in child.__dict__:
                    child.forward = _TrainingForward(child, self.shapes, ahead=self.ahead)
                    self.parts.append(child)
            if type(self.module).__name__ not in _SPLIT_SAID:
                _SPLIT_SAID.add(type(self.module).__name__)
                logger.info("compile_layers_unit='layers': %s has module hooks inside (e.g. transformers' output "
                            "capture), so its attention and MLP are compiled apart.", type(self.module).__name__)  # fmt: skip
        return forward


_SPLIT_SAID: set[str] = set()  # layer classes whose split was logged


def _hooked(modules: list[nn.Module]) -> bool:
    """Whether any of `modules` has a forward or backward hook (or pre-hook)."""
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)  # fmt: skip


# The names under which transformers' attention takes a KV cache, across versions (Qwen3.5's linear attention:
# `cache_params` in transformers 5.17, the GPU machine's, `cache` in 5.24).
_CACHE_KWARGS = ("past_key_values", "cache", "cache_params", "past_key_value", "layer_past")


def _given_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a KV cache is passed. A module reaches its cache layer by `self.layer_idx`, on which Dynamo specialises:
    one graph per layer and cache class (the prompt-cache scorer's training forward, `engine.prefix_cache`), past
    Dynamo's 8 per function the rest ran uncompiled anyway. Such calls run as written."""
    return any(kwargs.get(name) is not None for name in _CACHE_KWARGS)

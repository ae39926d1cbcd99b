"""Layers' training forwards compiled ahead of time and kept on disk, so a later process skips Dynamo's trace.

Why: with the compile cache warm (`engine.compile_cache`), a process's first step still traces every compiled frame
with Dynamo before Inductor's code comes from the cache: on an H200 the 7B's cached first step took 11.1 s, 3.0 s of
it in Dynamo's traces (issue #48 asks <= 10 s). `torch.compile(fullgraph=True).aot_compile(...)` traces and compiles a
function as torch.compile does (the training forward and backward: the same cost on a fresh machine, 24.8 s against
24.4 s on the CPU probe, `benchmarks/results/cpu-aot-probe/`), and its result can be saved and loaded by a later
process in a fraction of a second, with no trace.

What: `VLMGRPOConfig.compile_layers_ahead_of_time` (on by default where it can be, `ahead_of_time`; its H200 numbers
of the twelfth session were torch.compile's: torch 2.11 needs `enable_aot_compile`, now set in `compile_entry`) gives
each compiled training forward (a whole layer's, or with `compile_layers_unit="modules"` and for models with recurrent
layers an attention's or MLP's; `engine.compiled_layers`) one of these per call signature, in the compile cache's folder
(`<compile cache dir>/<key>-layers/`, keyed by versions, GPU, architecture and settings). The function compiled is a
module-level trampoline to the layer's class forward (transformers' class forwards are wrapped, so they cannot be
pickled by reference); one serves every layer of a class and every length. A signature found nowhere is compiled by
another process while the layer runs as written (`compile_layers_in_background`, `engine.background_compile`).

Never a silent wrong result: a loaded function checks the guards that could be saved (sizes, dtypes, grad mode and
autocast, module attributes such as training mode, LoRA scaling and dropout, the attention implementation), but torch
drops the guards on global names and on object identities: the file's name hashes what those would have checked
(`engine.aot_keys`), and a file whose inlined sources changed since (an edited or upgraded-in-place library: torch
records them) is compiled again. A signature whose trace breaks the graph (fullgraph), a file that does not load, or 8
functions for one signature fall back to torch.compile for that signature, said once.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from .aot_keys import signature_key
from .background_compile import BackgroundCompiles, aliases
from .kernel_wrappers import name_wrappers

__all__ = ["AheadOfTime", "ahead_of_time", "compile_entry", "in_background", "no_marks", "traced"]

logger = logging.getLogger(__name__)

_MAX_ENTRIES = 8  # per signature, as Dynamo's recompile limit per frame
_GUARD_FAILED = "GuardManager check failed"  # how a loaded function refuses a call
# How torch refuses to save a function whose guards hold an object of a class defined in a function. transformers
# 5.25's hub-kernel wrappers are such objects: `engine.kernel_wrappers` names their classes; any other such class
# falls back to torch.compile, said.
_UNSAVEABLE = "since it's defined in local scope"
_EVENTS = 20  # `AheadOfTime.events` kept
# What non-reentrant checkpointing raises out of a layer's recomputation once it has every tensor backward needs
# (private to torch; `()` matches nothing where it is gone).
_RECOMPUTED = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def _layer_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What is compiled: the module's class forward (transformers wraps class forwards, so they cannot be pickled by
    reference; this can). FSDP2's generated per-layer classes cannot be pickled at all: such runs use what they
    compile but cannot save it (said), or fall back to torch.compile."""
    return type(module).forward(module, *args, **kwargs)


_CURRENT_SOURCE: dict[str, str | None] = {}


def _process_start() -> float:
    """When this process started (Linux: /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, `starttime`, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


_STARTED = _process_start()


def _source(name: str) -> str | None:
    """The source of module `name` as this process runs it, as far as can be told: its file, unless the file changed
    after this process started (then this process may run older code than the file holds: None)."""
    module = sys.modules.get(name)
    try:
        if module is None or os.path.getmtime(inspect.getsourcefile(module) or "") > _STARTED:
            return None
        return inspect.getsource(module)
    except (OSError, TypeError):
        return None


def _stale(entry: Any) -> str | None:
    """The first Python module whose source differs from what `entry` was compiled from (an editable install, a
    patched file, a file edited while this process runs), or None. Its inlined code would run as it was: torch records
    each module's source with it."""
    for inlined in entry.source_info().inlined_sources:
        if inlined.module not in _CURRENT_SOURCE:
            _CURRENT_SOURCE[inlined.module] = _source(inlined.module)
        if _CURRENT_SOURCE[inlined.module] != inlined.content:
            return inlined.module
    return None


def no_marks(args: tuple, kwargs: dict[str, Any]) -> None:
    """No sizes marked dynamic (`compile_layers_dynamic='all'`: torch.compile's dynamic=True marks them all)."""


def ahead_of_time(config: Any, sharded: bool = False) -> bool:
    """Whether `VLMGRPOConfig.compile_layers_ahead_of_time` is on: None (the default) where it can be, i.e. with
    dynamic lengths and not `sharded` by FSDP2 (whose generated per-layer classes cannot be saved; True there says so
    when saving), where the compile cache is on (the caller's `layers_folder`)."""
    setting = getattr(config, "compile_layers_ahead_of_time", None)
    if setting is not None:
        return bool(setting)
    return not sharded and getattr(config, "compile_layers_dynamic", "length") != "auto"


def in_background(config: Any) -> bool:
    """Whether `VLMGRPOConfig.compile_layers_in_background` applies: not with `full_determinism` or deterministic
    algorithms on (said), where two runs with one seed must match: the step at which a compiled function takes over
    from the layer as written depends on timing, and their kernels round apart."""
    if not getattr(config, "compile_layers_in_background", True):
        return False
    if getattr(config, "full_determinism", False) or torch.are_deterministic_algorithms_enabled():
        logger.info("compile_layers_in_background: off with deterministic algorithms (when a compiled layer takes "
                    "over would depend on timing); the first step compiles the layers.")  # fmt: skip
        return False
    return True


def traced() -> Any:
    """The Dynamo settings a layer's training forward is traced under (torch.compile's or ahead of time). Where
    transformers checkpoints inside the class forward (5.24 on), the checkpoint is traced as a higher-order op, under
    which Dynamo refuses a side effect (a graph break) unless told not to replay it in backward's recomputation.
    transformers 5.25's hub-kernel wrappers (`kernels`, its dependency since) set and reset a context variable in
    every attention forward: the state after the forward is the state before it, so replaying would change nothing."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def compile_entry(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic: bool | None,
                  mark: Callable[[tuple, dict], None]) -> Any:  # fmt: skip
    """`module`'s training forward compiled ahead of time for this call: `mark` marks the dynamic sizes of views of
    the inputs (`dynamic`: torch.compile's). Raises what the compile raises (a graph break under fullgraph)."""
    # Marks go on aliases, not on tensors other layers' calls share (a loaded function refuses a tensor marked dynamic).
    example_args, example_kwargs = aliases(args), {k: aliases(v) for k, v in kwargs.items()}
    mark(example_args, example_kwargs)
    name_wrappers(module)  # else torch cannot save the guards on their classes
    with warnings.catch_warnings():  # Dynamo's guards read `.grad` of the non-leaf inputs: a UserWarning
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        # `aot_compile` exists only with this on: torch 2.13's default, not 2.11's (the GPU machine's), where every
        # layer fell back to torch.compile with an AttributeError.
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(_layer_forward, fullgraph=True, dynamic=dynamic)
        with traced():
            return compiled.aot_compile(((module, *example_args), example_kwargs))


class AheadOfTime:
    """The ahead-of-time compiled training forwards of whole layers, loaded from and saved to `folder`."""

    def __init__(self, folder: str, background: bool = False) -> None:
        self.folder = folder
        self._entries: dict[str, list[Any]] = {}  # key -> functions (loaded or compiled), tried in order
        self._given_up: set[str] = set()  # keys served by torch.compile instead
        self.loaded = self.compiled = 0
        # With `background`, a signature found nowhere is compiled by another process (`engine.background_compile`).
        self.background = BackgroundCompiles() if background else None
        self._pending: set[str] = set()  # keys another process is compiling
        self._here: set[str] = set()  # keys this process compiles (their other process failed or could not start)
        # What did not go as planned and why (a refused load, a process that failed, a compile given up, a function
        # that refused a call): the warnings and notes, for a benchmark's record (`benchmarks/grpo_step.py`); the
        # first `_EVENTS`.
        self.events: list[str] = []
        self._served: set[int] = set()  # functions (by id; `_entries` keeps them) that have served a call

    def _note(self, event: str) -> None:
        if len(self.events) < _EVENTS:
            self.events.append(event)

    def _warn(self, message: str) -> None:
        """Said in the log and kept in `events`."""
        self._note(message)
        logger.warning("%s", message)

    def call(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic: bool | None,
             mark: Callable[[tuple, dict], None], fallback: Callable[[], Any]) -> Any:  # fmt: skip
        """`module`'s training forward on `args` / `kwargs`: through a function loaded or compiled for their
        signature, else `fallback()` (torch.compile). `mark` marks the example inputs' dynamic sizes before a compile
        (`dynamic`: torch.compile's)."""
        key = signature_key(module, args, kwargs)
        if key in self._given_up:
            return fallback()
        entries, refused = self._entries.get(key), ""
        if entries is None:
            if key in self._pending:  # another process is compiling it: the layer's own forward until `adopt`
                return _layer_forward(module, *args, **kwargs)
            entries = self._load(key)
            if not entries and self._start(key, module, args, kwargs, dynamic, mark):
                return _layer_forward(module, *args, **kwargs)
            self._entries[key] = entries
        for entry in entries:
            # With several, each is asked first: a refused call would have it build the failure's verbose report.
            if len(entries) > 1 and not entry.guard_check(module, *args, **kwargs):
                continue
            try:
                result = entry(module, *args, **kwargs)
            except Exception as error:  # re-raised unless its first call failed: `_first_failure`
                if isinstance(error, RuntimeError) and str(error).startswith(_GUARD_FAILED):  # its guards refuse it
                    refused = " ".join(str(error).split())[len(_GUARD_FAILED) :][:400]
                    continue
                if (failure := self._first_failure(entry, error)) is None:
                    raise  # bare: see `_first_failure`
            else:
                self._served.add(id(entry))
                return result
            return self._give_up(key, failure, fallback)
        if entries:  # every function this signature has refused the call: another is compiled (said in the record)
            self._note(f"{type(module).__name__}: {len(entries)} function(s) refused a call{refused}")
        if len(entries) >= _MAX_ENTRIES:
            return self._give_up(key, f"{_MAX_ENTRIES} compiled functions for one signature", fallback)
        try:
            entry = compile_entry(module, args, kwargs, dynamic, mark)
        except Exception as error:  # noqa: BLE001 (a graph break under fullgraph, an unsupported call: torch.compile)
            return self._give_up(key, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", fallback)
        entries.append(entry)
        self.compiled += 1
        self._save(entry, os.path.join(self.folder, f"{key}-{len(entries) - 1}.aot"))
        try:
            result = entry(module, *args, **kwargs)
        except Exception as error:  # re-raised unless its first call failed: `_first_failure`
            if (failure := self._first_failure(entry, error)) is None:
                raise  # bare: see `_first_failure`
        else:
            self._served.add(id(entry))
            return result
        return self._give_up(key, failure, fallback)

    def _first_failure(self, entry: Any, error: Exception) -> str | None:
        """Why `entry` gives up to torch.compile after its call raised `error`: it failed its first call (a torch
        version's bug in loading or running it). None: `error` is the step's (a function that has served a call,
        memory running out, or checkpointing's signal that a recomputation has what it needs, which passes through
        every layer's call in backward), and the caller re-raises it with a bare `raise`. Never from a helper holding
        it: the error's traceback would hold that helper's frame, and the frame the error, a reference cycle keeping
        every frame's tensors (a layer's inputs and activations) alive until Python's cycle collector ran; on an H200,
        Qwen3.5-4B's training peak went from 16 to 62 GiB."""
        if id(entry) in self._served or isinstance(error, (torch.OutOfMemoryError, _RECOMPUTED)):
            return None
        first_line = (str(error).splitlines() or [""])[0][:200]
        return f"its first call raised {type(error).__name__}: {first_line}"

    def _start(self, key: str, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic: bool | None,
               mark: Callable[[tuple, dict], None]) -> bool:  # fmt: skip
        if self.background is None or key in self._here:
            return False
        path = os.path.join(self.folder, f"{key}-0.aot")
        why_not = self.background.start(key, path, module, args, kwargs, dynamic, mark)
        if why_not is not None:
            self._here.add(key)
            self._warn(f"compile_layers_in_background: {why_not}; it compiles in this process.")
            return False
        self._pending.add(key)
        logger.info("compile_layers_in_background: %s's training forward compiles in another process; it runs as "
                    "written until then.", type(module).__name__)  # fmt: skip
        return True

    def adopt(self) -> int:
        """Take what other processes finished compiling (call between steps: a checkpoint's recomputation must run what
        its forward ran); returns how many signatures now have a function to load. It loads at the signature's next
        call, in that call's context: torch rebuilds a loaded function's guards on the tensors' dispatch keys of the
        context it is loaded in, so a function loaded outside the training step's autocast refused every call under
        it. A failed process is said, and its signature compiles in this process at its next call."""
        if self.background is None:
            return 0
        ready = 0
        for key, failure in self.background.finished():
            self._pending.discard(key)
            self._here.add(key)  # its next call loads what the process saved, or compiles here: no second process
            if failure is None:
                ready += 1
                continue
            if _UNSAVEABLE in failure:  # compiling here would fail the same way: torch.compile serves it
                self._give_up(key, f"the other process: {failure}", lambda: None)
                continue
            self._warn(
                f"compile_layers_in_background: the other process did not compile a layer ({failure}); it "
                "compiles in this process."
            )
        return ready

    def _load(self, key: str) -> list[Any]:
        entries = []
        for index in range(_MAX_ENTRIES):
            path = os.path.join(self.folder, f"{key}-{index}.aot")
            if not os.path.isfile(path):
                break
            try:
                with open(path, "rb") as f:
                    entry = torch.compiler.load_compiled_function(f)
                changed = _stale(entry)
            except Exception as error:  # noqa: BLE001 (a stale or torn file: compiling again is the fallback)
                self._warn(
                    f"Compiled layer in {path} could not be loaded ({type(error).__name__}: {str(error)[:300]}); "
                    "compiling again."
                )
                break
            if changed is not None:
                self._warn(f"Compiled layer in {path} was compiled from another version of {changed}; compiling again.")
                break
            entries.append(entry)
        self.loaded += len(entries)
        return entries

    def _save(self, entry: Any, path: str) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            entry.save_compiled_function(path)  # written through a temporary file: a reader never sees half of it
        except Exception as error:  # noqa: BLE001 (unpicklable or a full disk: the next run compiles again)
            self._warn(
                f"Could not save a compiled layer to {path} ({type(error).__name__}: {str(error)[:300]}); the "
                "next run compiles it again."
            )

    def _give_up(self, key: str, reason: str, fallback: Callable[[], Any]) -> Any:
        self._given_up.add(key)
        self._warn(
            f"compile_layers_ahead_of_time: a layer's training forward is compiled by torch.compile instead ({reason})."
        )
        return fallback()

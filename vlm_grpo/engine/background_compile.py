"""A layer's (or its attention's or MLP's) ahead-of-time compile run in another process while it trains as written,
so a fresh machine's first step does not wait for it.

Why: on a fresh H200 the 7B's first step took 35.2 s, 19.4 s of it training, most of that compiling the decoder
layer's training forward and backward (`benchmarks/results/h200-cold-start-7b-aot/`; issue #48 asks <= 30 s). The
layer's own forward gives the eager results without that wait, and the compile needs only the layer and one call's
inputs, which another process can have.

How: at a signature's first training call (`engine.aot_layers`), the layer or part (weights, LoRA, training settings;
not the training forward this package gave it) and the call's inputs (detached, `requires_grad` kept) are written to a
file, and `python -m vlm_grpo.engine.aot_worker FILE` compiles the same function with the same dynamic marks, grad and
autocast state and Dynamo / Inductor / functorch settings, and saves it where `AheadOfTime` looks for it. Until then the
layer runs its own forward. At the next step's start (`AheadOfTime.adopt`: between steps, so a checkpoint's
recomputation always runs the code its forward ran) the trainer takes what finished, and loads each function at its
signature's next call, in that call's context (autocast's dispatch keys go into a loaded function's guards).

Never a silent wrong result: the process computes the signature's key (`aot_layers.signature_key`: class, code,
structure, the globals its modules hold, attention registry, the call's signature) on what it loaded and refuses to
compile when it differs from the trainer's (a patch the trainer's process made at run time that a new process does not
have); a failure, a refusal or a layer that cannot be written (e.g. a class made at run time) is said once and the
layer compiles in the training process, as without this.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["DEADLINE_S", "WORKER", "BackgroundCompiles", "aliases", "apply_state"]

logger = logging.getLogger(__name__)

_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_DEVICE_TYPES = ("cpu", "cuda")
# Global state Dynamo's guards check besides grad mode, autocast, dtype and determinism (its `GLOBAL_STATE` guard).
_REDUCTIONS = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
WORKER = "vlm_grpo.engine.aot_worker"  # the module a compile process runs (`python -m`)


def aliases(value: Any) -> Any:
    """`value` with each tensor (in tuples and lists too) replaced by a detached alias (the same storage, its
    `requires_grad` kept). What a compile's example inputs are (`aot_layers.compile_entry`), and what is written for a
    compile process. Not views: a function compiled on a view guards its base, which a call on a tensor that is no view
    (an MLP's input, fresh from its norm) does not have."""
    if isinstance(value, torch.Tensor):
        alias = value.detach()
        return alias.requires_grad_() if value.requires_grad else alias
    if isinstance(value, (tuple, list)):
        return type(value)(aliases(v) for v in value)
    return value


class _ClassForward:
    """What a written layer has for this package's training forward (which holds compiled functions that cannot be
    written): the same instance attribute (Dynamo guards a module's attribute names), the class's forward when
    called."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


@contextlib.contextmanager
def _writable(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block each instance `forward` of `module` and its submodules is a `_ClassForward`."""
    saved = [(m, vars(m)["forward"]) for m in module.modules() if "forward" in vars(m)]
    try:
        for m, _ in saved:
            m.forward = _ClassForward(m)
        yield
    finally:
        for m, forward in saved:
            m.forward = forward


# The fp32 precision settings (torch's newer API; reading the legacy `allow_tf32` after the newer one was set raises),
# the general one first: setting it resets the others.
_PRECISIONS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
               "mkldnn.rnn")  # fmt: skip


def _backend(path: str) -> Any:
    owner = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


def _global_state() -> str | None:
    """What Dynamo's `GLOBAL_STATE` guard checks (grad mode, autocast, determinism, threads, tf32 and reduced-precision
    reductions, default dtype, torch-function modes), as torch serialises it (None: a torch that does not)."""
    try:
        from torch._C._dynamo.guards import GlobalStateGuard

        return GlobalStateGuard().__getstate__()
    except (ImportError, AttributeError):
        return None


def _state() -> dict[str, Any]:
    """What a compile reads besides the layer and its inputs: the global state a compiled function's guards check
    (`_global_state`, also sent whole so the compile process can check it holds the same) and the compilers' settings
    (those torch calls portable)."""
    configs = {}
    for name in _CONFIGS:
        with contextlib.suppress(Exception):  # an older torch without portable settings: the new process's defaults
            configs[name] = sys.modules[name].save_config_portable() if name in sys.modules else None
    precisions = {}
    for path in _PRECISIONS:
        with contextlib.suppress(AttributeError):  # an older torch: the guard check below says what differs
            precisions[path] = _backend(path).fp32_precision
    return {
        "autocast": [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES],
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "threads": torch.get_num_threads(),
        "reductions": {name: getattr(torch.backends.cuda.matmul, name) for name in _REDUCTIONS},
        "precisions": precisions,
        "default_dtype": torch.get_default_dtype(),
        "configs": configs,
        "global_state": _global_state(),
    }


def apply_state(state: dict[str, Any]) -> str | None:
    """In a compile process: the trainer's process's state and settings (`_state`); returns what of the guarded global
    state still differs (None: nothing), so that the process refuses instead of compiling a function whose guards
    refuse every call."""
    import importlib
    import json

    for device_type, enabled, dtype in state["autocast"]:
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(state["autocast_cache"])
    deterministic, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_num_threads(state["threads"])
    for name, value in state["reductions"].items():
        setattr(torch.backends.cuda.matmul, name, value)
    for path, value in state["precisions"].items():
        with contextlib.suppress(AttributeError):
            _backend(path).fp32_precision = value
    torch.set_default_dtype(state["default_dtype"])
    for name, config in state["configs"].items():
        if config is not None:
            importlib.import_module(name).load_config(config)
    mine = _global_state()
    if state["global_state"] is None or mine is None:  # not comparable: a refused call compiles in the trainer
        return None
    theirs, ours = json.loads(state["global_state"]), json.loads(mine)
    differ = sorted(key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key))
    return ", ".join(differ) if differ else None


_PROCESS_BYTES = 2**30  # a CUDA context, the compiler's workspace and benchmarks: about 0.5-1 GiB


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _short_of_gpu_memory(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why another process would take GPU memory the training process may need (a copy of the layer and the inputs,
    and its own CUDA context, against what is free), or None."""
    tensors = [*module.parameters(), *module.buffers(), *_tensors(args), *_tensors(list(kwargs.values()))]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device == device}
        needed = _PROCESS_BYTES + sum(storages.values())  # what is written (whole storages) and read back there
        free = torch.cuda.mem_get_info(device)[0]
        if needed > free / 4:
            return (f"another process would take {needed / 2**30:.1f} GiB of the {free / 2**30:.1f} GiB free on "
                    f"{device}")  # fmt: skip
    return None


DEADLINE_S = 900.0  # a compile process still running after this is stopped, and its layer compiled in the trainer


class _Process:
    def __init__(self, process: subprocess.Popen, job_file: str, log_file: str) -> None:
        self.process, self.job_file, self.log_file = process, job_file, log_file
        self.started = time.monotonic()

    def remove_files(self, log: bool = True) -> None:
        for path in (self.job_file, self.log_file) if log else (self.job_file,):
            with contextlib.suppress(OSError):
                os.remove(path)

    def last_line(self) -> str:
        try:
            with open(self.log_file) as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"


class BackgroundCompiles:
    """The compile processes started by one `AheadOfTime`, by signature key. Those still running when this process
    exits are stopped (each holds a CUDA context and a copy of its layer)."""

    def __init__(self) -> None:
        self._running: dict[str, _Process] = {}
        atexit.register(_stop_all, weakref.ref(self))

    def start(self, key: str, path: str, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
              dynamic: bool | None, mark: Callable[[tuple, dict], None]) -> str | None:  # fmt: skip
        """Start compiling `module`'s training forward for this call into `path`; None when started, else why not
        (whatever fails here is a reason, never the training step's error)."""
        job_file, process = None, None
        try:
            short = _short_of_gpu_memory(module, args, kwargs)
            if short is not None:
                return short
            job = {"key": key, "path": path, "dynamic": dynamic, "mark": mark, "state": _state(),
                   "args": aliases(args), "kwargs": {k: aliases(v) for k, v in kwargs.items()}}  # fmt: skip
            handle, job_file = tempfile.mkstemp(prefix="vlm-grpo-layer-", suffix=".job")
            os.close(handle)
            try:
                with _writable(module):
                    torch.save({**job, "module": module}, job_file)
            except Exception as error:  # noqa: BLE001 (a class made at run time, an unpicklable setting)
                return f"the layer could not be written for another process ({type(error).__name__}: {error})"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            log_file = f"{path}.{os.getpid()}.log"  # one per process: ranks with one key do not share it
            # The new process imports what this one does, from where this one does.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            with open(log_file, "w") as log:
                process = subprocess.Popen([sys.executable, "-m", WORKER, job_file], stdout=log,
                                           stderr=subprocess.STDOUT, env=env)  # fmt: skip
        except Exception as error:  # noqa: BLE001 (a full disk, a read-only cache folder, no more processes)
            return f"another process could not be started ({type(error).__name__}: {error})"
        finally:
            if process is None and job_file is not None:  # not started: its copy of the layer goes
                with contextlib.suppress(OSError):
                    os.remove(job_file)
        self._running[key] = _Process(process, job_file, log_file)
        return None

    def pending(self) -> set[str]:
        """The keys whose process has not finished."""
        return {key for key, p in self._running.items() if p.process.poll() is None}

    def finished(self) -> list[tuple[str, str | None]]:
        """`(key, None)` for each process that saved its function since the last call, `(key, why not)` for each that
        failed or ran past `DEADLINE_S` (stopped)."""
        done = []
        for key, p in list(self._running.items()):
            if p.process.poll() is None:
                if time.monotonic() - p.started < DEADLINE_S:
                    continue
                p.process.kill()
                p.process.wait()
                done.append((key, f"still compiling after {DEADLINE_S:.0f} s, stopped"))
            elif p.process.returncode == 0:
                done.append((key, None))
            else:
                done.append((key, f"exit status {p.process.returncode}: {p.last_line()}"))
            del self._running[key]
            p.remove_files(log=done[-1][1] is None)  # a failed process's log stays: it says why
        return done

    def wait(self, timeout: float | None = DEADLINE_S) -> None:
        """Wait for every running process (benchmarks and tests; a trainer never waits)."""
        for p in self._running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.process.wait(timeout)

    def stop(self) -> None:
        """Stop the processes still running and remove their files."""
        for p in self._running.values():
            if p.process.poll() is None:
                p.process.kill()
                p.process.wait()
            p.remove_files()
        self._running.clear()


def _stop_all(ref: weakref.ReferenceType) -> None:
    compiles = ref()
    if compiles is not None:
        compiles.stop()

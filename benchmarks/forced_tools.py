"""Multi-turn tool rollouts for `grpo_step.py --tools N`: every rollout calls `crop` N times, whatever it samples.

A model with random weights never writes a tool call, so the benchmark forces them where TRL reads them: the
tokenizer's `parse_response`, which TRL's tool loop (`GRPOTrainer._tool_call_loop`) asks whether a completion called a
tool. Each completion is read as its sampled text plus one call, `crop` of the image's top-left quarter; TRL's loop
runs the environment's tool, appends the tool message and its image to the sampled ids (it concatenates ids, it does
not re-render the completion, so what is scored is what was sampled) and generates the next turn, up to
`max_tool_calling_iterations` = N. Every trainer runs the same loop; only how each turn is generated and scored
differs. Each turn generates exactly `--completion_length` tokens (min = max new tokens), and the completion budget
fits all turns and the tool messages, so no turn is cut short.
"""

from __future__ import annotations

import statistics
from typing import Any

# Tokens a tool turn adds besides the sampled ones and its image: the tool message's template and text (generous, so
# no turn is dropped). The crop's image is a quarter of the prompt's: (side / 2 / 28)^2 tokens after Qwen-VL's 2x2
# merge of 14-pixel patches (64 at 448^2).
TOOL_TEXT_TOKENS = 128


def tool_settings(args: Any) -> dict[str, Any]:
    """Config overrides for N forced calls: the turn limit, a per-turn length and a budget that holds every turn."""
    if "vllm" in (getattr(args, "worker", None) or ""):  # vLLM's per-turn length and blocked ids are set apart
        raise SystemExit("--tools runs the trainers that generate with transformers or the fast engine, not vLLM")
    turns = args.tools + 1
    tool_tokens = TOOL_TEXT_TOKENS + (args.image_size // 56) ** 2
    return {
        "max_tool_calling_iterations": args.tools,
        "max_completion_length": turns * args.completion_length + args.tools * tool_tokens,
        "generation_kwargs": {"min_new_tokens": args.completion_length, "max_new_tokens": args.completion_length},
    }


def tool_template(processor: Any, model: Any, tool_kwargs: dict[str, Any]) -> None:
    """For plain TRL: the tool template and parser `VLMGRPOTrainer` installs for Qwen2.5-VL, whose own template
    renders no tools (TRL refuses it: "The provided chat template does not support tool calling")."""
    from vlm_grpo.tools.templates import prepare_tool_template

    prepare_tool_template(processor, model, tool_kwargs)


def force_calls(trainer: Any, image_size: int) -> None:
    """Make the trainer's tokenizer read every completion as a `crop` call of the image's top-left quarter, in the
    pixels the model sees (VLMGRPOTrainer's tools take boxes in the image after its pixel budget: the tiny model's
    shrinks a 448² image, where a box in the original's pixels is refused as reaching outside)."""
    from PIL import Image

    tokenizer = trainer._tokenizer
    budget = getattr(trainer, "pixel_budget", None)
    seen = budget.fit(Image.new("RGB", (image_size, image_size))).size if budget is not None else (image_size,) * 2
    half = min(seen) // 2

    def parse_response(ids: list[int], prefix: Any = None, tools: Any = None) -> dict[str, Any]:
        call = {
            "type": "function",
            "function": {"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": half, "y2": half}},
        }
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True), "tool_calls": [call]}

    tokenizer.parse_response = parse_response
    # Plain TRL blocks only the image pad: a random model's sampled video pad then crashes the next turn's prompt
    # (its mm_token_type_ids name a video with no clip). Blocked here as a user would, so TRL's loop runs at all;
    # VLMGRPOTrainer blocks it itself whenever it has tools.
    from vlm_grpo.blocked_tokens import suppress_token

    suppress_token(trainer, getattr(trainer.model.config, "video_token_id", None))


def tool_stats(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """Per-rollout tool calls and failures, the median over the logged steps (TRL's `tools/*` metrics)."""
    calls = [h["tools/call_frequency"] for h in log_history if "tools/call_frequency" in h]
    failures = [h["tools/failure_frequency"] for h in log_history if "tools/failure_frequency" in h]
    return {
        "calls_per_rollout": statistics.median(calls) if calls else 0.0,
        "failure_share": statistics.median(failures) if failures else 0.0,
    }


def markdown(runs: dict[str, list[dict[str, Any]]], args: Any) -> str:
    """The tool columns of the report: turns and tool images per rollout (each call returns one image)."""
    rows = [
        f"| {name} | {1 + s['calls_per_rollout']:.2f} | {s['calls_per_rollout']:.2f} | {s['failure_share']:.2f} |"
        for name, name_runs in runs.items()
        if name_runs and (s := name_runs[0].get("tools"))
    ]
    if not rows:
        return ""
    head = (f"\n{args.tools} forced `crop` calls per rollout, {args.completion_length} tokens per turn\n\n"
            "| trainer | turns per rollout | tool images per rollout | failed calls (share) |\n|---|---|---|---|\n")  # fmt: skip
    return head + "\n".join(rows) + "\n"

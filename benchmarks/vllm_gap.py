"""Where vLLM's sampled log-probs and the trainer's scored log-probs part, token by token (issue #44).

    python benchmarks/vllm_gap.py --model qwen2.5-vl-3b --tokens 128

TRL + vLLM logged a generate-vs-score gap of ~1 nat per token on the Qwen2.5-VL-3B architecture with random weights,
against ~0.03 for TRL's `generate` and for our fast engine. This script takes the possible causes apart on one GPU:
vLLM samples completions (processed log-probs, as TRL asks for them) for a text-only prompt and for a prompt with an
image; transformers then scores the same tokens

- in bf16 (what the trainer does),
- in fp32 (how far bf16 rounding alone moves a random-weight model's log-probs),
- in bf16 with plain 1-D positions instead of Qwen's 3-D (M-RoPE) ones (does vLLM place the image tokens as the
  trainer does?),

and the mean / max |difference| per completion token is printed for each pair. If the text-only gap is small and
the image gap large, the difference is in the vision path (preprocessing, vision tower or positions); if the bf16 vs
fp32 gap is as large as vLLM's, the model (random weights) is the amplifier, not the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-3b", help="a real architecture of benchmarks/real_arch.py")
    p.add_argument("--tokens", type=int, default=128, help="completion tokens per sample (forced)")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--image_size", type=int, default=448)
    p.add_argument("--model_impl", default="auto", help="vLLM's model_impl: auto (vLLM's own) or transformers")
    p.add_argument("--checkpoint_dir", default="/tmp/vlm-grpo-bench")
    p.add_argument("--out", default=None, help="folder for gap.json")
    return p.parse_args(argv)


def _prompts(processor, image_size: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Describe the image in detail ."}]}]
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image ."}]}]
    out = {}
    for name, messages, images in (("text", text_only, None), ("image", with_image, [image])):
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        out[name] = (inputs, images)
    return out


def _score(model, inputs, completions, blocked, one_d_positions=False):
    """Per-token log-probs of `completions` (lists of ids) after the prompt `inputs`, blocked ids out of the softmax."""
    import torch

    device = next(model.parameters()).device
    prompt = inputs["input_ids"][0].tolist()
    scores = []
    for completion in completions:
        ids = torch.tensor([prompt + list(completion)], device=device)
        kwargs = {k: v.to(device) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        if "mm_token_type_ids" in kwargs:
            pad = torch.zeros(1, len(completion), dtype=kwargs["mm_token_type_ids"].dtype, device=device)
            kwargs["mm_token_type_ids"] = torch.cat([kwargs["mm_token_type_ids"], pad], dim=1)
        if one_d_positions:
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=device)[None]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float()
        logits[:, list(blocked)] = float("-inf")
        logps = logits[len(prompt) - 1 : -1].log_softmax(-1)
        scores.append(logps.gather(1, torch.tensor(completion, device=device)[:, None])[:, 0].cpu())
    return scores


def _gap(a, b):
    import torch

    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return {"mean": round(d.mean().item(), 4), "max": round(d.max().item(), 4)}


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from real_arch import build_checkpoint
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams

    checkpoint = build_checkpoint(args.model, os.path.join(args.checkpoint_dir, args.model))
    processor = AutoProcessor.from_pretrained(checkpoint)
    prompts = _prompts(processor, args.image_size)
    image_pad, video_pad = processor.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    blocked = (image_pad, video_pad)
    llm = LLM(model=checkpoint, gpu_memory_utilization=0.3, max_model_len=4096, max_num_seqs=args.samples * 2,
              logprobs_mode="processed_logprobs", seed=0, model_impl=args.model_impl)  # fmt: skip
    hf_config = llm.llm_engine.model_config.hf_config
    text_config = getattr(hf_config, "text_config", hf_config)
    rope = {k: getattr(text_config, k, None) for k in ("rope_parameters", "rope_scaling", "rope_theta")}
    print("vLLM's text config rope:", rope, flush=True)
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=0,
                            bad_words=["<|image_pad|>", "<|video_pad|>"], seed=0)  # fmt: skip
    sampled = {}
    for name, (inputs, images) in prompts.items():
        row = {"prompt_token_ids": inputs["input_ids"][0].tolist()}
        if images:
            row["multi_modal_data"] = {"image": images[0]}
        outs = llm.generate([row] * args.samples, sampling_params=params, use_tqdm=False)
        completions = [list(o.outputs[0].token_ids) for o in outs]
        logps = [torch.tensor([next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]
        sampled[name] = (completions, logps)
        print(f"{name}: prompt {len(row['prompt_token_ids'])} tokens, vLLM prompt ids {len(outs[0].prompt_token_ids)}, "
              f"blocked ids sampled: {sum(t in blocked for c in completions for t in c)}", flush=True)  # fmt: skip
    del llm
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype, device_map={"": 0}).eval()
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        for name, (inputs, _) in prompts.items():
            completions, vllm_logps = sampled[name]
            results.setdefault(name, {})[f"hf_{tag}"] = _score(model, inputs, completions, blocked)
            if dtype == torch.bfloat16 and name == "image":
                results[name]["hf_bf16_1d_positions"] = _score(model, inputs, completions, blocked, True)
            results[name]["vllm"] = vllm_logps
        del model
        gc.collect()
        torch.cuda.empty_cache()
    table = {}
    for name, scores in results.items():
        table[name] = {
            "vllm vs hf bf16": _gap(scores["vllm"], scores["hf_bf16"]),
            "vllm vs hf fp32": _gap(scores["vllm"], scores["hf_fp32"]),
            "hf bf16 vs hf fp32": _gap(scores["hf_bf16"], scores["hf_fp32"]),
        }
        if "hf_bf16_1d_positions" in scores:
            table[name]["vllm vs hf bf16, 1-D positions"] = _gap(scores["vllm"], scores["hf_bf16_1d_positions"])
    print("\n| prompt | pair | mean abs gap (nats/token) | max |\n|---|---|---|---|")
    for name, pairs in table.items():
        for pair, g in pairs.items():
            print(f"| {name} | {pair} | {g['mean']} | {g['max']} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gap.json"), "w") as f:
            json.dump({"args": vars(args), "rope": str(rope), "gaps": table}, f, indent=1)


if __name__ == "__main__":
    main()

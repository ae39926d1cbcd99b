"""The decode step's small kernels, alone: the q/k/v projections as three GEMMs or one, and grouped-query decode
attention through cuDNN / the other SDPA backends / plain matmuls / FlexAttention.

    python benchmarks/decode_kernels.py

Shapes are Qwen2.5-VL-3B's and -7B's language models (bf16), one decode token for 16 and 64 rows, a 512-slot cache.
Each kernel is recorded 50 times into one CUDA graph and replayed, so the times are device times without launch
gaps, as in the recorded decode step. Prints a table (microseconds per call).
"""

from __future__ import annotations

import argparse
import statistics

MODELS = {
    "3b": dict(hidden=2048, heads=16, kv_heads=2, dim=128),
    "7b": dict(hidden=3584, heads=28, kv_heads=4, dim=128),
}


def graph_time_us(fn, repeat: int = 50) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    return statistics.median(times[2:])


def measure(m: dict, rows: int, cache: int) -> tuple[float, float, dict[str, float], float]:
    """(3 GEMMs us, fused GEMM us, {attention variant: us}, FlexAttention's max abs difference) for one shape."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    dtype, device = torch.bfloat16, "cuda"
    h, nq, nkv, d = m["hidden"], m["heads"], m["kv_heads"], m["dim"]
    wq, wk, wv = (torch.randn(n * d, h, device=device, dtype=dtype) * 0.02 for n in (nq, nkv, nkv))
    bq, bk, bv = (torch.randn(n * d, device=device, dtype=dtype) for n in (nq, nkv, nkv))
    w_fused, b_fused = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
    x = torch.randn(rows, 1, h, device=device, dtype=dtype)
    three = graph_time_us(lambda: (F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)))
    one = graph_time_us(lambda: F.linear(x, w_fused, b_fused))

    q = torch.randn(rows, nkv, nq // nkv, d, device=device, dtype=dtype)  # query heads grouped by key/value head
    k = torch.randn(rows, nkv, cache, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    valid = torch.zeros(rows, cache, dtype=torch.bool, device=device)
    valid[:, : cache // 2 + 37] = True
    mask = valid[:, None, None, :]
    attention = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        try:
            attention[backend.name.lower()] = graph_time_us(sdpa)
        except RuntimeError as error:
            attention[backend.name.lower()] = float("nan")
            print(f"{backend.name}: {str(error)[:120]}")

    def matmuls():
        scores = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(dtype)
        return torch.matmul(scores, v)

    attention["matmuls"] = graph_time_us(matmuls)
    attention["matmuls, compiled"] = graph_time_us(torch.compile(matmuls, dynamic=False))
    q_heads = q.reshape(rows, nq, 1, d)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(valid[b, kv_idx], score, -float("inf"))

    flex = torch.compile(flex_attention, dynamic=False)
    attention["flex, GQA"] = graph_time_us(lambda: flex(q_heads, k, v, score_mod=score_mod, enable_gqa=True))
    ref = matmuls().float()
    gap = flex(q_heads, k, v, score_mod=score_mod, enable_gqa=True).reshape(ref.shape).float() - ref
    return three, one, attention, gap.abs().max().item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=int, default=512)
    args = p.parse_args(argv)
    results = [(name, rows, *measure(m, rows, args.cache)) for name, m in MODELS.items() for rows in (16, 64)]
    names = list(results[0][4])
    print("| model | rows | q,k,v: 3 GEMMs | fused | " + " | ".join(f"attention: {n}" for n in names) +
          " | flex max abs diff |")  # fmt: skip
    print("|---" * (5 + len(names)) + "|")
    for name, rows, three, one, attention, gap in results:
        cells = " | ".join(f"{attention[n]:.1f}" for n in names)
        print(f"| {name} | {rows} | {three:.1f} | {one:.1f} | {cells} | {gap:.1e} |")


if __name__ == "__main__":
    main()

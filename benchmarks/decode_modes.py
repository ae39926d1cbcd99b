"""Whole generations, one after another in one process, with the decode step's CUDA graph recorded by hand
(`FastGenerator.cuda_graph="recorded"`) with the sampling inside the recording or on the host
(`FastGenerator.sample_in_graph`), and by torch.compile ("compiler"): seconds per generation and how many recordings
were made, so a re-recording per generation would show. The first setting runs again at the end: the first runs after
compiling are slower on a busy host (Inductor's compile workers).

    python benchmarks/decode_modes.py --model qwen2.5-vl-3b
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main() -> None:
    import torch
    from decode_profile import _batch, _trainer, parse_args
    from real_arch import build_checkpoint

    from vlm_grpo.models.modes import generating

    args = parse_args(["--merge_backup", "host", *sys.argv[1:]])
    checkpoint = build_checkpoint(args.model, os.path.join(args.checkpoint_dir, args.model))
    trainer = _trainer(args, checkpoint, 2 * args.num_generations)
    model = trainer.accelerator.unwrap_model(trainer.model)
    batch = _batch(trainer, args.num_generations)
    generator, pad = trainer.fast_generator, trainer._tokenizer.pad_token_id
    settings = [("recorded", True), ("recorded", False), ("compiler", False), ("recorded", True), ("recorded", False)]
    for mode, inside in settings:
        generator.cuda_graph, generator.sample_in_graph = mode, inside
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with generating(model):
                generator.generate(model, *batch, trainer.generation_config, pad)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        where = ", sampling inside" if inside else ", sampling on the host" if mode == "recorded" else ""
        print(f"{mode}{where}: " + " ".join(f"{t:.3f}" for t in times) + f" s; recordings made {generator._graphs.recorded}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""The decode step recorded as a CUDA graph by hand (`vlm_grpo.engine.decode_graph`) on a GPU: the same tokens as
torch.compile's own CUDA graphs, one recording reused across generations, and a new
recording when a weight moves.

Skipped without CUDA. Run on a GPU machine with:  python -m pytest tests/gpu -q -s
"""

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows():
    rng = np.random.default_rng(0)
    image = [Image.fromarray(rng.integers(0, 256, (32 + 16 * i, 32, 3), dtype=np.uint8)) for i in range(2)]
    return [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]}],
         "images": [image[0]]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which is it?"}]}],
         "images": [image[1]]},
    ]  # fmt: skip


def test_recorded_decode_gives_the_compiler_graphs_tokens(tiny_dir, tmp_path):
    from datasets import Dataset
    from trl.data_utils import prepare_multimodal_messages
    from trl.trainer.grpo_trainer import GRPOTrainer

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer
    from vlm_grpo.rows import prepare_row

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4)
    torch.manual_seed(0)
    for name, param in model.named_parameters():  # a trained-looking adapter: the merge changes the weights
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    rows = _rows()
    config = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        generation_kwargs={"do_sample": False, "min_new_tokens": 12}, report_to="none", max_steps=1,
    )  # fmt: skip
    rewards = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    trainer = VLMGRPOTrainer(model, rewards, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=processor)  # fmt: skip
    model = trainer.model
    prepared = [prepare_row(r) for r in rows for _ in range(4)]
    batch = trainer._tokenize_prompts([prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in prepared])
    generator, pad = trainer.fast_generator, trainer._tokenizer.pad_token_id
    assert generator.compile is not False and next(model.parameters()).is_cuda
    FastVisionModel.for_inference(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    def fast(mode):
        generator.cuda_graph = mode
        return generator.generate(model, *batch, trainer.generation_config, pad)

    torch._dynamo.reset()
    plain = GRPOTrainer._generate_single_turn(trainer, *batch, 4)[0]
    compiler = fast("compiler")
    recorded = [fast("recorded") for _ in range(3)]
    assert all(len(c) >= 12 for c in compiler)  # min_new_tokens: real decoding happened
    assert all(r == compiler for r in recorded)  # the same compiled kernels, replayed
    # (Compiled against eager, tokens are equal on CPU (tests/test_fast_generation.py); on the GPU Inductor's fp32
    # kernels round differently from eager ones and this random tiny model's logits have near-ties.)
    agree = sum(a == b for a, b in zip(recorded[0], plain))
    print(f"recorded rows equal to the plain path's: {agree}/{len(plain)}")
    assert generator.cuda_graph == "recorded" and generator._graphs.recorded == 1  # one recording, reused twice
    # The merge and restore around each generation left the weights as they were, bit for bit.
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())

    # A weight the recording reads whose storage moved (re-allocated, as sharded or offloaded weights are) is noticed:
    # recorded again. (q/k/v are read from their stacked copy, engine.fused_projections; o_proj is merged in place.)
    layer = next(m for n, m in model.named_modules() if n.endswith("language_model.layers.0.self_attn.o_proj"))
    base = layer.get_base_layer()
    base.weight.data = base.weight.data.clone()
    assert fast("recorded") == compiler
    assert generator._graphs.recorded == 2

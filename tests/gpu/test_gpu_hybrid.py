"""Models with recurrent layers (Qwen3.5's gated delta rule, LFM2's short convolutions) on the GPU: the fast
generator's recorded decode step over linear-attention states gives the compiled step's tokens and is reused across
generations, and prompt-cache scoring gives TRL's per-row log-probs.

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
         "images": [image[i]]} for i in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2_vl"])
def test_recorded_decode_over_linear_attention_states(tiny_dir, tmp_path, family):
    from datasets import Dataset
    from trl.data_utils import prepare_multimodal_messages

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer
    from vlm_grpo.data.rows import prepare_row

    # fp32 weights and no autocast: on a GPU the loader's default is bf16, and the config's bf16 (on by default there)
    # runs the forward under bf16 autocast through accelerate, whose rounding alone put the two scoring paths 2-6e-3
    # apart (H100, H200; with fp32 weights but autocast on: 3.9e-3, one bf16 step of a log-prob in [0.5, 1)) where this
    # test asks 1e-3 of the paths themselves.
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family), dtype=torch.float32)
    model = FastVisionModel.get_peft_model(model, r=4)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    rows = _rows()
    config = VLMGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=12, generation_kwargs={"do_sample": False, "min_new_tokens": 12},
                           report_to="none", max_steps=1, bf16=False)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [lambda prompts, completions, **kw: [0.0] * len(completions)], args=config,
                             train_dataset=Dataset.from_list(rows), processing_class=processor)  # fmt: skip
    prepared = [prepare_row(r) for r in rows for _ in range(4)]
    batch = trainer._tokenize_prompts([prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in prepared])
    FastVisionModel.for_inference(trainer.model)
    generator = trainer.fast_generator

    def fast(mode):
        generator.cuda_graph = mode
        return generator.generate(trainer.model, *batch, trainer.generation_config, trainer._tokenizer.pad_token_id)

    torch._dynamo.reset()
    compiler = fast("compiler")
    recorded = [fast("recorded") for _ in range(3)]
    assert all(len(c) >= 12 for c in compiler)
    assert all(r == compiler for r in recorded)  # the linear-attention states updated in place by every replay
    assert generator.cuda_graph == "recorded" and generator._graphs.recorded == 1

    # Prompt-cache scoring (engine.prefix_cache) against TRL's per-row forward, on the GPU's kernels, in true fp32:
    # cuDNN runs fp32 convolutions (the vision towers' patch embeddings, LFM2's short convolutions) in TF32 by default,
    # and picks its algorithm by batch shape, so 2 prompts and 8 rows round differently (measured: 2-4e-3).
    torch.backends.cudnn.allow_tf32 = False
    FastVisionModel.for_training(trainer.model)
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([r for r in rows for _ in range(4)])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keys = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids", "pixel_attention_mask",
            "spatial_shapes", "num_tiles")  # fmt: skip
    extra = {k: inputs[k] for k in keys if k in inputs}
    width = inputs["completion_ids"].size(1)
    with torch.no_grad():
        calls = trainer.shared_prefix_calls
        shared = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, **extra)[0]
        assert trainer.shared_prefix_calls == calls + 1
        trainer.args.shared_prefix = False
        plain = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, **extra)[0]
    used = inputs["completion_mask"].bool()
    print(f"{family}: prompt-cache vs per-row log-prob max diff {(shared - plain)[used].abs().max().item():.2e}")
    assert (shared - plain)[used].abs().max() < 1e-3

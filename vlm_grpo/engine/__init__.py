"""The speed engine `VLMGRPOTrainer` calls: what makes a GRPO step fast, kept apart from what makes it correct.

Every module here serves a TRL hook with the same results as TRL's own path, and says when it cannot (the trainer
then takes TRL's path and logs why once):
- `batch_layout`: the GRPO groups of a batch (rows with the same prompt and images) and each row's slice of the
  processor's vision tensors, for both fast paths;
- `fast_generation`: rollouts with one prefill per group, a static KV cache and a compiled decode step, which
  `decode_graph` records as one CUDA graph, `token_loop` feeds (buffers that outlive a generation, sampling inside
  the step), `decode_attention` and `fused_projections` make cheaper (grouped heads reading the cache in place; q/k/v
  as one GEMM), and `lora_merge` runs with LoRA merged into the base weights (restored bit for bit afterwards, from
  a host copy `pinned_pool` pins in the background, by `cudaHostRegister`);
- `quantized_generation`: plain stand-ins for bitsandbytes 4-bit / 8-bit layers, so QLoRA models decode compiled;
- `shared_prefix`: old-policy, reference and policy log-probs with each group's prompt and images computed once;
- `adapters_off`: a fresh adapter's KL reference, the policy with its LoRA layers switched off by their own flags;
- `compiled_layers`: the layers' attention and MLP compiled for the training forward and backward;
- `sharded`: FSDP2 / ZeRO-3 weights gathered whole for a rollout or an export.
"""

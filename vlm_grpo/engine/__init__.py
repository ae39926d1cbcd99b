"""The speed engine `VLMGRPOTrainer` calls: what makes a GRPO step fast, kept apart from what makes it correct.

Every module here serves a TRL hook with the same results as TRL's own path, and says when it cannot (the trainer
then takes TRL's path and logs why once):
- `batch_layout`: the GRPO groups of a batch (rows with the same prompt and images) and each row's slice of the
  processor's vision tensors, for both fast paths;
- `fast_generation`: rollouts with one prefill per group, a static KV cache and a compiled decode step;
- `quantized_generation`: plain stand-ins for bitsandbytes 4-bit / 8-bit layers, so QLoRA models decode compiled;
- `shared_prefix`: old-policy, reference and policy log-probs with each group's prompt and images computed once;
- `sharded`: FSDP2 / ZeRO-3 weights gathered whole for a rollout or an export.
"""

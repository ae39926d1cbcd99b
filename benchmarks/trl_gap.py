"""Plain TRL with its own generate-vs-score gap measured, for `grpo_step.py` (docs/benchmarks.md): TRL's generation
returns no log-probs, so a last logits processor records the sampled tokens' log-probs under the processed scores.
"""

from __future__ import annotations


def sampler_gap_trl(base):
    """Plain TRL with its own generate-vs-score gap measured (`docs/benchmarks.md`): a last logits processor keeps
    each step's processed scores, normalised, and reads the sampled token's log-prob from them once the next step
    shows which token was drawn (one [B, V] buffer, no per-step history); the loss's log-probs of a batch's first use
    are compared with them as the trainer logs its own (`vlm_grpo.training.sampler_logprobs.log_logp_gap`)."""
    import torch
    from transformers import LogitsProcessorList

    from vlm_grpo.training.sampler_logprobs import log_logp_gap

    class Recorder:
        def __init__(self):
            self.last, self.taken, self.width = None, [], None

        def __call__(self, input_ids, scores):
            if self.width is None:
                self.width = input_ids.shape[1]
            if self.last is not None:
                self.taken.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
            self.last = scores.float().log_softmax(-1)
            return scores

    class GapTRL(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            recorder = Recorder()
            model = self.accelerator.unwrap_model(self.model)
            generate = model.generate

            def recording_generate(*a, **k):
                sequences = generate(*a, logits_processor=LogitsProcessorList([recorder]), **k)
                last_token = sequences[:, -1:]
                recorder.taken.append(recorder.last.gather(1, last_token).squeeze(1))
                return sequences

            model.generate = recording_generate
            try:
                ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                       has_tool_images)  # fmt: skip
            finally:
                del model.generate
            taken = torch.stack(recorder.taken, dim=1).cpu()  # [B, new tokens]
            return ids, [taken[row, : len(row_ids)].tolist() for row, row_ids in enumerate(ids)]

        def _compute_loss(self, model, inputs):
            self._gap_scored = []
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                scored, self._gap_scored = self._gap_scored, None
            if scored and "sampling_per_token_logps" in inputs:
                reference = inputs.get("old_per_token_logps", scored[0])
                mask = inputs["completion_mask"]  # a tool's answer is not sampled (TRL gives it log-prob 0.0)
                mask = mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
                log_logp_gap(self, reference, inputs["sampling_per_token_logps"], mask)
            return loss

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if getattr(self, "_gap_scored", None) is not None:
                self._gap_scored.append(result[0])
            return result

    return GapTRL

"""`VLMGRPOTrainer` and what only it calls: its config and inputs, which path generates and scores a batch,
the sampler's log-probs beside the loss's, dynamic sampling, callbacks, checkpoints and the faults a run survives
(preemption, non-finite steps, failed writes), and held-out evaluation.
"""

"""`FastVisionModel` and what only it calls: loading (`loader`), which layers get LoRA (`lora_selection`),
saved adapters, requires-grad hooks, train / eval modes, the merged export and the model card.
"""

"""Offline tiny vision-language models for tests and the demo.

The Hugging Face Hub is not always reachable (CI, air-gapped clusters), so the test suite and the
embedded demo build their models in code: a real transformers architecture with tiny dimensions and
seeded random weights, a word-level tokenizer carrying the family's real special tokens and chat
template (`tiny.tokenizer`), and the family's real (PIL) image processor, one module per family. The result is a
normal checkpoint directory that `FastBaseVisionModel.from_pretrained` (or plain transformers) loads like any Hub
model (`tiny.build.build_tiny_vlm`). For tool calling (`tools=True`, Qwen families) the tokenizer is a byte-level BPE
that decodes text back exactly, with the family's shipped chat template.
"""

from .build import TINY_FAMILIES, build_tiny_vlm, tool_families
from .tokenizer import MAX_LEARNABLE_WORDS, build_word_level_tokenizer, offline_learning_note, split_words

__all__ = [
    "MAX_LEARNABLE_WORDS",
    "TINY_FAMILIES",
    "build_tiny_vlm",
    "build_word_level_tokenizer",
    "offline_learning_note",
    "split_words",
    "tool_families",
]

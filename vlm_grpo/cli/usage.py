"""The command's name and its one error type: shared by the flag parser and the recipe check."""

from __future__ import annotations

__all__ = ["PROG", "UsageError"]

PROG = "vlm-grpo"


class UsageError(ValueError):
    """Bad command-line input: `main` prints it as one line and exits with status 2, as argparse does."""

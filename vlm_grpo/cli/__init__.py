"""The `vlm-grpo` command: its run (`command`), flags (`args`), checks before anything is written (`checks`), the
defaults that fit the flags given (`defaults`), the line a stopped run ends with (`stop`), what it writes after
training (`finish`), the task it trains on (`task`), the demo's settings (`demo`) and its note on a reward that pays
nothing (`reward_watch`).
"""

from .command import main, run

__all__ = ["main", "run"]

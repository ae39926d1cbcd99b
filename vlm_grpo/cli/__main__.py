"""`python -m vlm_grpo.cli`: the `vlm-grpo` command."""

import sys

from .command import main

sys.exit(main())

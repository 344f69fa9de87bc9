"""`python -m dllm_jax.cli`: the `dllm-jax` console script (make demo runs it this way)."""

import sys

from dllm_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())

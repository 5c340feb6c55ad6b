"""VSPO (steering-vector GRPO) and its baselines; the same as `llmkit train vspo`.

    python recipes/vspo.py --config recipes/configs/vspo/tiny_cpu.yaml [--key value ...]
    python recipes/vspo.py --config recipes/configs/vspo/smollm2_verbosity_gsm8k.yaml --mode grpo

The method lives in llmkit/train/vspo/; this script only parses the config and calls it.
"""

import sys

from llmkit.cli import UserError
from llmkit.commands.train import parse_method_args

if __name__ == "__main__":
    try:
        module, configs = parse_method_args("vspo", sys.argv[1:])
        sys.exit(module.main(*configs))
    except UserError as e:
        print(f"recipes/vspo.py: error: {e}", file=sys.stderr)
        sys.exit(2)

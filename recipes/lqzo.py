"""Zeroth-order finetuning of INT4/INT2 models (LQZO, QZO, MeZO); the same as `llmkit train lqzo`.

    python recipes/lqzo.py --config recipes/configs/lqzo/tiny_cpu.yaml [--key value ...]
    accelerate launch --multi_gpu --num_processes 2 recipes/lqzo.py --config recipes/configs/lqzo/tiny_cpu.yaml

The method lives in llmkit/train/lqzo/; this script only parses the config and calls it.
"""

import sys

from llmkit.cli import UserError
from llmkit.commands.train import parse_method_args
from llmkit.models import ModelNotFoundError

if __name__ == "__main__":
    try:
        module, configs = parse_method_args("lqzo", sys.argv[1:])
        rc = module.main(*configs)
    except (UserError, ModelNotFoundError) as e:
        print(f"recipes/lqzo.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)

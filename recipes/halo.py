"""HALO layer unfreezing for SFT or distillation; the same as `llmkit train halo`.

    python recipes/halo.py --config recipes/configs/halo/tiny_cpu.yaml [--key value ...]
    accelerate launch --multi_gpu --num_processes 2 recipes/halo.py --config recipes/configs/halo/tiny_cpu.yaml

The method lives in llmkit/train/halo/; this script only parses the config and calls it.
"""

import sys

from llmkit.cli import UserError
from llmkit.commands.train import parse_method_args
from llmkit.models import ModelNotFoundError

if __name__ == "__main__":
    try:
        module, configs = parse_method_args("halo", sys.argv[1:])
        rc = module.main(*configs)
    except (UserError, ModelNotFoundError) as e:
        print(f"recipes/halo.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)

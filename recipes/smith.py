"""SMITH (tool building and tool use in one policy); the same as `llmkit train smith`.

    python recipes/smith.py --config recipes/configs/smith/tiny_cpu.yaml [--key value ...]
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/smith.py --config recipes/configs/smith/qwen3-4b_gpu.yaml

The method lives in llmkit/train/smith/; this script only parses the config and calls it.
"""

import sys

from llmkit.cli import UserError
from llmkit.commands.train import parse_method_args
from llmkit.models import ModelNotFoundError

if __name__ == "__main__":
    try:
        module, configs = parse_method_args("smith", sys.argv[1:])
        rc = module.main(*configs)
    except (UserError, ModelNotFoundError) as e:
        print(f"recipes/smith.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)

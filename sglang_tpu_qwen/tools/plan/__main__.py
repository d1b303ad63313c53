"""``python -m sglang_tpu_qwen.tools.plan``."""

import sys

from sglang_tpu_qwen.tools.plan.cli import main

main(sys.argv[1:])

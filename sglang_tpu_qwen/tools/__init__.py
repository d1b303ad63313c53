"""Command-line tools (python -m sglang_tpu_qwen.tools.<name>)."""

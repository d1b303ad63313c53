"""Entry point: ``python -m sglang_tpu_qwen.bench_serving`` (SGLang's module name).

The implementation is in `sglang_tpu_qwen.bench.serving`; see its module docstring for the flags.
"""

from sglang_tpu_qwen.bench.serving import main

if __name__ == "__main__":
    main()

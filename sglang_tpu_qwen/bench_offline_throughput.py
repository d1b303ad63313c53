"""Entry point: ``python -m sglang_tpu_qwen.bench_offline_throughput`` (SGLang's module name).

The implementation is in `sglang_tpu_qwen.bench.offline_throughput`; see its `main` for the flags.
"""

from sglang_tpu_qwen.bench.offline_throughput import main

if __name__ == "__main__":
    main()

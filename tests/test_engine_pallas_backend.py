"""The engine with both Pallas kernels forced on CPU (interpret mode), with the GDN backend xla-chunked, and with
the greedy sampling kernel, gives the reference backend's greedy tokens.

A short multi-request run of the embedded model: a batched prefill of prompts of different lengths (the
attention kernel's prefill path and the chunked GDN form), then batched decodes (the decode path and the
recurrent form), with pages and state slots shared across requests.
"""

from __future__ import annotations

from sglang_tpu_qwen.engine.engine import Engine
from sglang_tpu_qwen.kernels import sampling_backend
from sglang_tpu_qwen.kernels.dispatch import KernelBackends, resolve_backends
from sglang_tpu_qwen.kernels.greedy_head.kernel import greedy_lm_head
from sglang_tpu_qwen.kernels.sampling_backend import SamplingBackend

PROMPTS = ["The quick brown fox", "a much longer prompt than the other one, to make the batch ragged", "x"]
PARAMS = {"temperature": 0.0, "max_new_tokens": 4}
KWARGS = dict(max_total_tokens=512, page_size=4, max_running_requests=4, chunked_prefill_size=64,
              disable_radix_cache=True)


def _generate(attention_backend: str, gdn_backend: str) -> list[list[int]]:
    eng = Engine(**KWARGS, attention_backend=attention_backend, gdn_backend=gdn_backend)
    try:
        resolved = eng.runner.backends
        assert (resolved.attention.name, resolved.gdn.name) == (attention_backend, gdn_backend)
        # CPU: Pallas runs in interpret mode (xla-chunked runs the GDN kernel for decode).
        assert resolved.interpret == (attention_backend == "pallas" or gdn_backend != "reference")
        return [r["output_ids"] for r in eng.generate(PROMPTS, PARAMS)]
    finally:
        eng.shutdown()


def test_resolve_backends_on_cpu() -> None:
    assert resolve_backends("auto", "auto", platform="cpu") == KernelBackends.of("reference", "reference", False, "cpu")
    assert resolve_backends("auto", "auto", platform="tpu") == KernelBackends.of("pallas", "pallas", False, "tpu")
    assert resolve_backends("pallas", "reference", platform="cpu") == KernelBackends.of(
        "pallas", "reference", True, "cpu")
    assert resolve_backends("auto", "auto", platform="cpu").xla_cpu  # the XLA:CPU forms of the reference
    assert resolve_backends("reference", "xla-chunked", platform="cpu") == KernelBackends.of(
        "reference", "xla-chunked", True, "cpu")
    assert resolve_backends("auto", "xla-chunked", platform="tpu") == KernelBackends.of(
        "pallas", "xla-chunked", False, "tpu")


def test_pallas_backends_match_reference_greedy_tokens() -> None:
    reference = _generate(attention_backend="reference", gdn_backend="reference")
    pallas = _generate(attention_backend="pallas", gdn_backend="pallas")
    assert all(len(ids) == PARAMS["max_new_tokens"] for ids in reference)
    assert pallas == reference


def test_pallas_sampling_matches_reference_greedy_tokens(monkeypatch) -> None:
    """--sampling-backend pallas on a bfloat16 model: the greedy sampling program takes its tokens from
    kernels/greedy_head (interpreted here; a counter on the kernel's entry proves the programs were traced
    through it), and they are the reference backend's (XLA's product and argmax)."""
    traced = []

    def counted(*args, **kwargs):
        traced.append(args[0].shape)
        return greedy_lm_head(*args, **kwargs)

    monkeypatch.setattr(sampling_backend, "greedy_lm_head", counted)
    outputs, kernel_traces = {}, {}
    for name in ("reference", "pallas"):
        before = len(traced)  # the programs are traced (and compiled) before the engine is ready
        eng = Engine(**KWARGS, dtype="bfloat16", sampling_backend=name)
        try:
            assert eng.runner.backends.sampling == SamplingBackend(name, interpret=name == "pallas")
            outputs[name] = [r["output_ids"] for r in eng.generate(PROMPTS, PARAMS)]
            kernel_traces[name] = len(traced) - before
        finally:
            eng.shutdown()
    assert kernel_traces["reference"] == 0 and kernel_traces["pallas"] > 0
    assert all(len(ids) == PARAMS["max_new_tokens"] for ids in outputs["reference"])
    assert outputs["pallas"] == outputs["reference"]


def test_xla_chunked_gdn_matches_reference_greedy_tokens() -> None:
    """--gdn-backend xla-chunked: the prefill's chunked form as batched XLA products
    (kernels/gdn/parallel_chunks.py), the decode steps through the fused kernel (interpreted here); the
    reference backend's greedy tokens (float32 on the CPU: the products at HIGHEST)."""
    reference = _generate(attention_backend="reference", gdn_backend="reference")
    assert _generate(attention_backend="reference", gdn_backend="xla-chunked") == reference

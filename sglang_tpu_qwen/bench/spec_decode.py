"""Speculative decoding (NEXTN, the checkpoint's MTP layer) against plain decoding, on a TRAINED tiny model.

A random MTP layer almost never drafts the target's token, so a benchmark on the embedded (random) checkpoint
says nothing about what speculation gains. This one first trains a tiny Qwen3.5-MoE and its MTP layer on the
CPU (torch, HF transformers' own ``Qwen3_5MoeForCausalLM``; a few minutes), on a synthetic corpus with
learnable structure (`PhraseCorpus`: a seeded random Markov chain over a set of random phrases, with token
noise), then serves the checkpoint with and without ``--speculative-algorithm NEXTN`` at batch 1 and batch 32
(--batch-sizes; ``1@4`` is batch 1 with only the 4-row programs compiled, see below) on held-out prompts of
the same distribution:

1. Main model: next-token loss. MTP layer (`HfMtp`, the math of model/mtp.py built from HF modules, as in
   tests/test_mtp_layer.py), the main model frozen: at position p it reads the main model's final-norm hidden
   state h_p and the embedding of x_{p+1} and predicts x_{p+2} (the shared lm_head, frozen). The checkpoint is
   HF's ``save_pretrained`` plus the ``mtp.*`` tensors under the release's names, ``mtp_num_hidden_layers: 1``,
   under --work-dir (a temporary directory by default, deleted at exit). Printed: training time, final losses
   and top-1 accuracies on held-out sequences (the MTP's both against the corpus token x_{p+2} and against the
   main model's own greedy choice there, which is what a verify step accepts).
2. One Engine per configuration (``max_running_requests`` = the batch), programs precompiled at startup,
   warm-up on other held-out prompts, then --repeats timed runs, each after flushing the prefix cache, over
   --num-prompts prompts (--batch1-prompts at batch 1) in rounds of `batch` (one streamed ``generate`` call per
   round; ``--arrival queue``: all prompts in one call, at most `batch` running, as SGLang's bench_serving
   with --max-concurrency, so a request that finishes early makes room at once instead of leaving its round
   a row short); greedy, ``ignore_eos``, ``min_new_tokens`` = ``max_new_tokens`` = --output-len, so every
   request yields exactly --output-len tokens. The table gives the median repeat and the spread.

Prefill and decode are separated on the client's clock from the streamed chunks: in a round, the decode phase
runs from the moment the LAST request of the round received its first token (every prompt has been prefilled
by then; nothing but decode or verify steps runs after it) to the end of the round, and its tokens are the
tokens of the chunks received in that window. Decode tok/s = those tokens / that time, summed over rounds.
TTFT is per request (submit to first chunk). The acceptance length is the change of the engine's counters
over the timed run (``get_server_info()["internal_states"][0]``): accepted tokens / verify rows (a verify row
is one request in one verify step; 1.0 = no draft accepted; at most --speculative-num-steps + 1). Compilations
during the timed run are counted (engine/runner/compilation.py) and must be 0; the greedy outputs with MTP
are compared token for token with those without (the mismatch count must be 0: speculation is exact). The
MTP runs use the server's --speculative-draft-policy unless --draft-policy says otherwise; under ``adaptive``
(the default) a decode step may run without verification, and the table counts verify and plain steps (the
tokens of plain steps are not in the acceptance length).

Caveats: both runs use overlap scheduling unless --disable-overlap-schedule (with speculation a verify step
after an extend step runs synchronously: engine/scheduler/speculative.py); streaming costs the host one chunk per
request per step in both. On the
CPU the "device" is the same cores as the host, and this model's decode step takes about a millisecond, so
host work per step (Python, the extra verify / commit / draft programs) weighs far more than on a TPU serving
a real model. The tiny model's corpus is far more predictable than text: the acceptance length here is this
corpus's, not a real model's. On XLA:CPU the 1-row decode forward (plain decoding at batch 1) copies the
whole GDN state pool once per GDN layer (the 1-row scatter becomes a dynamic-update-slice that is not done in
place), over ten times the 4-row program's time; ``1@4`` runs batch 1 in the 4-row programs instead.

Usage: ``python -m sglang_tpu_qwen.bench.spec_decode`` (defaults: about 3 minutes of training on 2 cores,
then six engines; about 9 minutes in all). Prints a table and one JSON line; ``--output-json PATH`` also
writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

VOCAB = 512  # token ids 1 .. VOCAB - 1 (0 is the pad id); all are ordinary ids of the embedded tokenizer
SPEC_STEPS = 3


def hf_config(hidden: int = 96, num_experts: int = 8) -> dict[str, Any]:
    """Kwargs of ``Qwen3_5MoeTextConfig``: 4 layers (3 Gated DeltaNet + 1 full attention, the release's
    pattern), `num_experts` experts top-2 plus a shared expert, vocab VOCAB, one MTP layer.

    Head dims are the release's TPU-friendly 128 although the model is tiny: the Pallas attention and GDN
    kernels need multiples of 128 lanes, and on a TPU pools with minor dims under the (8, 128) tile are copied
    around every step program (temporaries of several times the pools: the first chip run of this benchmark,
    at head dims 32 / 16, could not compile its programs in 16 GB)."""
    return dict(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=4, rms_norm_eps=1e-6, max_position_embeddings=1024,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip


class PhraseCorpus:
    """A seeded synthetic language: `num_phrases` random phrases of 3-10 tokens over ids 1 .. VOCAB - 1 (a
    token may occur in several phrases, so the next token can depend on more than the last one), chained by a
    sparse random Markov chain (each phrase has `branching` successors with Dirichlet(1) weights), each token
    replaced by a uniform random one with probability `noise`. The same seed gives the same language; `sample`
    draws sequences from it with its own generator (training and held-out data use different ones)."""

    def __init__(self, seed: int = 0, num_phrases: int = 128, branching: int = 4, noise: float = 0.03) -> None:
        rng = np.random.default_rng(seed)
        self.phrases = [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(3, 11, size=num_phrases)]
        self.successors = np.stack([rng.choice(num_phrases, size=branching, replace=False)
                                    for _ in range(num_phrases)])
        self.weights = rng.dirichlet(np.ones(branching), size=num_phrases)
        self.noise = noise

    def sample(self, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """[n, length] int64 sequences, each starting at a random point of a random phrase."""
        out = np.empty((n, length), np.int64)
        for i in range(n):
            phrase = int(rng.integers(len(self.phrases)))
            toks = list(self.phrases[phrase][int(rng.integers(len(self.phrases[phrase]))):])
            while len(toks) < length:
                phrase = int(self.successors[phrase, rng.choice(self.successors.shape[1], p=self.weights[phrase])])
                toks.extend(self.phrases[phrase].tolist())
            out[i] = toks[:length]
        noisy = rng.random(out.shape) < self.noise
        out[noisy] = rng.integers(1, VOCAB, size=int(noisy.sum()))
        return out


def hf_mtp_class() -> type:
    """`HfMtp`, the MTP layer built from HF transformers' modules (defined lazily: torch is imported only when
    needed); also the oracle of tests/test_mtp_layer.py."""
    import torch
    import transformers

    class HfMtp(torch.nn.Module):
        """The MTP layer from HF modules, as SGLang's / vLLM's ``qwen3_5_mtp`` wire them (model/mtp.py):
        ``Qwen3_5MoeRMSNorm`` x 3, a bias-free ``fc`` over ``[norm(embedding) ; norm(hidden)]``, one
        ``Qwen3_5MoeDecoderLayer`` (full attention, sparse MoE), the target's ``lm_head``."""

        def __init__(self, cfg: Any) -> None:
            super().__init__()
            mods = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
            h = cfg.hidden_size
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = mods.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = mods.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
            self.norm = mods.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
            self.layer = mods.Qwen3_5MoeDecoderLayer(cfg, cfg.layer_types.index("full_attention"))
            std = cfg.initializer_range
            with torch.no_grad():  # HF's _init_weights conventions (the module is not a PreTrainedModel)
                for name, p in self.named_parameters():
                    if "norm" in name:
                        p.zero_()  # zero-centred norms: 1 + w
                    elif "experts" in name or name.endswith("mlp.gate.weight"):
                        p.normal_(0.0, std)

        def tensors(self) -> dict[str, np.ndarray]:
            """``mtp.*`` checkpoint tensors as the release names them."""
            state = self.state_dict()
            out = {f"mtp.{k}": v for k, v in state.items() if not k.startswith("layer.")}
            out.update({f"mtp.layers.0.{k[len('layer.'):]}": v for k, v in state.items() if k.startswith("layer.")})
            return {k: v.detach().float().numpy().copy() for k, v in out.items()}

        def forward(self, model: Any, x: Any, hidden: Any) -> Any:
            """[B, L - 1, V] draft logits at positions 0 .. L-2 (predicting tokens 2 .. L) of ``x`` [B, L], from
            ``hidden`` = ``model.model(x).last_hidden_state`` (after the final norm)."""
            e = self.pre_fc_norm_embedding(model.model.embed_tokens(x[:, 1:]))
            z = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden[:, :-1])], dim=-1))
            t = z.shape[1]
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            z = self.layer(z, position_embeddings=model.model.rotary_emb(z, pos), attention_mask=mask,
                           position_ids=pos)
            return model.lm_head(self.norm(z))

    return HfMtp


@dataclass
class TrainResult:
    path: Path
    stats: dict[str, Any]


def _lr(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def train_checkpoint(out: Path, corpus: PhraseCorpus, *, train_steps: int, mtp_steps: int, batch: int,
                     seq_len: int, hidden: int, seed: int, threads: int) -> TrainResult:
    """Train the main model, then its MTP layer (main frozen), and write the checkpoint to `out`.

    Returns the directory and the training stats (seconds, final losses, held-out accuracies)."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5MoeTextConfig(**hf_config(hidden))
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3_5MoeForCausalLM(cfg)
    rng = np.random.default_rng(seed + 100)
    heldout = torch.from_numpy(corpus.sample(64, seq_len, np.random.default_rng(seed + 200)))
    stats: dict[str, Any] = {"params_main": sum(p.numel() for p in model.parameters()), "train_steps": train_steps,
                             "mtp_steps": mtp_steps, "batch": batch, "seq_len": seq_len, "torch_threads": threads}

    start = time.perf_counter()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    for step in range(train_steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, train_steps, 3e-3)
        x = torch.from_numpy(corpus.sample(batch, seq_len, rng))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == train_steps - 1:
            print(f"[train main] step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    stats["main_train_s"] = time.perf_counter() - start
    stats["main_first_loss"] = losses[0]
    stats["main_final_loss"] = float(np.mean(losses[-10:]))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        out_h = model.model(heldout)
        logits = model.lm_head(out_h.last_hidden_state)
        main_pred = logits.argmax(-1)  # [B, L]: the main model's greedy token after each position
        stats["main_heldout_loss"] = float(torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), heldout[:, 1:].reshape(-1)))
        stats["main_heldout_top1"] = float((main_pred[:, :-1] == heldout[:, 1:]).float().mean())

    mtp = hf_mtp_class()(cfg)
    mtp.train()
    start = time.perf_counter()
    opt = torch.optim.AdamW(mtp.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(mtp_steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, mtp_steps, 3e-3)
        x = torch.from_numpy(corpus.sample(batch, seq_len, rng))
        with torch.no_grad():
            hidden_states = model.model(x).last_hidden_state
        logits = mtp(model, x, hidden_states)[:, :-1]  # positions 0 .. L-3 predict x_2 .. x_{L-1}
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == mtp_steps - 1:
            print(f"[train MTP]  step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    stats["mtp_train_s"] = time.perf_counter() - start
    stats["mtp_first_loss"] = losses[0]
    stats["mtp_final_loss"] = float(np.mean(losses[-10:]))
    mtp.eval()
    with torch.no_grad():
        draft = mtp(model, heldout, out_h.last_hidden_state)[:, :-1]  # [B, L-2, V]: predicts x_2 .. x_{L-1}
        stats["mtp_heldout_loss"] = float(torch.nn.functional.cross_entropy(
            draft.reshape(-1, VOCAB), heldout[:, 2:].reshape(-1)))
        pred = draft.argmax(-1)
        stats["mtp_heldout_top1"] = float((pred == heldout[:, 2:]).float().mean())
        # What a verify step accepts: the draft of x_{p+2} equals the main model's greedy token after p+1.
        stats["mtp_heldout_agree_main"] = float((pred == main_pred[:, 1:-1]).float().mean())
    stats["train_s"] = stats["main_train_s"] + stats["mtp_train_s"]

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, **mtp.tensors()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return TrainResult(out, stats)


def _greedy_params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": output_len, "min_new_tokens": output_len, "ignore_eos": True}


def _streamed_round(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
    """One streamed generate call: outputs, TTFTs, and the decode window (module docstring)."""
    start = time.perf_counter()
    outputs: list[list[int]] = [[] for _ in prompts]
    first: list[float | None] = [None] * len(prompts)
    chunks: list[tuple[float, int]] = []  # (arrival, tokens) of every chunk after a request's first
    for d in engine.generate(input_ids=prompts, sampling_params=params, stream=True, stream_deltas=True):
        now = time.perf_counter()
        i, ids = d["index"], d["output_ids"]
        if not ids:
            continue
        outputs[i].extend(ids)
        if first[i] is None:
            first[i] = now
            if len(ids) > 1:  # more than the first token in the first chunk: those are decode tokens
                chunks.append((now, len(ids) - 1))
        else:
            chunks.append((now, len(ids)))
    end = time.perf_counter()
    if any(t is None for t in first):
        raise RuntimeError("a request finished without output tokens")
    last_first = max(t for t in first if t is not None)
    return {"outputs": outputs, "ttft": [t - start for t in first if t is not None], "elapsed_s": end - start,
            "decode_s": end - last_first, "decode_tokens": sum(n for t, n in chunks if t > last_first)}


def run_config(model_path: Path, tokenizer_path: str, batch: int, spec: bool, prompts: list[list[int]],
               warmup: list[list[int]], output_len: int, context_length: int, repeats: int,
               disable_overlap_schedule: bool = False, bucket: int | None = None,
               draft_policy: str | None = None, dtype: str = "auto", arrival: str = "rounds") -> dict[str, Any]:
    """Start an Engine (precompiled), warm up on `warmup`, then `repeats` times: flush the prefix cache and time
    `prompts` in rounds of `batch` (`arrival` "queue": all at once, at most `batch` running, the decode figures
    then the end-to-end ones). Returns the measured figures (decode and end-to-end tok/s: the median
    repeat, and each repeat's) and the first repeat's outputs; the engine is shut down before returning.
    `bucket`: compile only that batch size (--precompile-bs-paddings), e.g. batch 1 run in the 4-row programs;
    `draft_policy`: --speculative-draft-policy (None: the server's default); `dtype`: --dtype."""
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.engine.runner import compilation

    kwargs: dict[str, Any] = dict(model_path=str(model_path), tokenizer_path=tokenizer_path,
                                  max_running_requests=batch, context_length=context_length,
                                  grammar_backend="none", skip_server_warmup=True, dtype=dtype,
                                  disable_overlap_schedule=disable_overlap_schedule,
                                  precompile_bs_paddings=[bucket] if bucket else None)
    if spec:
        kwargs.update(speculative_algorithm="NEXTN", speculative_num_steps=SPEC_STEPS, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=SPEC_STEPS + 1)
        if draft_policy is not None:
            kwargs["speculative_draft_policy"] = draft_policy
    start = time.perf_counter()
    engine = Engine(**kwargs)
    startup_s = time.perf_counter() - start
    params = _greedy_params(output_len)
    rounds = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] if arrival == "rounds" else [prompts]
    runs: list[dict[str, Any]] = []
    try:
        start = time.perf_counter()
        for i in range(0, len(warmup), batch):
            _streamed_round(engine, warmup[i:i + batch], params)
        warmup_s = time.perf_counter() - start
        before = dict(engine.get_server_info()["internal_states"][0])
        compiles = compilation.jit_compilations()
        for _ in range(repeats):
            if not engine.flush_cache():
                raise RuntimeError("the prefix cache could not be flushed")
            start = time.perf_counter()
            results = [_streamed_round(engine, r, params) for r in rounds]
            elapsed = time.perf_counter() - start
            outputs = [o for r in results for o in r["outputs"]]
            decode_s = sum(r["decode_s"] for r in results) if arrival == "rounds" else elapsed
            decode_tokens = (sum(r["decode_tokens"] for r in results) if arrival == "rounds"
                             else sum(len(o) for o in outputs))
            runs.append({"elapsed_s": elapsed, "decode_s": decode_s, "decode_tokens": decode_tokens,
                         "output_tokens": sum(len(o) for o in outputs),
                         "ttft": [t for r in results for t in r["ttft"]], "outputs": outputs})
        compiles = compilation.jit_compilations() - compiles
        after = engine.get_server_info()["internal_states"][0]
        precompile = engine.precompile_stats
    finally:
        engine.shutdown()
    outputs = runs[0]["outputs"]
    if any(len(o) != output_len for r in runs for o in r["outputs"]):
        raise RuntimeError(f"a request yielded {sorted({len(o) for o in outputs})} tokens, not {output_len}")
    counters = {k: after.get(k, 0) - before.get(k, 0)
                for k in ("spec_verify_steps", "spec_verify_rows", "spec_accepted_tokens", "spec_draft_tokens",
                          "spec_plain_steps")}
    decode_tps = [r["decode_tokens"] / r["decode_s"] for r in runs]
    e2e_tps = [r["output_tokens"] / r["elapsed_s"] for r in runs]
    ttft = [t for r in runs for t in r["ttft"]]
    return {
        "batch": batch, "bucket": bucket, "label": _label(batch, bucket), "spec": spec, "arrival": arrival,
        "num_prompts": len(prompts), "rounds": len(rounds), "repeats": repeats,
        "disable_overlap_schedule": disable_overlap_schedule,
        "startup_s": startup_s, "precompile": precompile, "warmup_s": warmup_s,
        "output_tokens": runs[0]["output_tokens"], "decode_tokens": runs[0]["decode_tokens"],
        "elapsed_s": [r["elapsed_s"] for r in runs], "decode_s": [r["decode_s"] for r in runs],
        "decode_throughput": float(np.median(decode_tps)), "decode_throughput_runs": decode_tps,
        "output_throughput": float(np.median(e2e_tps)), "output_throughput_runs": e2e_tps,
        "ttft_mean_s": float(np.mean(ttft)), "ttft_max_s": float(np.max(ttft)),
        "compilations_during_timed_run": compiles, **counters,
        "speculative_draft_policy": after.get("speculative_draft_policy"),
        # The server's own step-time averages (adaptive drafting's verify / plain cost ratio), at the end.
        "spec_step_seconds": after.get("spec_step_seconds"),
        "accept_length": (counters["spec_accepted_tokens"] / counters["spec_verify_rows"]
                          if counters["spec_verify_rows"] else None),
        # Greedy decoding is deterministic: every repeat must give the first one's tokens.
        "repeats_differing": sum(r["outputs"] != outputs for r in runs[1:]),
        "outputs": outputs,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench.spec_decode",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--num-prompts", type=int, default=128,
                   help="Timed prompts per configuration at batch > 1 (in rounds of the batch size).")
    p.add_argument("--batch1-prompts", type=int, default=16,
                   help="Timed prompts at batch 1 (one at a time; the first of the --num-prompts prompts).")
    p.add_argument("--repeats", type=int, default=3,
                   help="Timed runs of the same prompts per configuration (cache flushed before each); the "
                        "table shows the median.")
    p.add_argument("--batch-sizes", default="1,1@4,32",
                   help="Comma-separated batch sizes (max running requests); B@N: batch B with only the N-row "
                        "programs compiled (--precompile-bs-paddings N). Default 1,1@4,32: on XLA:CPU the 1-row "
                        "decode program copies the whole GDN state pool per GDN layer (see docs/performance.md), "
                        "so batch 1 is also measured in the 4-row programs."),
    p.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens (a held-out corpus sequence).")
    p.add_argument("--output-len", type=int, default=256, help="Output tokens per prompt (exact).")
    p.add_argument("--train-steps", type=int, default=500, help="Main-model training steps.")
    p.add_argument("--mtp-steps", type=int, default=500, help="MTP-layer training steps (main model frozen).")
    p.add_argument("--train-batch", type=int, default=32, help="Sequences per training step.")
    p.add_argument("--train-seq-len", type=int, default=64, help="Tokens per training sequence.")
    p.add_argument("--hidden", type=int, default=96, help="Hidden size of the tiny model.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the corpus, the training and the prompts.")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="Torch threads for training. Default 1: on the 2-core CPU beside another busy process, 2 "
                        "threads took 18 s per training step against 0.25 s for 1 (OpenMP oversubscription); "
                        "idle, 2 threads are about 1.5x faster than 1.")
    p.add_argument("--context-length", type=int, default=512, help="Engine --context-length.")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="Engine --dtype (auto: bfloat16 on a TPU, float32 on a CPU; the model trains in float32).")
    p.add_argument("--draft-policy", choices=("adaptive", "always"), default=None,
                   help="--speculative-draft-policy of the MTP runs (default: the server's, adaptive).")
    p.add_argument("--arrival", choices=("rounds", "queue"), default="rounds",
                   help="rounds: the prompts in rounds of the batch size, each round's requests together (a round "
                        "lasts as long as its slowest request); queue: all prompts submitted at once, at most the "
                        "batch size running (--max-running-requests: SGLang's bench_serving --max-concurrency), "
                        "a finished request's place taken at once; its decode figures are the end-to-end ones.")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="Both runs scheduled synchronously (--disable-overlap-schedule).")
    p.add_argument("--work-dir", default=None,
                   help="Where the checkpoint is written (default: a temporary directory, deleted at exit); a "
                        "checkpoint trained there before with the same settings is reused.")
    p.add_argument("--output-json", default=None, help="Also write the result JSON to this path.")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [_parse_batch(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError as e:
        p.error(f"--batch-sizes: {e}")
    if min(args.num_prompts, args.batch1_prompts, args.output_len, args.prompt_len, args.repeats) <= 0:
        p.error("--num-prompts, --batch1-prompts, --prompt-len, --output-len and --repeats must be positive")
    if args.prompt_len + args.output_len + 2 * SPEC_STEPS + 1 > args.context_length:
        p.error("--prompt-len + --output-len (plus the drafts' lookahead) must fit in --context-length")
    return args


def _label(batch: int, bucket: int | None) -> str:
    return f"{batch}@{bucket}" if bucket else str(batch)


def _parse_batch(text: str) -> tuple[int, int | None]:
    """"B" or "B@N" -> (B, N or None); ValueError unless 0 < B and B <= N."""
    batch, _, bucket = text.strip().partition("@")
    b, n = int(batch), int(bucket) if bucket else None
    if b <= 0 or (n is not None and n < b):
        raise ValueError(f"{text!r}: a batch must be positive and fit its programs' rows")
    return b, n


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def format_table(result: dict[str, Any]) -> str:
    """The result as a human-readable table (one row per configuration)."""
    tr = result["training"]
    plain = "synchronous" if result["disable_overlap_schedule"] else "with overlap scheduling"
    m = result["machine"]
    lines = [
        "=========== Speculative decoding (NEXTN, MTP layer) on a trained tiny Qwen3.5-MoE ===========",
        f"Training ({tr['torch_threads']} torch thread(s){', reused from --work-dir' if tr.get('reused') else ''}): "
        f"{tr['train_s']:.0f} s (main {tr['train_steps']} steps {tr['main_train_s']:.0f} s, MTP "
        f"{tr['mtp_steps']} steps {tr['mtp_train_s']:.0f} s); training loss (last 10 steps) main "
        f"{tr['main_final_loss']:.3f}, MTP {tr['mtp_final_loss']:.3f}; held-out loss main "
        f"{tr['main_heldout_loss']:.3f}, MTP {tr['mtp_heldout_loss']:.3f}",
        f"Held-out top-1: main (next token) {100 * tr['main_heldout_top1']:.1f}%, MTP (token after next) "
        f"{100 * tr['mtp_heldout_top1']:.1f}%, MTP = main's greedy token {100 * tr['mtp_heldout_agree_main']:.1f}%",
        f"Prompts: {result['prompt_len']} tokens, {result['output_len']} greedy output tokens each "
        f"(min_new_tokens = max_new_tokens, ignore_eos); MTP: --speculative-num-steps {SPEC_STEPS}, top-k 1, "
        f"{SPEC_STEPS + 1} draft tokens; both runs {plain}; --dtype {result.get('dtype', 'auto')}",
        f"Machine: {m['cpu']}, {m['nproc']} CPUs; JAX on {m['jax']}; 1-min load average "
        f"{m['loadavg_1min_start']:.1f} at the start, {m['loadavg_1min_end']:.1f} at the end",
        ("decode tok/s: tokens streamed after the last request of a round got its first token / that time "
         "(median of the repeats, [min - max]); e2e: all output tokens / the timed run's wall time (median)."
         if result.get("arrival", "rounds") == "rounds" else
         "Arrival: queue (all prompts at once, at most the batch size running); decode tok/s = e2e: all output "
         "tokens / the timed run's wall time (median of the repeats, [min - max])."),
        f"{'batch':>5} {'MTP':>4} {'prompts':>7} {'accept len':>10} {'decode tok/s':>13} {'[min - max]':>15} "
        f"{'e2e tok/s':>9} {'TTFT ms':>7} {'out tokens':>10} {'verify/plain steps':>18} {'compiles':>8} "
        f"{'mismatch':>8}",
    ]
    for c in result["configs"]:
        acc = f"{c['accept_length']:.2f}" if c["accept_length"] is not None else "-"
        mism = "-" if c["mismatches"] is None else str(c["mismatches"])
        spread = f"[{min(c['decode_throughput_runs']):.0f} - {max(c['decode_throughput_runs']):.0f}]"
        steps = f"{c['spec_verify_steps']} / {c['spec_plain_steps']}" if c["spec"] else "-"
        lines.append(f"{c['label']:>5} {'on' if c['spec'] else 'off':>4} {c['num_prompts']:>7} {acc:>10} "
                     f"{c['decode_throughput']:>13.1f} {spread:>15} {c['output_throughput']:>9.1f} "
                     f"{1e3 * c['ttft_mean_s']:>7.1f} {c['output_tokens']:>10} {steps:>18} "
                     f"{c['compilations_during_timed_run']:>8} {mism:>8}")
    for c in result["configs"]:
        if c["spec"] and c["spec_step_seconds"]:
            ms = {m: {b: round(1e3 * v, 2) for b, v in d.items()} for m, d in c["spec_step_seconds"].items()}
            lines.append(f"Batch {c['label']}, MTP ({c['speculative_draft_policy']}): the server's step-time averages "
                         f"(ms, by mode and batch bucket) {ms}")
    for b, sp in result["speedup"].items():
        lines.append(f"Batch {b}: MTP / plain, decode tok/s {sp['decode']:.2f}x, e2e tok/s {sp['e2e']:.2f}x")
    differing = sum(c["repeats_differing"] for c in result["configs"])
    lines.append(f"Repeats whose outputs differ from the configuration's first repeat: {differing}")
    return "\n".join(lines)


def _trained_checkpoint(path: Path, corpus: PhraseCorpus, args: argparse.Namespace) -> TrainResult:
    """Train into `path`, or reuse the checkpoint a previous run trained there with the same settings (its
    ``train_stats.json`` records them; the stats then say ``reused``)."""
    key = {"train_steps": args.train_steps, "mtp_steps": args.mtp_steps, "batch": args.train_batch,
           "seq_len": args.train_seq_len, "hidden": args.hidden, "seed": args.seed, "hf_config": hf_config(args.hidden),
           "corpus": {"num_phrases": len(corpus.phrases), "branching": corpus.successors.shape[1],
                      "noise": corpus.noise}}
    stats_file = path / "train_stats.json"
    if stats_file.exists():
        saved = json.loads(stats_file.read_text())
        if saved.get("key") == json.loads(json.dumps(key)):
            print(f"[train] reusing the checkpoint trained in {path}", flush=True)
            return TrainResult(path, {**saved["stats"], "reused": True})
    trained = train_checkpoint(path, corpus, train_steps=args.train_steps, mtp_steps=args.mtp_steps,
                               batch=args.train_batch, seq_len=args.train_seq_len, hidden=args.hidden,
                               seed=args.seed, threads=args.torch_threads)
    stats_file.write_text(json.dumps({"key": key, "stats": trained.stats}))
    return TrainResult(path, {**trained.stats, "reused": False})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, serve, time; prints the table and one JSON line and returns the result dict (outputs left out)."""
    args = parse_args(argv)
    run_jax_on_cpu_without_accelerator()
    import jax

    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model

    corpus = PhraseCorpus(args.seed)
    load_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        trained = _trained_checkpoint(work / "spec-decode-ckpt", corpus, args)
        print(f"[train] {json.dumps(trained.stats)}", flush=True)
        # Held-out prompts: the corpus's language, generators unseen in training (timed and warm-up differ).
        timed = corpus.sample(args.num_prompts, args.prompt_len, np.random.default_rng(args.seed + 300)).tolist()
        warm = corpus.sample(args.num_prompts, args.prompt_len, np.random.default_rng(args.seed + 400)).tolist()
        tokenizer = str(ensure_embedded_model())
        configs = []
        for batch, bucket in args.batch_sizes:
            n = min(args.batch1_prompts, args.num_prompts) if batch == 1 else args.num_prompts
            plain = None
            for spec in (False, True):
                print(f"[engine] batch {_label(batch, bucket)}, MTP {'on' if spec else 'off'}: {n} prompts", flush=True)
                c = run_config(trained.path, tokenizer, batch, spec, timed[:n], warm[:min(n, batch)],
                               args.output_len, args.context_length, args.repeats, args.disable_overlap_schedule,
                               bucket, args.draft_policy, args.dtype, args.arrival)
                if spec:
                    c["mismatches"] = sum(a != b for a, b in zip(plain["outputs"], c["outputs"], strict=True))
                else:
                    c["mismatches"] = None
                    plain = c
                print(f"[engine] {json.dumps({k: v for k, v in c.items() if k != 'outputs'})}", flush=True)
                configs.append(c)
    for c in configs:
        c.pop("outputs")
    speedup = {}
    for batch, bucket in args.batch_sizes:
        label = _label(batch, bucket)
        off, on = (next(c for c in configs if c["label"] == label and c["spec"] == s) for s in (False, True))
        speedup[label] = {"decode": on["decode_throughput"] / off["decode_throughput"],
                          "e2e": on["output_throughput"] / off["output_throughput"]}
    result = {
        "prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed, "dtype": args.dtype,
        "disable_overlap_schedule": args.disable_overlap_schedule, "repeats": args.repeats, "arrival": args.arrival,
        "speculative_num_steps": SPEC_STEPS, "training": trained.stats, "configs": configs, "speedup": speedup,
        "machine": {"cpu": _cpu_model(), "nproc": os.cpu_count(), "jax": jax.default_backend(),
                    "loadavg_1min_start": load_start, "loadavg_1min_end": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()

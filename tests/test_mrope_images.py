"""Images through the model and the engine against HF: M-RoPE positions, image embeddings, the image-aware cache.

Oracle: transformers' ``Qwen3_5MoeForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` (tiny VL
checkpoints of tests/vl_checkpoint.py, float32). The engine's image encoder here is HF's own vision tower run on
the same ``pixel_values`` (the engine takes any encoder callable; branch ``vision`` supplies the JAX one), so these
tests check what the engine does with image embeddings: M-RoPE positions (HF ``get_rope_index``), the pad tokens'
embeddings replaced, chunked prefill through an image, the prefix cache keyed by image content.

One engine per checkpoint kind (module-scoped; the dense one runs only the HF comparison). Greedy tokens must
equal HF ``generate``; logprobs agree within LOGPROB_TOL (tests/test_model_family.py's bound for float32).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from vl_checkpoint import image_processor  # noqa: E402

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model  # noqa: E402
from sglang_tpu_qwen.engine.engine import Engine  # noqa: E402
from sglang_tpu_qwen.engine.io.errors import InvalidRequestError  # noqa: E402
from sglang_tpu_qwen.engine.io.multimodal import ImageItem, content_hash  # noqa: E402
from sglang_tpu_qwen.engine.runner import compilation  # noqa: E402
from sglang_tpu_qwen.model.mrope import mrope_positions  # noqa: E402
from sglang_tpu_qwen.model.rope import mrope_cos_sin, rope_cos_sin  # noqa: E402

PAD, START, END = 248056, 248053, 248054
LOGPROB_TOL = 2e-3
NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


class Vl:
    """One checkpoint kind: the HF oracle, its image processor, an engine over it, the encoder's call log."""

    def __init__(self, built: tuple[Any, Path]) -> None:
        self.oracle, self.path = built
        self.proc = image_processor(self.path)
        self.encoded: list[int] = []  # hashes the engine asked the encoder for
        self.engine: Engine | None = None

    def image(self, seed: int, h: int, w: int) -> ImageItem:
        px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = self.proc(images=[px], return_tensors="np")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return ImageItem(grid, content_hash(px), out["pixel_values"].astype(np.float32), 2)  # type: ignore[arg-type]

    def encode(self, items: list[ImageItem]) -> list[np.ndarray]:
        """HF's vision tower on the items' pixel_values (the oracle's own image features)."""
        self.encoded += [it.content_hash for it in items]
        with torch.no_grad():
            out = self.oracle.model.get_image_features(
                torch.from_numpy(np.concatenate([it.pixel_values for it in items])),
                torch.tensor([it.grid_thw for it in items])).pooler_output
        return [o.numpy() for o in out]

    def hf_inputs(self, ids: list[int], images: list[ImageItem]) -> dict[str, Any]:
        t = torch.tensor([ids])
        kw: dict[str, Any] = dict(input_ids=t, mm_token_type_ids=(t == PAD).int())
        if images:
            kw.update(pixel_values=torch.from_numpy(np.concatenate([i.pixel_values for i in images])),
                      image_grid_thw=torch.tensor([i.grid_thw for i in images]))
        return kw

    def hf_generate(self, ids: list[int], images: list[ImageItem]) -> tuple[list[int], list[float]]:
        """HF greedy tokens and their logprobs (one forward over prompt + output)."""
        with torch.no_grad():
            out = self.oracle.generate(**self.hf_inputs(ids, images), max_new_tokens=NEW, do_sample=False)
            gen = out[0, len(ids):].tolist()
            logits = self.oracle(**self.hf_inputs(ids + gen, images)).logits[0].double()
        lp = torch.log_softmax(logits, -1)[len(ids) - 1 : len(ids) - 1 + NEW]
        return gen, [float(lp[i, t]) for i, t in enumerate(gen)]


def prompt(images: list[ImageItem], seed: int, pre: int = 5, between: int = 3, post: int = 7) -> list[int]:
    """Random text with each image as <|vision_start|> pads <|vision_end|>, as the chat template lays it out."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 240000, pre).tolist()
    for im in images:
        ids += [START] + [PAD] * im.num_tokens + [END] + rng.integers(0, 240000, between).tolist()
    return ids + rng.integers(0, 240000, post).tolist()


def _engine_over(built: tuple[Any, Path], kind: str) -> Iterator[Vl]:
    v = Vl(built)
    v.engine = Engine(model_path=str(v.path), tokenizer_path=str(ensure_embedded_model()), dtype="float32",
                      page_size=4, max_total_tokens=1024, context_length=256,
                      max_running_requests=2 if kind == "moe" else 1, mm_max_patches=256,
                      chunked_prefill_size=16, max_gdn_snapshots=16, grammar_backend="none",
                      skip_server_warmup=True, image_encoder=v.encode)
    yield v
    v.engine.shutdown()


@pytest.fixture(scope="module")
def vl(vl_checkpoint: Any) -> Iterator[Vl]:
    """The MoE checkpoint's engine (the cache, rewind and validation tests do not depend on the MLP kind)."""
    yield from _engine_over(vl_checkpoint("moe"), "moe")


@pytest.fixture(scope="module")
def vl_dense(vl_checkpoint: Any) -> Iterator[Vl]:
    yield from _engine_over(vl_checkpoint("dense"), "dense")


@pytest.fixture(params=["moe", "dense"])
def vl_kind(request: Any) -> Vl:
    return request.getfixturevalue("vl" if request.param == "moe" else "vl_dense")


def _check(v: Vl, ids: list[int], images: list[ImageItem]) -> dict:
    assert v.engine is not None
    got = v.engine.generate(input_ids=ids, sampling_params=GREEDY, images=images or None, return_logprob=True)
    want, want_lp = v.hf_generate(ids, images)
    assert got["output_ids"] == want
    np.testing.assert_allclose([t[0] for t in got["meta_info"]["output_token_logprobs"]], want_lp, atol=LOGPROB_TOL)
    return got


def test_rope_index_and_tables_match_hf(vl: Vl) -> None:
    """Host positions equal HF get_rope_index (positions and delta); the interleaved M-RoPE tables equal HF's
    rotary embedding, and equal plain RoPE bit for bit when the three streams agree (text)."""
    ims = [vl.image(1, 16, 24), vl.image(2, 32, 24), vl.image(3, 8, 40)]
    for images, pre in (([], 9), (ims[:1], 0), (ims[:2], 5), (ims, 2)):
        ids = prompt(images, seed=7, pre=pre)
        kw = vl.hf_inputs(ids, images)
        hf_pos, hf_delta = vl.oracle.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"],
                                                          kw.get("image_grid_thw"))
        pos, delta = mrope_positions(ids, [im.grid_thw for im in images], PAD, 2)
        np.testing.assert_array_equal(pos.T, hf_pos[:, 0].numpy())
        assert delta == int(hf_delta[0, 0])
    config = vl.engine.model_config
    rotary = vl.oracle.model.language_model.rotary_emb
    x = torch.zeros(1, len(pos), 1)
    hf_cos, hf_sin = rotary(x, torch.from_numpy(pos.T[:, None].astype(np.int64)))
    cos, sin = mrope_cos_sin(jnp.asarray(pos[None]), config.rotary_dim, config.rope_theta, config.mrope_section)
    np.testing.assert_allclose(np.asarray(cos[0]), hf_cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin[0]), hf_sin[0].numpy(), atol=1e-6)
    text = jnp.arange(300, dtype=jnp.int32)[None] * 7
    plain = rope_cos_sin(text, config.rotary_dim, config.rope_theta)
    three = mrope_cos_sin(jnp.repeat(text[..., None], 3, -1), config.rotary_dim, config.rope_theta,
                          config.mrope_section)
    for a, b in zip(plain, three, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_images_match_hf(vl_kind: Vl) -> None:
    """Greedy tokens and logprobs equal HF with no image, one image, two images of different sizes and an image
    followed by a long text (chunks of 16 split the image and the text), on the MoE and the dense checkpoint;
    nothing compiles after ready."""
    vl = vl_kind
    before = compilation.jit_compilations()
    one, two = vl.image(1, 16, 24), vl.image(2, 32, 24)
    _check(vl, prompt([], seed=0), [])
    _check(vl, prompt([one], seed=1), [one])
    _check(vl, prompt([one, two], seed=2), [one, two])
    _check(vl, prompt([two], seed=3, pre=11, post=60), [two])
    assert compilation.jit_compilations() == before


def test_prefix_cache_keys_images(vl: Vl) -> None:
    """The same image at the same place hits past the image with the same tokens; the same text with another
    image of the same size misses from the image on and gives that image's (HF) tokens; each request's images
    are encoded once."""
    assert vl.engine is not None
    a, b = vl.image(11, 24, 24), vl.image(12, 24, 24)
    ids = prompt([a], seed=21, pre=6, post=9)
    image_start = ids.index(PAD)
    first = _check(vl, ids, [a])
    vl.encoded.clear()
    again = vl.engine.generate(input_ids=ids, sampling_params=GREEDY, images=[a])
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > image_start + a.num_tokens
    assert vl.encoded == []  # the hit covers the image: no encoding
    other = _check(vl, ids, [b])
    assert other["meta_info"]["cached_tokens"] <= image_start
    assert vl.encoded == [b.content_hash]
    # The images change the output enough that _check against HF tells a's state from b's.
    lps = [[t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in (first, other)]
    assert first["output_ids"] != other["output_ids"] or np.abs(np.subtract(*lps)).max() > 10 * LOGPROB_TOL


def test_bad_image_requests(vl: Vl) -> None:
    """Pad tokens that do not match the images, or pads without images, are a 400 (InvalidRequestError)."""
    assert vl.engine is not None
    one = vl.image(1, 16, 24)
    ids = prompt([one], seed=1)
    with pytest.raises(InvalidRequestError, match="2 images given"):
        vl.engine.generate(input_ids=ids, sampling_params=GREEDY, images=[one, one])
    with pytest.raises(InvalidRequestError, match="image tokens but no images"):
        vl.engine.generate(input_ids=ids, sampling_params=GREEDY)


def test_rewound_requests_keep_their_images(vl: Vl) -> None:
    """Two image requests in one batch whose decode step fails are rewound (memory freed, prompt + output
    prefilled again from position 0, as after a retraction: engine/scheduler/step_failures.py); each then ends
    with HF's tokens, so the re-prefill placed the images, their positions and the output tokens' rope delta."""
    assert vl.engine is not None
    one, two = vl.image(31, 16, 24), vl.image(32, 24, 16)
    images = [[one], [two]]
    prompts = [prompt(ims, seed=41 + i) for i, ims in enumerate(images)]  # equal lengths: they decode together
    # The 6th step with request a: both prompts (3 chunks at most each) are in, a decode step of both.
    fault = vl.engine.scheduler.faults.arm("forward", rid="rewind-a", skip=5)
    got = vl.engine.generate(input_ids=prompts, sampling_params=GREEDY, images=images, rid=["rewind-a", "rewind-b"])
    assert fault.times == 0  # it fired
    assert all(r["meta_info"]["completion_tokens"] == NEW for r in got)
    for reply, ids, ims in zip(got, prompts, images, strict=True):
        assert reply["output_ids"] == vl.hf_generate(ids, ims)[0]


def test_text_model_refuses_images(engine: Any, vl: Vl) -> None:
    """A text-only checkpoint (the session's embedded engine) answers images with a 400 and keeps its program
    set: no forward_mm programs, no rope-delta column."""
    with pytest.raises(InvalidRequestError, match="this model does not accept images"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, images=[vl.image(1, 16, 24)])
    assert not engine.model_config.has_vision
    assert not any(key[0] == "forward_mm" for key in engine.runner.program_keys())


def test_server_engine_with_its_vision_encoder(vl_engine: Any, vl_checkpoint: Any) -> None:
    """The engine a server starts on a VL checkpoint (tests/conftest.py vl_engine: the JAX VisionEncoder of the
    checkpoint, no encoder passed) accepts images and gives HF's greedy tokens for a prompt with two images."""
    v = Vl(vl_checkpoint("moe"))
    assert vl_engine.accepts_images and vl_engine.image_encoder is not None
    before = compilation.jit_compilations()
    one, two = v.image(51, 16, 24), v.image(52, 24, 16)
    ids = prompt([one, two], seed=61, post=4)
    got = vl_engine.generate(input_ids=ids, sampling_params=GREEDY, images=[one, two])
    assert compilation.jit_compilations() == before  # the tower's buckets and forward_mm were precompiled
    assert got["output_ids"] == v.hf_generate(ids, [one, two])[0]


def test_images_over_http(vl_engine: Any) -> None:
    """Over HTTP on the VL engine: /generate with image_data and the OpenAI chat route with an image_url part
    answer (200, the tokens asked for); the same /generate request again hits the cache past the image and
    gives the same tokens, another image gives another prompt's cache miss at the image; this mixed workload
    (text and image prompts, hits and misses, two routes) compiles nothing on the ready engine."""
    import base64
    import io

    import httpx
    from conftest import serve_app
    from PIL import Image

    from sglang_tpu_qwen.server.app import create_app

    def data_url(seed: int) -> str:
        px = np.random.default_rng(seed).integers(0, 256, (24, 16, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    # Long enough for whole pages after the image (the engine's context is 64 tokens).
    text = "<|vision_start|><|image_pad|><|vision_end|>" + "What is in the picture? " * 6
    body = {"text": text, "sampling_params": GREEDY}
    before = compilation.jit_compilations()
    with serve_app(create_app(vl_engine)) as base:
        first = httpx.post(f"{base}/generate", json=dict(body, image_data=data_url(1)), timeout=120)
        assert first.status_code == 200, first.text
        again = httpx.post(f"{base}/generate", json=dict(body, image_data=data_url(1)), timeout=120).json()
        other = httpx.post(f"{base}/generate", json=dict(body, image_data=data_url(2)), timeout=120).json()
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(1)}},
                                                      {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 3, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 3
        plain = httpx.post(f"{base}/generate", json={"text": "No picture here.", "sampling_params": GREEDY},
                           timeout=120)
        assert plain.status_code == 200, plain.text
    assert compilation.jit_compilations() == before
    first = first.json()
    assert len(first["output_ids"]) == NEW and again["output_ids"] == first["output_ids"]
    n_image = 2 * 3  # 24 x 16 pixels: a 6 x 4 patch grid, merged 2 x 2
    assert vl_engine.server_args.page_size <= 16
    assert again["meta_info"]["cached_tokens"] > 1 + n_image
    assert other["meta_info"]["cached_tokens"] <= 1

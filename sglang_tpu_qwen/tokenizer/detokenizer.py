"""Incremental (streaming) detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in `text[start:]`.

    Returns:
        (index in `text` where the stop string begins, the stop string), or None. On a tie at the same
        index the longest stop string wins.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (0 if none).

    That suffix must be held back while streaming: the next tokens may complete the stop string.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    Uses the prefix-offset / read-offset technique (as in HF text-generation-inference and vLLM): each
    push decodes the window `ids[prefix_offset:]` and compares it with the decoded
    `ids[prefix_offset:read_offset]`; the difference is new text, released only when it does not end in
    U+FFFD (a UTF-8 sequence split across byte-level tokens). Byte-level BPE decoding is context-free
    apart from UTF-8 boundaries, so the concatenated deltas equal `tokenizer.decode(all_ids)`.

    Stop strings: the released text is cut just before the first stop string (`stopped` becomes True,
    `matched_stop` holds it) and later pushes return "". Text that could be the start of a stop string
    is held back until the following tokens settle it.

    Args:
        tokenizer: the `Tokenizer` whose ids are pushed.
        stop: stop strings (None and empty strings are ignored).
        skip_special_tokens: drop special tokens (e.g. `<|im_end|>`) from the text.
        trim_stop: False keeps the matched stop string at the end of the text (SGLang `no_stop_trim`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Iterable[str] | None = (),
        skip_special_tokens: bool = True,
        trim_stop: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop: tuple[str, ...] = tuple(s for s in stop or () if s)
        self.skip_special_tokens = skip_special_tokens
        self.trim_stop = trim_stop
        self.token_ids: list[int] = []  # decoded so far (appended ids wait in _unread)
        self._unread: list[int] = []
        self.stopped = False
        self.matched_stop: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all safely decoded text so far (released + held back)
        self._released = 0  # chars of self._text already returned

    @property
    def text(self) -> str:
        """All text returned so far by `push` / `flush`."""
        return self._text[: self._released]

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated token ids; return the newly releasable text (possibly "")."""
        if self.stopped:
            return ""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        if self._unread:
            unread, self._unread = self._unread, []
            return "".join(self.push(t) for t in unread) + self.push(token_ids)
        self.token_ids.extend(token_ids)
        self._text += self._decode_new(final=False)
        return self._release(final=False)

    def append(self, token_ids: Iterable[int]) -> None:
        """Add generated token ids without decoding them: the next `push` or `flush` returns their text.

        For a reader that needs no text before the end (no streaming, no stop strings): `flush` decodes the
        whole output once instead of twice per token (a third of the scheduler thread's time per step at
        128 running requests, which shares the cores with the model on a CPU host). A `push` first replays
        them one by one, so it returns what per-token pushes would have (an abort reads the text so far).
        """
        if not self.stopped:
            self._unread.extend(token_ids)

    def flush(self) -> str:
        """End of generation: return everything held back (an unfinished UTF-8 sequence as U+FFFD)."""
        if self.stopped:
            return ""
        self.token_ids.extend(self._unread)
        self._unread = []
        self._text += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        decode = self.tokenizer.decode
        ids = self.token_ids
        if len(ids) == self._read_offset:
            return ""
        prefix = decode(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        window = decode(ids[self._prefix_offset :], self.skip_special_tokens)
        if not final and (len(window) <= len(prefix) or window.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return window[len(prefix) :]

    def _release(self, final: bool) -> str:
        start = self._released
        hit = find_stop(self._text, self.stop, start) if self.stop else None
        if hit is not None:
            index, stop = hit
            self.stopped = True
            self.matched_stop = stop
            end = index + len(stop) if not self.trim_stop else index
            self._text = self._text[:end]
            self._released = end
            return self._text[start:end]
        hold = 0 if final else partial_stop_len(self._text[start:], self.stop)
        self._released = len(self._text) - hold
        return self._text[start : self._released]

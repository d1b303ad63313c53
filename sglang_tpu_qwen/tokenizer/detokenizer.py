"""Incremental (streaming) detokenization with stop strings."""

from __future__ import annotations

import codecs
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
    """Turns a stream of generated token ids into a stream of text deltas that never stalls.

    Byte-level BPE (Qwen3.5; `tokenizer.byte_level`): `decode(ids)` is the concatenation of the tokens' bytes read
    as UTF-8 with invalid bytes as U+FFFD, so each push feeds the new tokens' bytes to an incremental UTF-8
    decoder (Python's, which substitutes maximal invalid subparts as `tokenizers` does). It holds back at most
    the 3 bytes of an unfinished character and releases everything else at once, a genuine U+FFFD or an invalid
    byte included; a push costs O(its own bytes), and the concatenated deltas equal `tokenizer.decode(all_ids)`.

    Other decoders: the prefix-offset / read-offset window of HF text-generation-inference and vLLM, with the
    window committed after `MAX_PENDING_TOKENS` tokens even if it still ends in U+FFFD (SGLang #34740 / #34852:
    an unbounded window re-decodes a growing tail every step and streams nothing). There the joined deltas can
    differ from a one-shot decode only where a character spans more than that many tokens.

    The text sent so far never shrinks and never repeats. Stop strings: the released text is cut just before
    the first stop string (`stopped` becomes True, `matched_stop` holds it) and later pushes return "". Text that
    could be the start of a stop string is held back (at most the longest stop string's length) until the
    following tokens settle it.

    Args:
        tokenizer: the `Tokenizer` whose ids are pushed.
        stop: stop strings (None and empty strings are ignored).
        skip_special_tokens: drop special tokens (e.g. `<|im_end|>`) from the text.
        trim_stop: False keeps the matched stop string at the end of the text (SGLang `no_stop_trim`).
    """

    MAX_PENDING_TOKENS = 8  # non-byte-level decoders only: a window this long is committed as it is

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
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if tokenizer.byte_level else None
        self._prefix_offset = 0  # window decoding (non-byte-level tokenizers)
        self._read_offset = 0
        self._held = ""  # decoded but not yet released: a possible start of a stop string
        self._released: list[str] = []  # every delta returned so far

    @property
    def text(self) -> str:
        """All text returned so far by `push` / `flush` (joins the deltas: O(length))."""
        return "".join(self._released)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated token ids; return the newly releasable text (possibly "")."""
        if self.stopped:
            return ""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        if self._unread:
            unread, self._unread = self._unread, []
            return "".join(self.push(t) for t in unread) + self.push(token_ids)
        new = list(token_ids)
        self.token_ids.extend(new)
        return self._release(self._decode_new(new, final=False), final=False)

    def append(self, token_ids: Iterable[int]) -> None:
        """Add generated token ids without decoding them: the next `push` or `flush` returns their text.

        For a reader that needs no text before the end (no streaming, no stop strings): `flush` decodes the
        whole output once instead of per token (a third of the scheduler thread's time per step at 128
        running requests, which shares the cores with the model on a CPU host). A `push` first replays
        them one by one, so it returns what per-token pushes would have (an abort reads the text so far).
        """
        if not self.stopped:
            self._unread.extend(token_ids)

    def flush(self) -> str:
        """End of generation: return everything held back (an unfinished UTF-8 sequence as U+FFFD)."""
        if self.stopped:
            return ""
        new, self._unread = self._unread, []
        self.token_ids.extend(new)
        return self._release(self._decode_new(new, final=True), final=True)

    def _decode_new(self, new: list[int], final: bool) -> str:
        if self._utf8 is not None:
            skip = self.skip_special_tokens
            data = b"".join(self.tokenizer.token_bytes(t, skip) for t in new)
            return self._utf8.decode(data, final)
        return self._decode_window(final)

    def _decode_window(self, final: bool) -> str:
        decode = self.tokenizer.decode
        ids = self.token_ids
        if len(ids) == self._read_offset:
            return ""
        prefix = decode(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        window = decode(ids[self._prefix_offset :], self.skip_special_tokens)
        bounded = len(ids) - self._read_offset >= self.MAX_PENDING_TOKENS
        if not final and not bounded and (len(window) <= len(prefix) or window.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return window[len(prefix) :]

    def _release(self, new: str, final: bool) -> str:
        held = self._held + new
        hit = find_stop(held, self.stop) if self.stop else None
        if hit is not None:
            index, stop = hit
            self.stopped = True
            self.matched_stop = stop
            out = held[: index + len(stop) if not self.trim_stop else index]
            self._held = ""
        else:
            hold = 0 if final else partial_stop_len(held, self.stop)
            out, self._held = held[: len(held) - hold], held[len(held) - hold :]
        if out:
            self._released.append(out)
        return out

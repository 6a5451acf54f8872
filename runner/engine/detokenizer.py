"""Incremental detokenization and stop strings, per request (vLLM's ``vllm/v1/engine/detokenizer.py``).

Each step decodes a short window of ids twice (text-generation-inference's prefix/read offsets) and emits the
difference, holding tokens back while they end in half a UTF-8 character. The first of the two decodes is most
often that of the one token emitted last: its text comes from a table shared by the requests of one engine
(``token_texts``), so a step costs one decode per request. With a byte-level tokenizer (``byte_level.py``)
the same rule reads the window's text from its tokens' bytes instead (Python's UTF-8 decode of a few bytes, the
same text as the tokenizer's), with no call into the tokenizer at all; a window holding an added token (a
special token) is decoded by the tokenizer, as before. The earliest stop string to
complete wins; while streaming, the last ``max(len(stop)) - 1`` characters are held back because text once
sent cannot be taken back. Design: docs/design_notes.md, "Engine client".
"""
from __future__ import annotations

from collections.abc import Sequence

from runner.engine.byte_level import ByteLevelTable
from runner.engine.tokenizer import Tokenizer, make_decoder
from runner.sampling_params import SamplingParams

# How many prompt tokens before the first output token the window starts with (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET); two more are kept in case some of them are special tokens.
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, new_chars: int, stop: Sequence[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that completed within the last ``new_chars`` characters of ``text`` and where to cut
    the text (its start, or its end with ``include_in_output``); None if none did."""
    if not new_chars or not stop:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        # a match must end inside the new characters: start at most len(s) - 1 characters before them
        start = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, s)
    if best is None:
        return None
    start, s = best
    return s, start + len(s) if include_in_output else start


class IncrementalDetokenizer:
    """One request's output text. ``tokenizer`` None: no text (token ids only), and no stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams,
                 token_texts: dict[int, str] | None = None, byte_table: ByteLevelTable | None = None) -> None:
        """``token_texts``: single tokens' texts decoded with these ``params``' decoding options (skip and
        spacing of special tokens), shared by the requests that decode alike; filled as tokens come.
        ``byte_table``: ``byte_level.byte_level_table(tokenizer)``, shared by every request (None: decode with
        the tokenizer only)."""
        if params.stop and tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to find them in the text, and this "
                             "model has none; use stop_token_ids")
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else make_decoder(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._prefix_text: str | None = None  # decode of window[prefix:read], while it stays the same
        self._token_texts = {} if token_texts is None else token_texts
        self.stop = list(params.stop or ())  # a list once SamplingParams is built
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = params.output_text_buffer_length
        self.token_ids: list[int] = []  # every output token, decoded or not
        self.output_text = ""
        self._last_output_text_offset = 0
        # the decode window: the prompt's last tokens, then the outputs (a bad prompt never gets outputs)
        tail = list(prompt_token_ids[-(INITIAL_OFFSET + 2):]) if isinstance(prompt_token_ids, list) else []
        self._window: list[int] = [t for t in tail if isinstance(t, int)]
        self._read_offset = len(self._window)
        self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)
        # Byte-level decoding: while every token of window[prefix:] has bytes in the table, _prefix_bytes holds
        # window[prefix:read]'s, _pending_bytes window[read:]'s and _prefix_text their decode. _by_bytes None:
        # not looked at yet (the prompt's tail is looked at with the first outputs); False: the tokenizer decodes.
        self._byte_table = byte_table if tokenizer is not None else None
        self._by_bytes: bool | None = None if self._byte_table is not None else False
        self._prefix_bytes = self._pending_bytes = b""
        self._prefix_valid = False  # _prefix_bytes is valid UTF-8 (so its text needs no decode again)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Take a step's new tokens; returns the stop string that ended the request, if one did.
        ``stop_terminated``: the engine core stopped the request on its last token (EOS or a stop token)."""
        if not new_token_ids:
            return None
        self.token_ids += new_token_ids
        if self.tokenizer is None:
            return None
        to_decode = new_token_ids  # only read
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        before = len(self.output_text)
        if self._by_bytes is None:
            self._window_to_bytes()
        window = self._window
        for token in to_decode:
            window.append(token)
            text = self._bytes_next(token) if self._by_bytes else self._decode_next()
            if text:
                self.output_text += text
        if stop_terminated or not self.stop:
            return None
        found = find_stop_string(self.output_text, len(self.output_text) - before, self.stop,
                                 self.include_stop_str_in_output)
        if found is None:
            return None
        stop_string, cut = found
        self.output_text = self.output_text[:cut]
        return stop_string

    def _window_to_bytes(self) -> None:
        """Decode from the tokens' bytes from now on if every token of window[prefix:] has some."""
        assert self._byte_table is not None  # only with a byte-level tokenizer
        pieces = [self._byte_table.get(t) for t in self._window[self._prefix_offset:]]
        if any(p is None for p in pieces):
            self._by_bytes = False
            return
        split = self._read_offset - self._prefix_offset
        self._prefix_bytes = b"".join(pieces[:split])  # type: ignore[arg-type]  # no None: checked above
        self._pending_bytes = b"".join(pieces[split:])  # type: ignore[arg-type]
        self._set_prefix_text()
        self._by_bytes = True

    def _set_prefix_text(self) -> None:
        """_prefix_text from _prefix_bytes, and whether those are valid UTF-8 (_prefix_valid: no U+FFFD in the
        text; bytes of a real U+FFFD count as invalid too, which only sends the next token down the longer way)."""
        self._prefix_text = text = self._prefix_bytes.decode("utf-8", "replace")
        self._prefix_valid = REPLACEMENT_CHAR not in text

    def _bytes_next(self, token: int) -> str:
        """:meth:`_decode_next` on the window's bytes: the same two texts, decoded by Python from bytes."""
        assert self._byte_table is not None and self._prefix_text is not None  # set with _by_bytes
        piece = self._byte_table.get(token)
        if piece is None:  # an added token: the tokenizer decodes from here on
            self._by_bytes = False
            return self._decode_next()
        pending = self._pending_bytes + piece
        new = pending.decode("utf-8", "replace")
        if self._prefix_valid:
            # valid UTF-8 ends where a character does: the window's text is the prefix's text + new, and the
            # rule below on it reads on new alone
            if not new or new[-1] == REPLACEMENT_CHAR:
                self._pending_bytes = pending
                return ""
            emitted = new
        else:
            prefix_text = self._prefix_text
            new_text = (self._prefix_bytes + pending).decode("utf-8", "replace")
            if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
                self._pending_bytes = pending
                return ""
            emitted = new_text[len(prefix_text):]
        # emitted: the prefix moves to the read offset (its bytes are pending's, its text new), the read offset
        # to the window's end, and what lies before the prefix is dropped
        window, prefix = self._window, self._prefix_offset
        self._prefix_text, self._prefix_valid = new, REPLACEMENT_CHAR not in new
        self._prefix_bytes, self._pending_bytes = pending, b""
        if prefix > 0:
            del window[:prefix]
        self._prefix_offset, self._read_offset = self._read_offset - prefix, len(window)
        return emitted

    def _decode_next(self) -> str:
        assert self._decode is not None  # only with a tokenizer
        window, prefix, read = self._window, self._prefix_offset, self._read_offset
        if self._prefix_text is None:
            if read - prefix == 1:
                token = window[prefix]
                text = self._token_texts.get(token)
                if text is None:
                    text = self._token_texts[token] = self._decode(window[prefix:read])
                self._prefix_text = text
            else:
                self._prefix_text = self._decode(window[prefix:read])
        prefix_text = self._prefix_text
        new_text = self._decode(window[prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing yet, or a character still arriving: wait for the next token
        self._prefix_offset, self._read_offset, self._prefix_text = read, len(window), None
        if prefix > 0:  # keep the window short: what lies before prefix_offset is never decoded again
            del window[:prefix]
            self._prefix_offset -= prefix
            self._read_offset -= prefix
        if self._byte_table is not None:
            self._window_to_bytes()  # back to bytes once the window holds no added token
        return new_text[len(prefix_text):]

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (``delta`` False) or what is new since the last call, less the
        characters held back for a stop string while the request runs."""
        length = len(self.output_text)
        if not finished and self.stop_buffer_length:
            length = max(0, length - self.stop_buffer_length)
        if not delta:
            return self.output_text[:length]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]

"""Stream chunks without a pydantic model per chunk: each kind of chunk is rendered once through its model with a
marker in every varying field, split around the markers, and filled per chunk with the values encoded as JSON.
The bytes are those the model path writes (the test compares them); what varies only per request (its id and
creation time) is filled once per request (:meth:`ChunkTemplate.bind`), leaving the text of a token to encode.

Markers: a string field gets a string no text holds (NUL-delimited); an integer field a 19-digit number no chunk
holds otherwise; a field that is a string, a number or null (``stop_reason``) a string marker whose JSON string,
quotes included, is replaced by the value's JSON. A marker that does not appear exactly once is an error, raised
when the template is built.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring  # C-accelerated; ensure_ascii=False
from typing import Literal

SlotKind = Literal["str", "int", "json"]
Value = str | int | None
_INT_MARK_BASE = 7_071_067_811_865_475_000


def _encode(kind: SlotKind, value: Value) -> str:
    if kind == "str":
        assert isinstance(value, str)
        return encode_basestring(value)
    if kind == "int":
        assert isinstance(value, int)
        return str(value)
    if value is None:  # the usual stop_reason: json.dumps would build an encoder for it
        return "null"
    return json.dumps(value, ensure_ascii=False)


class ChunkTemplate:
    """``pieces``: literal text and slot names, alternating as they appear in the chunk."""

    def __init__(self, pieces: list[str], slots: list[str], kinds: dict[str, SlotKind]) -> None:
        self._pieces = pieces  # len(slots) + 1 literals
        self._slots = slots  # the slot between pieces[k] and pieces[k + 1]
        self._kinds = kinds

    @classmethod
    def render(cls, render: Callable[..., str], kinds: dict[str, SlotKind]) -> ChunkTemplate:
        """The template of ``render(**values)`` (an event rendered through its model) for the fields in ``kinds``."""
        markers: dict[str, Value] = {}
        found_as: dict[str, str] = {}  # how each marker reads in the rendered chunk
        for k, (name, kind) in enumerate(kinds.items()):
            if kind == "int":
                markers[name] = _INT_MARK_BASE + k
                found_as[name] = str(_INT_MARK_BASE + k)
            else:
                marker = f"\x00ubatch-{name}\x00"
                markers[name] = marker
                found_as[name] = encode_basestring(marker)
        text = render(**markers)
        found: list[tuple[int, int, str]] = []  # (start, end, slot)
        for name, mark in found_as.items():
            start = text.find(mark)
            if start == -1 or text.find(mark, start + 1) != -1:
                raise RuntimeError(f"the stream chunk template does not hold its {name!r} field exactly once: {text!r}")
            found.append((start, start + len(mark), name))
        found.sort()
        pieces, slots, at = [], [], 0
        for start, end, name in found:
            pieces.append(text[at:start])
            slots.append(name)
            at = end
        pieces.append(text[at:])
        return cls(pieces, slots, dict(kinds))

    def bind(self, **values: Value) -> ChunkTemplate:
        """This template with these fields filled."""
        pieces, slots = [self._pieces[0]], []
        for slot, piece in zip(self._slots, self._pieces[1:], strict=True):
            if slot in values:
                pieces[-1] += _encode(self._kinds[slot], values[slot]) + piece
            else:
                slots.append(slot)
                pieces.append(piece)
        return ChunkTemplate(pieces, slots, {s: self._kinds[s] for s in slots})

    def fill(self, **values: Value) -> str:
        """The chunk with every remaining field filled."""
        if set(values) != set(self._slots):
            raise ValueError(f"the chunk template has fields {self._slots}, got {sorted(values)}")
        out = [self._pieces[0]]
        for slot, piece in zip(self._slots, self._pieces[1:], strict=True):
            out.append(_encode(self._kinds[slot], values[slot]))
            out.append(piece)
        return "".join(out)

    def around(self, slot: str) -> tuple[str, str]:
        """(head, tail) around the one field left, a string: a chunk is ``head + encode_basestring(value) + tail``."""
        if self._slots != [slot] or self._kinds[slot] != "str":
            raise ValueError(f"the chunk template has fields {self._slots}, not only the string {slot!r}")
        return self._pieces[0], self._pieces[1]

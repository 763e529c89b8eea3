"""A forgiving reader for the JSON that vendor tools print. Pure.

Real `hy-smi --json` on BW nodes prints objects with commas missing between keys, the same
`"": ""` pair twice per card, and sometimes plain text around the JSON (recorded in
tests/fixtures/real/hygon/). Strict `json.loads` refuses all of that, and a whole node would read
as unknown. This reader recovers every key/value pair it can: a missing comma, an empty key, a
bare value (`41.0C`), text outside the braces and a truncated object are noted in `repairs` and
read around. Only text with no object in it at all is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_STOP = frozenset(',}]"\n')
_DECODER = json.JSONDecoder()


class NotJsonError(ValueError):
    """No JSON object in the text at all."""


@dataclass(frozen=True)
class LenientJson:
    data: Mapping[str, Any]  # every top-level object's pairs, later objects winning
    repairs: tuple[str, ...] = ()  # what was not strict JSON and how it was read, once each


def read_lenient_json(text: str) -> LenientJson:
    try:
        data: object = json.loads(text)
    except json.JSONDecodeError:
        pass
    else:
        if isinstance(data, dict):
            return LenientJson(data=data)
        msg = f"expected a JSON object, got {type(data).__name__}"
        raise NotJsonError(msg)
    scanner = _Scanner(text)
    merged = scanner.top_level()
    if not scanner.found:
        raise NotJsonError("no JSON object in the output")
    return LenientJson(data=merged, repairs=tuple(scanner.repairs))


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.found = False
        self.repairs: list[str] = []

    def note(self, repair: str) -> None:
        if repair not in self.repairs:
            self.repairs.append(repair)

    def top_level(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        while (start := self.text.find("{", self.pos)) >= 0:
            if self.text[self.pos : start].strip():
                self.note("text outside the JSON object ignored")
            self.pos = start
            self.found = True
            merged.update(self.object())
        if self.text[self.pos :].strip():
            self.note("text outside the JSON object ignored")
        return merged

    def object(self) -> dict[str, Any]:
        self.pos += 1  # the opening brace
        result: dict[str, Any] = {}
        after_pair = False
        while (char := self.peek()) is not None:
            if char == "}":
                self.pos += 1
                return result
            if char == ",":
                self.pos += 1
                after_pair = False
            elif char == '"':
                if after_pair:
                    self.note("missing comma between keys")
                self.pair(result)
                after_pair = True
            else:
                self.note("unreadable text inside an object skipped")
                self.skip_to(',"}')
        self.note("object not closed")
        return result

    def pair(self, into: dict[str, Any]) -> None:
        key = self.string()
        if self.peek() != ":":
            self.note("key without a value skipped")
            return
        self.pos += 1
        value = self.value()
        if key == "":
            self.note("empty keys dropped")
        elif key in into:
            self.note(f"repeated key {key!r}: the last value kept")
            into[key] = value
        else:
            into[key] = value

    def value(self) -> Any:
        char = self.peek()
        if char == '"':
            return self.string()
        if char == "{":
            return self.object()
        if char == "[":
            return self.array()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _STOP:
            self.pos += 1
        bare = self.text[start : self.pos].strip()
        if bare and bare not in ("null", "true", "false") and not _is_number(bare):
            self.note("bare values read as text")
        return bare or None

    def array(self) -> list[Any]:
        self.pos += 1
        items: list[Any] = []
        while (char := self.peek()) is not None:
            if char == "]":
                self.pos += 1
                return items
            if char == ",":
                self.pos += 1
                continue
            if char == "}":
                break  # the enclosing object ends: the array was not closed
            before = self.pos
            items.append(self.value())
            if self.pos == before:
                self.pos += 1
        self.note("array not closed")
        return items

    def string(self) -> str:
        try:
            value, end = _DECODER.raw_decode(self.text, self.pos)  # a JSON string at pos
        except ValueError:
            end = self.text.find("\n", self.pos + 1)
            end = len(self.text) if end < 0 else end
            value = self.text[self.pos + 1 : end].rstrip('"')
            self.note("unterminated string read to the end of its line")
        self.pos = end
        return str(value)

    def peek(self) -> str | None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else None

    def skip_to(self, stops: str) -> None:
        while self.pos < len(self.text) and self.text[self.pos] not in stops:
            self.pos += 1


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

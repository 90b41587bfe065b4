"""Profile overrides written as ``section.key=value``: the one parser of them (``tierflow --set ssd.count=6``,
the ``overrides`` column of a runs file, ``tierflow calibrate --set``) and the loader of a profile with its
overrides applied.

    >>> parse_overrides(["ssd.count=6", "cpu.memory_gib = 256"])
    {'ssd.count': '6', 'cpu.memory_gib': '256'}
    >>> load_hw("rtx4090-lohan", ["ssd.count=6"]).name
    'rtx4090-lohan[ssd.count=6]'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .profile import HardwareProfile, ProfileError, load_profile, parse_number

SET_SYNTAX = "--set {item!r}: expected section.key=value, e.g. --set ssd.count=6"


class OverrideError(ProfileError):
    """An override that is not section.key=value (one line, exit code 2)."""


def parse_overrides(items: Iterable[str] | None, bad: str = SET_SYNTAX, *, need_dot: bool = False,
                    need_value: bool = False, typed: bool = False) -> dict[str, Any]:
    """``section.key=value`` items -> {"section.key": value}, key and value stripped, in order.

    A malformed item raises OverrideError(bad.format(item=item)): one without "=", with ``need_dot`` one
    whose key has no ".", with ``need_value`` one with an empty key or value. Values stay text
    (with_overrides parses them) unless ``typed``: then numbers become numbers, null / none None."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or (need_dot and "." not in key) or (need_value and not (key and value)):
            raise OverrideError(bad.format(item=item))
        out[key] = typed_value(value) if typed else value
    return out


def typed_value(text: str) -> Any:
    """An override's text as a value: an int, else a float, None for null / none, else the text."""
    if text.lower() in ("null", "none"):
        return None
    number = parse_number(text)
    return text if number is None else number


def load_hw(name: str, overrides: Iterable[str] | None) -> HardwareProfile:
    """The profile ``name`` (bundled name or YAML path) with ``--set`` items applied."""
    hw = load_profile(name)
    ov = parse_overrides(overrides)
    return hw.with_overrides(ov) if ov else hw

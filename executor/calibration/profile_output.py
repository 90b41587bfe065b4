"""A calibration's output: the table of fields and their sources, and the profile YAML with a comment per
field (measured / derived / from the base)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tierflow.executor.calibration.profile_builder import Calibration
from tierflow.hwprofiles import load_profile, save_profile
from tierflow.hwprofiles.profile import format_value


def format_table(cal: Calibration) -> str:
    rows = [[f.key, format_value(f.value), f.source, f.note] for f in cal.fields]
    header = ["field", "value", "source", "note"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]

    def line(r: list[str]) -> str:
        return "  ".join([r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].ljust(widths[2]), r[3]]).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths] + ["----"]), *map(line, rows)])


def write_profile(cal: Calibration, path: str | os.PathLike[str]) -> None:
    """save_profile, then a comment per field (measured / derived / from base); plain if comments would
    break it."""
    save_profile(cal.profile, path)
    plain = Path(path).read_text(encoding="utf-8")
    notes = {f.key: f"{f.source}{': ' + f.note if f.note else ''}" for f in cal.fields}
    lines = plain.splitlines()
    printable = lambda text: re.sub(r"[^\x20-\x7e]", "?", text)  # noqa: E731
    out, section = [], ""
    key_re, section_re = re.compile(r"^  ([a-z0-9_]+): \S"), re.compile(r"^([a-z_]+):\s*$")
    for i, text in enumerate(lines):
        if section_re.match(text):
            section = section_re.match(text).group(1)
        m = key_re.match(text)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        single_line = not nxt.startswith("   ") and "#" not in text
        if m and single_line and f"{section}.{m.group(1)}" in notes:
            comment = printable(notes[f"{section}.{m.group(1)}"])
            text = f"{text}  # {comment}"
        out.append(text)
    header = [f"# not measured (null with its reason, or a default or price of {cal.base_name}; see each "
              f"field): {', '.join(cal.not_measured) or 'none'}"]
    header += [f"# note: {printable(n)}" for n in cal.notes]
    annotated = "\n".join([*out[:2], *header, *out[2:]]) + "\n"
    Path(path).write_text(annotated, encoding="utf-8")
    try:
        ok = load_profile(Path(path)).to_dict() == cal.profile.to_dict()
    except ValueError:
        ok = False
    if not ok:
        Path(path).write_text(plain, encoding="utf-8")

"""Times as people read them: the one formatter of a duration in seconds for every line tierflow prints, in
the unit that fits its size (s from one second up, else ms, us or ns), so that a tiny model's 0.2 ms iteration
does not print as "0.00 s"."""

from __future__ import annotations

import math

# (unit, seconds per unit), largest first: the first whose value is >= 1 is used
_UNITS = (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def fmt_s(seconds: float, decimals: int = 2, sig: int = 3) -> str:
    """`seconds` as text: from one second up with `decimals` decimals and thousands separators ("1,199.35 s"),
    below in ms / us / ns with `sig` significant digits ("185 us", "1.23 ms"); 0 is "0 s"."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds == 0:
        return "0 s"
    rounded = float(f"{seconds:.{sig}g}")  # 0.00099996 -> 0.001: 1.00 ms, not 1,000 us
    if abs(rounded) >= 1:
        return f"{seconds:,.{decimals}f} s"
    unit, per = next(((u, p) for u, p in _UNITS if abs(rounded) >= p), _UNITS[-1])
    value = rounded / per
    places = max(sig - 1 - math.floor(math.log10(abs(value))), 0)
    return f"{value:,.{places}f} {unit}"

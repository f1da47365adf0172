"""How dtprof writes numbers, times, fractions and bytes: the one place for it, used by every renderer.

Two registers, each kept as its readers know it: the report page's (``fmt_*``: "12.3 ms", "37.0 %", "n/a" for a
missing value; its cards and tables) and the terminal summary's (``short_s``, ``pct``, ``saving``: "12.3 ms", "37%",
"—" for a missing value; the per-rank table's narrow columns).
"""
from __future__ import annotations

import html
import math


def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt_s(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    x = float(x)
    if abs(x) >= 100:
        return f"{x:,.0f} s"
    if abs(x) >= 1:
        return f"{x:.2f} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def fmt_frac(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * float(x):.1f} %"


def fmt_bytes(b) -> str:
    try:
        b = float(b)
    except TypeError:   # None, pd.NA
        return "–"
    if math.isnan(b):
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            break
        b /= 1024
    return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"


def fmt_rate(x, unit: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    x = float(x)
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {suffix}{unit}"
    return f"{x:.1f} {unit}"


def fmt_value(x, kind: str, unit: str = "") -> str:
    return {"frac": fmt_frac, "s": fmt_s}.get(kind, lambda v: fmt_rate(v, unit))(x)


def fmt_evidence(evidence) -> str:
    """A finding's evidence (the numbers that triggered it, keyed as in summary.json's findings) as "key value"
    pairs, each in its key's unit: a ``frac`` a percentage, ``*_s`` and ``*s_per_step`` (a word of its own) a time,
    ``*_bytes`` bytes."""
    def value(key: str, v) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} {value(key, x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)):
            return ", ".join(value(key, x) for x in v) if v else "none"
        if v is None:
            return "n/a"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v)
        words = key.split("_")
        if "frac" in words:
            return fmt_frac(v)
        if words[-1] == "s" or words[-3:] == ["s", "per", "step"]:     # not kernels_per_step
            return fmt_s(v)
        if key.endswith("_bytes"):
            return fmt_bytes(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    if not isinstance(evidence, dict):
        return str(evidence)
    return " · ".join(f"{k} {value(k, v)}" for k, v in evidence.items())


# ---- the terminal summary
def short_s(x) -> str:
    if x is None or x != x:   # None, or NaN (a rank that did not report the figure)
        return "—"
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"


def saving(frac: float) -> str:
    """A predicted saving as a change of the step: "-47%"; a scenario that saves nothing or a little less: "+0%"
    (it read "--0%")."""
    return f"{'-' if frac >= 0 else '+'}{abs(frac):.0%}"


def fmt_num(x) -> str:
    """A loss, a gradient norm or a learning rate: 4 significant digits; "n/a" when unknown."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{float(x):.4g}"

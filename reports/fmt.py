"""How dtprof writes numbers, times, fractions and bytes: the one place for it, used by every renderer. No module of
reports/ but this one holds a format spec (tests/unit/test_layers.py); a missing value is ``MISSING`` everywhere.

Two registers, each kept as its readers know it: the report page's (``fmt_*``: "12.3 ms", "37.0 %"; its cards and
tables) and the terminal's (``short_s``, ``pct``, ``saving``: "12.3 ms", "37%"; the per-rank table's narrow
columns, padded by ``rjust``/``ljust``).
"""
from __future__ import annotations

import html
import math
from numbers import Integral

MISSING = "n/a"


def missing(x) -> bool:
    """None or NaN: a value the analysis does not know."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt_s(x) -> str:
    if missing(x):
        return MISSING
    x = float(x)
    if abs(x) >= 100:
        return f"{x:,.0f} s"
    if abs(x) >= 1:
        return f"{x:.2f} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def fmt_frac(x) -> str:
    return MISSING if missing(x) else f"{100 * float(x):.1f} %"


def fmt_bytes(b) -> str:
    """A byte count in binary units, "512 B", "1.5 GiB" (also in triage's sentences: analyzers/triage.py)."""
    try:
        b = float(b)
    except TypeError:   # None, pd.NA
        return MISSING
    if math.isnan(b):
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            break
        b /= 1024
    return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"


def fmt_rate(x, unit: str) -> str:
    if missing(x):
        return MISSING
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
            return MISSING
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
        return MISSING
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def pct(x) -> str:
    return MISSING if missing(x) else f"{x:.0%}"


def saving(frac: float) -> str:
    """A predicted saving as a change of the step: "-47%"; a scenario that saves nothing or a little less: "+0%"
    (it read "--0%")."""
    return f"{'-' if frac >= 0 else '+'}{abs(frac):.0%}"


def fmt_num(x) -> str:
    """A loss, a gradient norm or a learning rate: 4 significant digits."""
    return MISSING if missing(x) else f"{float(x):.4g}"


# ---- plain numbers, for the sentences and tables around the formatters above
def pct1(x) -> str:
    """A fraction as a percentage with one decimal, "37.1%" (the terminal's register)."""
    return MISSING if missing(x) else f"{x:.1%}"


def signed_pct(x) -> str:
    """A relative change, "+5%", "-12%"."""
    return MISSING if missing(x) else f"{x:+.0%}"


def ms(x, digits: int = 1, signed: bool = False) -> str:
    """Seconds as milliseconds with a fixed number of decimals, "12.3 ms" (signed: "+0.4 ms")."""
    return MISSING if missing(x) else f"{x * 1e3:{'+' if signed else ''}.{digits}f} ms"


def signed_ms(x) -> str:
    """A change of a time, "+0.4 ms", "-12.0 ms"."""
    return ms(x, signed=True)


def fine_s(x) -> str:
    """A kernel's time: "1.25 ms", or below a millisecond "830.2 µs"."""
    if missing(x):
        return MISSING
    return f"{x * 1e3:.2f} ms" if x >= 1e-3 else f"{x * 1e6:.1f} µs"


def fixed(x, digits: int = 1, signed: bool = False, unit: str = "") -> str:
    """A number with ``digits`` decimals and its unit after a space, "3.14", "250 W" (signed: "+3.14")."""
    if missing(x):
        return MISSING
    return f"{x:{'+' if signed else ''}.{digits}f}" + (f" {unit}" if unit else "")


def plain(x) -> str:
    """A value as it is (a rank, a step), or ``MISSING``."""
    return MISSING if missing(x) else str(x)


def sig(x, signed: bool = False) -> str:
    """A number with 4 significant digits, "0.1235", "1.2e+04" (signed: "+0.1235")."""
    return MISSING if missing(x) else f"{x:{'+' if signed else ''}.4g}"


def count(x) -> str:
    """A count with thousands separators, "16,384" (a float rounded to a whole number)."""
    if missing(x):
        return MISSING
    return f"{x:,}" if isinstance(x, Integral) else f"{x:,.0f}"


def mib(b) -> str:
    """Bytes in MiB, one decimal: "12.5 MiB"."""
    return MISSING if missing(b) else f"{b / 2**20:.1f} MiB"


def rjust(x, width: int) -> str:
    """A table cell right-aligned in ``width`` characters."""
    return str(x).rjust(width)


def ljust(x, width: int) -> str:
    """A table cell left-aligned in ``width`` characters."""
    return str(x).ljust(width)

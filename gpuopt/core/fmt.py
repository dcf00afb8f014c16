"""How gpuopt writes numbers for people: one module for the sweep summary and the report."""

from __future__ import annotations

import math
from typing import Any

from gpuopt.core.limits import HighestLimit, higher_elsewhere
from gpuopt.core.metrics import unit as unit_of


def value(value: Any) -> str:
    """Any value, compactly: 4 significant digits for floats, YAML-style true/false/null."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def metric(name: str, number: float | None, unit: bool = True) -> str:
    """A metric value with its unit (gpuopt.core.metrics); `unit=False` in table cells whose
    header names the unit. Percentages to 0.1, large numbers with thousands separators."""
    if number is None:
        return "-"
    suffix = unit_of(name)
    if suffix == "%":
        return f"{number:.1f}%"
    text = f"{number:,.0f}" if abs(number) >= 100 else f"{number:.3g}"
    return f"{text} {suffix}".rstrip() if unit else text


def fixed(number: Any, unit: str = "", digits: int = 2) -> str:
    """A float to a fixed number of decimals with thousands separators (the single-run table);
    other values as they are; - when unknown."""
    if number is None:
        return "-"
    if isinstance(number, float):
        return f"{number:,.{digits}f}{unit}"
    return f"{number}{unit}"


def duration(seconds: float | None) -> str:
    """h:mm:ss (m:ss under an hour); ? when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def limit_share(attrs: dict[str, Any], highest: HighestLimit | None = None) -> str | None:
    """A trial's share of the machine's limit at its settings, in words (None: not measured), and
    where the study's `highest` limit is clearly above its own."""
    share, limit = attrs.get("limit_efficiency"), attrs.get("limit_throughput")
    if not isinstance(share, (int, float)) or not isinstance(limit, (int, float)):
        return None
    bound = attrs.get("limit_bound")
    by = f", bound by {bound}" if bound else ""
    rate = metric("limit_throughput", limit)
    text = f"{share:.0f}% of this machine's limit for this workload ({rate}{by})"
    if highest is not None and higher_elsewhere(attrs, highest):
        up_to = metric("limit_throughput", highest.throughput)
        text += f"; other settings measured a limit up to {up_to} (trial #{highest.trial})"
    return text

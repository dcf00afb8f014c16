"""How gpuopt writes numbers for people: one module for the sweep summary and the report.

Torch-free and dependency-free (the sweeping process and the report both use it).
"""

from __future__ import annotations

import math
from typing import Any

from gpuopt.core.limits import HighestLimit, higher_elsewhere

# Display unit per metric; percentages are differences in points, the rest ratios.
METRIC_UNITS = {
    "throughput": "samples/s",
    "ceiling_throughput": "samples/s",
    "step_time_ms": "ms",
    "utilization": "%",
    "data_wait": "%",
    "mfu": "%",
    "input_efficiency": "%",
    "peak_memory_mb": "MB",
    "energy_per_sample_j": "J",
    "power_w": "W",
    "compile_time_s": "s",
}


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
    """A metric value with its unit (METRIC_UNITS); `unit=False` in table cells whose header
    names the unit. Percentages to 0.1, large numbers with thousands separators."""
    if number is None:
        return "-"
    suffix = METRIC_UNITS.get(name, "")
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


def speedup_ci(entry: dict[str, Any]) -> str:
    """A stored speedup (confirm.speedup as a dict): ratio, 95% CI, its half-width, the pairs,
    the verdict; "too noisy here" with the spread and the load instead of an interval too wide to
    act on. Older records (no pairs, no verdict) read as before."""
    if "ratio" not in entry:
        return entry.get("error", "n/a")
    ratio = entry["ratio"]
    if entry.get("ci_low") is None:
        return f"{ratio:.3f}x (no CI: needs >= 2 measurements each)"
    if entry.get("verdict") == "too noisy":
        return _too_noisy(entry)
    pairs = entry.get("n_pairs")
    sample = f"{pairs} pairs" if pairs else f"n={entry['n_candidate']}/{entry['n_reference']}"
    width = "" if entry.get("halfwidth") is None else f", +-{_percent(entry['halfwidth'])}"
    verdict = "" if entry.get("distinguishable") else ", not distinguishable from 1.0x"
    return (
        f"{ratio:.3f}x [95% CI {entry['ci_low']:.3f}-{entry['ci_high']:.3f}{width}, "
        f"{sample}{verdict}]"
    )


def _too_noisy(entry: dict[str, Any]) -> str:
    """The "too noisy here" verdict: what was seen (spread of the pairs' log-ratios, the load),
    and what a +-target interval would take."""
    seen = f"{entry['n_pairs']} pairs' log-ratios spread {_percent(entry.get('log_sd') or 0.0)}"
    load = entry.get("load_1m")
    if load:
        seen += f", load {load[0]:.1f}-{load[1]:.1f} on {entry.get('cpus', '?')} CPUs"
    steal = entry.get("steal_pct")
    if steal is not None and steal >= 0.5:
        seen += f", {steal:.0f}% of the CPU time taken by the hypervisor"
    need = entry.get("pairs_needed")
    target = entry.get("target_halfwidth")
    goal = f" to +-{_percent(target)}" if target else ""
    more = f"; ~{need} pairs would narrow it{goal} (confirm.max_share)" if need else ""
    return (
        f"too noisy here: {entry['ratio']:.2f}x +-{_percent(entry.get('halfwidth') or 0.0)} "
        f"(95% CI) is no answer ({seen}){more}"
    )


def _percent(fraction: float) -> str:
    return ">100%" if fraction > 1.0 else f"{100 * fraction:.1f}%"


def confirm_mode(confirmation: dict[str, Any]) -> str:
    """How the confirmation measured: "in alternating 1 s windows in one process" or "interleaved
    fresh processes" (records from before the in-process mode have no "mode")."""
    if confirmation.get("mode") == "in-process windows":
        return f"in alternating {confirmation.get('window_s', 1.0):g} s windows in one process"
    return "interleaved fresh processes"


def confirmed(confirmation: dict[str, Any] | None, number: int, baseline_number: int | None) -> str:
    """How trial `number` was confirmed against the baseline (a stored confirmation record)."""
    if number == baseline_number:
        return "the baseline itself"
    for entry in (confirmation or {}).get("comparisons") or []:
        if entry.get("trial_number") == number:
            return f"confirmed {speedup_ci(entry)}"
    return "not confirmed (single measurement)"


def two_answers(
    held: str,
    same: tuple[int, str] | None,
    best: tuple[int, str],
    confirmation: dict[str, Any] | None,
    baseline_number: int | None,
    change: str | None,
) -> list[str]:
    """The two answers, as the sweep summary and the report both say them: (a) the best trial
    that keeps the baseline's training math, (b) the best overall and what it changes, each with
    its own confirmation. `same` / `best`: (trial number, how to show it)."""
    lines = [f"two answers (same training = {held}, same lr, numerics within tolerance):"]
    if same is None:
        lines.append("  (a) same training: no feasible trial keeps the baseline's training")
    else:
        said = confirmed(confirmation, same[0], baseline_number)
        lines.append(f"  (a) same training: #{same[0]} {same[1]}: {said}")
    if same is not None and best[0] == same[0]:
        lines.append("  (b) best overall: the same trial (it keeps the training)")
        return lines
    said = confirmed(confirmation, best[0], baseline_number)
    lines.append(f"  (b) best overall: #{best[0]} {best[1]}: {said}")
    if change:
        lines.append(f"      changes the training: {change}")
    return lines


def limit_share(attrs: dict[str, Any], highest: HighestLimit | None = None) -> str | None:
    """A trial's share of the machine's limit for its workload at its settings (gpuopt.core.limits), in
    words; None when the limit was not measured (a user step, `measure.loader_cost=false`). With
    `highest` (the study's highest limit) clearly above the trial's own, it says where: a baseline
    at "100%" of its own limit may still be far from what other settings allow."""
    share, limit = attrs.get("limit_efficiency"), attrs.get("limit_throughput")
    if not isinstance(share, (int, float)) or not isinstance(limit, (int, float)):
        return None
    bound = attrs.get("limit_bound")
    by = f", bound by {bound}" if bound else ""
    text = f"{share:.0f}% of this machine's limit for this workload ({_rate(limit)} samples/s{by})"
    if higher_elsewhere(attrs, highest) and highest is not None:
        text += (
            f"; other settings measured a limit up to {_rate(highest.throughput)} samples/s "
            f"(trial #{highest.trial})"
        )
    return text


def _rate(samples_per_s: float) -> str:
    return (
        f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"
    )  # GPT-2: 0.874

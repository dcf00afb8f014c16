"""The confirmation's verdicts, in the stored record's shape (gpuopt.study.records.Comparison),
from its re-measurements only.

The sweep's own measurement of a candidate is left out: it was picked for being high (on a 2-core
CPU that bias let the sweeper recommend a candidate ~5% slower than the baseline,
docs/benchmarks.md, "Speedup over PyTorch defaults").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from gpuopt.core.host import usable_cpus
from gpuopt.core.stats import DEFAULT_TARGET, LEVEL
from gpuopt.study.records import ConfirmedConfig
from gpuopt.sweeper.comparison import paired_speedup


def paired(
    cand: ConfirmedConfig, ref: ConfirmedConfig, direction: str, **kwargs: Any
) -> dict[str, Any]:
    """The paired speedup of cand over ref, as a record entry."""
    s = paired_speedup(cand.by_round(), ref.by_round(), direction, **kwargs)
    if s is None:
        return {"error": "speedup needs at least one round with a positive measurement each"}
    return {**asdict(s), "distinguishable": s.distinguishable}


def compare(
    configs: Sequence[ConfirmedConfig],
    direction: str,
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
    loads: Sequence[float] = (),
    steal_pct: float | None = None,
    level: float = LEVEL,
) -> dict[str, Any]:
    """The record's `comparisons` (over the baseline, configs[0]) and `top_two` (the top two
    candidates against each other); `loads` and `steal_pct` kept on each entry for a "too noisy"
    verdict."""
    base = configs[0]
    seen: dict[str, Any] = {"target_halfwidth": target}
    if loads:
        seen.update(load_1m=[min(loads), max(loads)], cpus=usable_cpus())
    if steal_pct is not None:
        seen.update(steal_pct=steal_pct)
    out: dict[str, Any] = {"comparisons": [], "top_two": None}
    for cand in configs[1:]:
        entry = {"label": cand.label, "trial_number": cand.trial_number}
        entry.update(
            paired(cand, base, direction, target=target, first_stage=first_stage, level=level)
        )
        out["comparisons"].append({**entry, **seen})
    if len(configs) >= 3:
        a, b = configs[1], configs[2]
        # no first stage here: the rounds were not chosen from this pair's spread
        top_two = paired(a, b, direction, target=target, level=level)
        out["top_two"] = {"labels": [a.label, b.label], **top_two}
    return out

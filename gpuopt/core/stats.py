"""Student's t distribution without scipy (a regularized incomplete beta for the CDF, bisection
for any, also fractional, degrees of freedom), and the confirmation's paired speedup on it: each
round's log-ratio of runs made next to each other, so the machine's slow drift cancels within the
pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The paired intervals' confidence (the race, the in-process confirmation). The fresh-process
# confirmation's is FRESH_LEVEL (sweeper/confirm/rounds.py says why).
LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Numerical Recipes, modified Lentz)."""

    def nonzero(v: float) -> float:
        return v if abs(v) > 1e-300 else 1e-300

    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 / nonzero(1.0 - qab * x / qap)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        even = m * (b - m) * x / ((qam + m2) * (a + m2))
        odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        for aa in (even, odd):
            d = 1.0 / nonzero(1.0 + aa * d)
            c = nonzero(1.0 + aa / c)
            h *= d * c
        if abs(d * c - 1.0) < 3e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse CDF of Student's t with (possibly fractional) df, by bisection."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_interval(values: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, half-width, sample sd) of the `level` t-interval for the mean of `values`: the
    confirmation's paired log-ratios. Needs >= 2 values; an sd of 0 gives a half-width of 0."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a t-interval needs >= 2 values, got {n}")
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, two_sided(level, n - 1) * sd / math.sqrt(n), sd


def two_sided(level: float, df: float) -> float:
    """The t quantile of a two-sided `level` interval."""
    return t_quantile(0.5 + level / 2.0, df)


def stein_pairs(sd: float, first: int, half: float, level: float = LEVEL) -> int:
    """Pairs Stein's two-stage procedure needs for a half-width `half` (log scale) from the spread
    `sd` of its `first` pairs: max(first, ceil((t(first-1) * sd / half)^2)). Its interval, mean of
    all pairs +- t(first-1) * sd / sqrt(n), then covers at the nominal rate whatever the noise: n
    depends on the first stage's spread only, which (for normal noise) says nothing about the mean.
    Stopping instead as soon as the running t-interval is narrow enough undercovers (92% at 95%
    in simulation when the pairs' spread is near the target): it stops on a lucky small sd."""
    if first < 2:
        raise ValueError(f"the first stage needs >= 2 pairs, got {first}")
    if sd <= 0.0:
        return first
    need = (two_sided(level, first - 1) * sd / half) ** 2
    return max(first, math.ceil(min(need, 1e9) - 1e-9))


# ---- the confirmation's paired speedup ----------------------------------------------------------
FASTER, SLOWER, SAME, TOO_NOISY = "faster", "slower", "same", "too noisy"
# The confirmation's target half-width (ConfirmOptions.target_halfwidth's default): +-5%, so that a
# true 10% speedup lies two half-widths from 1.0x and its interval clears 1.0x about 39 times in 40.
DEFAULT_TARGET = 0.05


@dataclass
class Speedup:
    """How much better `candidate` is than `reference` on one metric (ratio > 1: better), from
    per-round pairs."""

    ratio: float
    ci_low: float | None  # None: fewer than 2 pairs
    ci_high: float | None
    n_candidate: int  # measurements on each side (a side may have more than the pairs)
    n_reference: int
    n_pairs: int = 0  # rounds with a measurement on both sides: the estimate's sample
    log_sd: float | None = None  # spread (sd) of the per-round log-ratios
    halfwidth: float | None = None  # relative: (ci_high - ci_low) / (2 * ratio)
    verdict: str | None = None  # faster | slower | same | too noisy; None without an interval
    pairs_needed: int | None = None  # pairs for +-target at this spread (Stein)
    level: float = LEVEL  # the interval's confidence

    @property
    def distinguishable(self) -> bool | None:
        """Whether the interval excludes 1 (no difference); None when there is no CI."""
        if self.ci_low is None or self.ci_high is None:
            return None
        return self.ci_low > 1.0 or self.ci_high < 1.0


def log_ratios(
    candidate: Sequence[float | None], reference: Sequence[float | None], direction: str
) -> list[float]:
    """log(candidate / reference) per round (position), rounds missing either side left out; the
    sign is flipped for a minimized metric, so > 0 always means "candidate is better"."""
    sign = 1.0 if direction == "maximize" else -1.0
    return [
        sign * (math.log(c) - math.log(r))
        for c, r in zip(candidate, reference, strict=False)
        if _positive(c) and _positive(r)
    ]


def speedup(
    candidate: Sequence[float | None],
    reference: Sequence[float | None],
    direction: str = "maximize",
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
    level: float = LEVEL,
) -> Speedup:
    """Paired speedup of candidate over reference; entry i of each is round i (None: no value).

    exp(mean log-ratio) with a `level` t-interval on the log scale. With `first_stage` (the rounds run
    before the number of rounds was chosen from their spread) the interval is Stein's: the first
    stage's sd with its df, over all pairs - the one that keeps its coverage after that choice.
    """
    d = log_ratios(candidate, reference, direction)
    n_c, n_r = sum(map(_positive, candidate)), sum(map(_positive, reference))
    if not d:
        raise ValueError("speedup needs at least one round with a positive measurement each")
    mean = math.fsum(d) / len(d)
    if len(d) < 2:
        return Speedup(math.exp(mean), None, None, n_c, n_r, n_pairs=1, level=level)
    _, half, sd = mean_interval(d, level)
    first = len(d) if first_stage is None or not 2 <= first_stage < len(d) else first_stage
    if first < len(d):
        _, _, sd = mean_interval(d[:first])
        half = two_sided(level, first - 1) * sd / math.sqrt(len(d))
    low, high = _exp(mean - half), _exp(mean + half)
    halfwidth = math.sinh(min(half, 700.0))
    return Speedup(
        ratio=math.exp(mean),
        ci_low=low,
        ci_high=high,
        n_candidate=n_c,
        n_reference=n_r,
        n_pairs=len(d),
        log_sd=sd,
        halfwidth=halfwidth,
        verdict=verdict(low, high, halfwidth, target),
        pairs_needed=stein_pairs(sd, first, math.asinh(target), level),
        level=level,
    )


def verdict(ci_low: float, ci_high: float, halfwidth: float, target: float) -> str:
    """faster / slower when the interval excludes 1.0x (however wide: the sign is established);
    else same when it is within +-target, too noisy when it is not."""
    if ci_low > 1.0:
        return FASTER
    if ci_high < 1.0:
        return SLOWER
    return SAME if halfwidth <= target else TOO_NOISY


def _positive(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def _exp(x: float) -> float:
    return math.exp(max(-700.0, min(700.0, x)))

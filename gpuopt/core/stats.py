"""Student's t distribution without scipy: the CIs of the timed window and of the confirmation round.

A regularized incomplete beta (Numerical Recipes' continued fraction) gives the CDF; bisection
inverts it for any (also fractional, as in Welch's test) degrees of freedom.
"""

from __future__ import annotations

import math


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Numerical Recipes, modified Lentz)."""
    tiny, eps = 1e-300, 3e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
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


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, half-width, sample sd) of the t-interval for the mean of `values`: the confirmation's
    paired log-ratios. Needs >= 2 values; an sd of 0 gives a half-width of 0."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a t-interval needs >= 2 values, got {n}")
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n), sd


def stein_pairs(sd: float, first: int, half: float, confidence: float = 0.95) -> int:
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
    need = (t_quantile(0.5 + confidence / 2.0, first - 1) * sd / half) ** 2
    return max(first, math.ceil(min(need, 1e9) - 1e-9))

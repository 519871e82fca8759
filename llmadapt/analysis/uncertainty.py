"""How sure a figure is: bootstrap confidence intervals of a median, Welch's t-test, and printing a value to no
more digits than its interval supports. Pure Python (no SciPy in the core); seeded, so a table is reproducible.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Sequence

import attrs

CONFIDENCE = 0.95
RESAMPLES = 2000


@attrs.frozen
class Estimate:
    """A median with its bootstrap confidence interval (percentile method) over ``n`` samples of ``what``."""

    median: float
    low: float
    high: float
    n: int
    what: str
    """'runs' (one value per repeated run) or 'steps' (the measured steps of one run)."""
    samples: tuple[float, ...] = ()
    """Over runs: the runs' values (few), for a rank test between rows; empty over steps."""

    def overlaps(self, other: Estimate) -> bool:
        return self.low <= other.high and other.low <= self.high

    def text(self) -> str:
        """'0.0524 (0.0510-0.0540)', rounded to the interval's width; a lone sample prints as it is."""
        if self.n < 2 or self.high == self.low:
            return _round(self.median, abs(self.median) * 1e-3 or 1e-12)
        width = self.high - self.low
        return f"{_round(self.median, width)} ({_round(self.low, width)}-{_round(self.high, width)})"


def _round(value: float, width: float) -> str:
    """VALUE to the decimal of WIDTH's leading digit (plus one): digits below the noise are not printed."""
    if width <= 0 or not math.isfinite(width):
        return f"{value:.4g}"
    decimals = max(0, -math.floor(math.log10(width)) + 1)
    if abs(value) >= 1000:
        return f"{value:,.{decimals}f}" if decimals else f"{value:,.0f}"
    return f"{value:.{decimals}f}"


def bootstrap_median(samples: Sequence[float], what: str, *, seed: int = 0) -> Estimate:
    """Median of SAMPLES and its 95% percentile-bootstrap interval (2000 resamples)."""
    data = [float(x) for x in samples]
    if not data:
        raise ValueError("no samples")
    median = statistics.median(data)
    kept = tuple(data) if what == "runs" else ()
    if len(data) < 2:
        return Estimate(median, median, median, len(data), what, kept)
    rng = random.Random(seed)
    n = len(data)
    medians = sorted(statistics.median(rng.choices(data, k=n)) for _ in range(RESAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return Estimate(median, medians[int(tail * RESAMPLES)], medians[int((1 - tail) * RESAMPLES) - 1], n, what, kept)


@attrs.frozen
class TTest:
    """Welch's t-test of B against A: t, degrees of freedom, and two- and one-sided p-values (B > A)."""

    t: float
    df: float
    p_two_sided: float
    p_greater: float


def welch(a: Sequence[float], b: Sequence[float]) -> TTest | None:
    """None when either side has fewer than two samples or no spread at all."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return None if ma == mb else TTest(math.copysign(math.inf, mb - ma), math.inf, 0.0,
                                           0.0 if mb > ma else 1.0)
    t = (mb - ma) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    upper = student_t_sf(t, df)
    return TTest(t, df, min(1.0, 2 * min(upper, 1 - upper)), upper)


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with DF degrees of freedom (through the regularised incomplete beta)."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return tail if t > 0 else 1 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (Numerical Recipes' betacf)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-12:
            break
    return front * h / a


def mann_whitney_greater(a: Sequence[float], b: Sequence[float]) -> float | None:
    """One-sided p-value of the Mann-Whitney U test that B tends to be larger than A: exact for small samples
    without ties, else the normal approximation with tie correction and continuity correction. Rank-based, so
    one stalled step or run moves it little (unlike a t-test). None with an empty side."""
    n1, n2 = len(a), len(b)
    if not n1 or not n2:
        return None
    merged = sorted([(float(v), 0) for v in a] + [(float(v), 1) for v in b])
    ranks, ties, i = [0.0] * len(merged), [], 0
    while i < len(merged):
        j = i
        while j + 1 < len(merged) and merged[j + 1][0] == merged[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        if j > i:
            ties.append(j - i + 1)
        i = j + 1
    u = sum(r for r, (_, side) in zip(ranks, merged) if side == 1) - n2 * (n2 + 1) / 2  # pairs with b > a
    if not ties and n1 * n2 <= 400:
        counts = _u_distribution(n1, n2)
        return sum(counts[k] for k in range(math.ceil(u), len(counts))) / math.comb(n1 + n2, n1)
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - sum(t ** 3 - t for t in ties) / (n * (n - 1))))
    if sigma == 0:
        return 0.5
    z = (u - n1 * n2 / 2 - 0.5) / sigma
    return 1 - statistics.NormalDist().cdf(z)


def _u_distribution(n1: int, n2: int) -> list[int]:
    """How many orderings of N1 + N2 distinct values give each U (pairs with a B value above an A value)."""
    # counts[m][u] for m of the A values among the first values seen; built by adding one value at a time
    table = {(0, 0): [1]}
    for m in range(n1 + 1):
        for n in range(n2 + 1):
            if m == n == 0:
                continue
            size = m * n + 1
            out = [0] * size
            if m > 0:  # the largest value is an A: it adds no pair with B above it
                for u, c in enumerate(table[(m - 1, n)]):
                    out[u] += c
            if n > 0:  # the largest value is a B: it is above every one of the m A values
                for u, c in enumerate(table[(m, n - 1)]):
                    out[u + m] += c
            table[(m, n)] = out
    return table[(n1, n2)]

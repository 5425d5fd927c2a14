"""Two-sample tests for comparing gpufeed's random draws with torchvision's own (no scipy needed)."""

from __future__ import annotations

import bisect
import collections
import math
from typing import Hashable, Iterable, Sequence

# the asymptotic two-sample Kolmogorov-Smirnov critical value at p = 0.001: c = sqrt(-ln(0.0005) / 2)
_KS_C = math.sqrt(-math.log(0.001 / 2) / 2)
Z = 4.5  # a share's bound in standard errors: over a few hundred categories, a false alarm well under 1%


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest gap between the two empirical distribution functions."""
    a, b = sorted(a), sorted(b)
    return max(abs(bisect.bisect_right(a, x) / len(a) - bisect.bisect_right(b, x) / len(b)) for x in a + b)


def assert_same_distribution(ours: Sequence[float], theirs: Sequence[float], what: str) -> int:
    """KS test at p = 0.001; returns how many of ours were compared."""
    n, m = len(ours), len(theirs)
    assert n >= 500 and m >= 500, (what, n, m)
    d, bound = ks_statistic(ours, theirs), _KS_C * math.sqrt((n + m) / (n * m))
    assert d < bound, f"{what}: KS distance {d:.4f} >= {bound:.4f} over {n} and {m} draws"
    return n


def assert_same_frequencies(ours: Iterable[Hashable], theirs: Iterable[Hashable], what: str) -> int:
    """Each category's share in ours within ``Z`` standard errors of its share in theirs (two-proportion,
    pooled); returns how many of ours were compared."""
    a, b = collections.Counter(ours), collections.Counter(theirs)
    n, m = sum(a.values()), sum(b.values())
    assert n >= 500 and m >= 500, (what, n, m)
    for key in set(a) | set(b):
        pooled = (a[key] + b[key]) / (n + m)
        se = math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / m))
        gap = abs(a[key] / n - b[key] / m)
        assert gap <= Z * se + 1e-12, f"{what}: {key!r} drawn {a[key]}/{n} here, {b[key]}/{m} by torchvision"
    return n

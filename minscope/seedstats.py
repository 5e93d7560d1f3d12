"""Intervals over seeds: Student's t, with seeds as the unit.

A toy run trains each arm on a few seeds and evaluates each on ~1,000 episodes. The episodes
make a seed's value precise; what varies is the seed (the run's training randomness). A
reader's "95% CI" is then a t-interval over the seeds' values, n - 1 degrees of freedom, and
a comparison of two arms is a paired difference over the seeds both were trained on.

The t distribution's CDF is computed exactly for whole degrees of freedom (the closed-form
finite series, Abramowitz & Stegun 26.7.3-4) and inverted by bisection, so no statistics
package is needed.
"""

from __future__ import annotations

import math

import numpy as np


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` (a whole number >= 1) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a whole number >= 1, not {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:                                      # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):           # terms (2k)/(2k+1) cos^2k
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = (2 / math.pi) * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    else:                                           # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    inside = min(max(inside, 0.0), 1.0)              # P(|T| <= |t|)
    return 0.5 + 0.5 * inside if t >= 0 else 0.5 - 0.5 * inside


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0 < p < 1)."""
    if not 0 < p < 1:
        raise ValueError(f"p must lie in (0, 1), not {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values, level: float = 0.95) -> dict:
    """Mean of `values` (one per seed) with its t-interval over them (n - 1 degrees of
    freedom). With one value the interval is undefined (None ends)."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    n = len(x)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "sd": None, "df": 0}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": 1, "sd": None, "df": 0}
    sd = float(x.std(ddof=1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "sd": sd, "df": n - 1}


def paired(a: dict, b: dict, level: float = 0.95) -> dict:
    """A - B over the seeds both have (a, b: seed -> value): the mean paired difference with
    its t-interval, the seeds used, how many favour A, and the verdict of the rule:
    "above" (interval above 0), "below" (under 0) or "tie" (it contains 0); with a NaN or
    infinite value, "undefined (seed N is not finite)" (NaN compares false, so it would
    otherwise read as a tie)."""
    seeds = sorted(set(a) & set(b), key=lambda s: (str(type(s)), s))
    used = [s for s in seeds if a[s] is not None and b[s] is not None]
    diffs = [a[s] - b[s] for s in used]
    out = t_interval(diffs, level)
    out["seeds"] = seeds
    out["wins"] = int(sum(d > 0 for d in diffs))
    bad = [s for s in used if not (math.isfinite(a[s]) and math.isfinite(b[s]))]
    out["verdict"] = f"undefined (seed {bad[0]} is not finite)" if bad else verdict(out)
    return out


def verdict(ci: dict) -> str | None:
    if ci.get("lo") is None:
        return None
    if not (math.isfinite(ci["lo"]) and math.isfinite(ci["hi"])):
        return "undefined (not finite)"
    return "above" if ci["lo"] > 0 else "below" if ci["hi"] < 0 else "tie"

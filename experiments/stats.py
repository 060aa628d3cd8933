"""The rule that decides a claim, stated before the runs: a Welch 95% interval of a contrast of arms.

Each arm gives one number per seed (its runs are independent: no seed is shared between arms in any
sense that pairs them). A test names a contrast, Σ_k c_k·mean_k (for two arms a − b: {a: 1, b: −1}),
and the sign the article predicts. Its interval is Welch's:

    est = Σ_k c_k·x̄_k − offset          se² = Σ_k c_k²·s_k²/n_k          (s_k: Bessel std of arm k)
    ν   = se⁴ / Σ_k (c_k²·s_k²/n_k)² / (n_k − 1)                            (Welch–Satterthwaite)
    est ± t_{0.975, ν}·se

and the verdict: "reproduced" when the interval excludes 0 on the predicted side, "refuted" when it
excludes 0 on the other, else "not distinguishable at this scale". An arm with fewer than 2 seeds has
no std, so no interval: "not distinguishable". When every arm's seeds agree exactly (se = 0) the
interval is the point est, which excludes 0 unless est is 0.

A claim's tests are a family: the table also gives each test's verdict under Holm's step-down over
the claim's tests at α = 0.05 (two-sided Welch p-values), which bounds the chance that any of them
is called reproduced or refuted by chance, where the per-test verdict bounds it for each alone.

How many seeds would decide a test that is not distinguishable: the smallest n such that n seeds in
every arm, with each arm's mean and std as seen, give a Welch interval that excludes 0. It is a
projection from the runs made (the estimate and the spreads may move with more seeds), not a run.

No scipy here: the t quantile is found by bisection on the t distribution's CDF, integrated with
Simpson's rule from the density (exact to about 1e-9 for ν ≥ 1, which the tests check against the
printed tables).
"""

import math

import numpy as np

REPRODUCED, REFUTED, UNCLEAR = "reproduced", "refuted", "not distinguishable at this scale"


def t_cdf(t, df):
    """P(T ≤ t) for Student's t with df > 0 degrees of freedom (df may be fractional)."""
    if math.isinf(df):
        return 0.5 * (1 + math.erf(t / math.sqrt(2)))
    # ∫_0^|t| of the density, by Simpson's rule on the substitution x = atan(u) (a finite interval
    # whatever |t|, and a smooth integrand).
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, math.atan(abs(t)), 4001)                          # [M], M odd
    u = np.tan(x)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df)) / np.cos(x) ** 2   # density · du/dx
    h = x[1] - x[0]
    half = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 0.5 + math.copysign(half, t)


def t_quantile(p, df):
    """The t with P(T ≤ t) = p, for 0.5 ≤ p < 1 (bisection on t_cdf)."""
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def welch_interval(samples, contrast, offset=0.0, level=0.95):
    """(est, low, high, df) of Σ_k c_k·mean(samples[k]) − offset; low = high = None when an arm with
    c_k ≠ 0 has fewer than 2 values. samples: {arm: [per-seed values]}, contrast: {arm: c_k}."""
    arms = {arm: np.asarray(samples[arm], dtype=np.float64) for arm in contrast}          # [n_k] each
    if any(len(x) == 0 for x in arms.values()):
        return float("nan"), None, None, None
    est = sum(c * arms[arm].mean() for arm, c in contrast.items()) - offset
    if any(len(x) < 2 for x in arms.values()):
        return est, None, None, None
    terms = [(c * c * arms[arm].var(ddof=1) / len(arms[arm]), len(arms[arm]))    # c_k²·s_k²/n_k, n_k
             for arm, c in contrast.items()]
    half, df = half_width(terms, level)
    return est, est - half, est + half, df


def half_width(terms, level=0.95):
    """(t_{(1+level)/2, ν}·se, ν) of Welch's interval from its terms [(c_k²·s_k²/n_k, n_k)];
    (0, ∞) when se = 0."""
    se2 = sum(v for v, _ in terms)
    if se2 == 0:
        return 0.0, float("inf")
    df = se2 ** 2 / sum(v * v / (n - 1) for v, n in terms if v > 0)
    return t_quantile(0.5 + level / 2, df) * math.sqrt(se2), df


def welch_p(samples, contrast, offset=0.0):
    """The two-sided p-value of Welch's t test of Σ_k c_k·mean_k − offset = 0: 2·P(T_ν > |est|/se), the
    number whose being below 1 − level is the interval's excluding 0. None when an arm has fewer than 2
    values; 0 when se = 0 and est ≠ 0 (1 when est = 0 too)."""
    arms = {arm: np.asarray(samples[arm], dtype=np.float64) for arm in contrast}
    if any(len(x) < 2 for x in arms.values()):
        return None
    est = sum(c * arms[arm].mean() for arm, c in contrast.items()) - offset
    terms = [(c * c * arms[arm].var(ddof=1) / len(arms[arm]), len(arms[arm])) for arm, c in contrast.items()]
    se2 = sum(v for v, _ in terms)
    if se2 == 0:
        return 0.0 if est != 0 else 1.0
    df = se2 ** 2 / sum(v * v / (n - 1) for v, n in terms if v > 0)
    return 2 * (1 - t_cdf(abs(est) / math.sqrt(se2), df))


def holm(pvalues, alpha=0.05):
    """Holm's step-down over a family of tests: which p-values are rejected with a family-wise error rate
    of at most alpha. The k-th smallest (from 0) is rejected when it is at most alpha/(m − k) and every
    smaller one was; a None p-value (no interval) is never rejected. [m] -> [m] bool, in input order."""
    m = len(pvalues)
    order = sorted((i for i in range(m) if pvalues[i] is not None), key=lambda i: pvalues[i])
    rejected = [False] * m
    for k, i in enumerate(order):
        if pvalues[i] > alpha / (m - k):
            break
        rejected[i] = True
    return rejected


def family_verdict(rejected, est, direction):
    """The verdict a test keeps within its family: its sign decides, as verdict() does, where Holm
    rejects; not distinguishable where it does not."""
    if not rejected:
        return UNCLEAR
    return verdict(est, est, direction)


def verdict(low, high, direction):
    """The rule: `direction` '>' predicts a positive contrast, '<' a negative one."""
    if low is None:
        return UNCLEAR
    positive, negative = low > 0, high < 0
    if direction == ">":
        return REPRODUCED if positive else REFUTED if negative else UNCLEAR
    if direction == "<":
        return REPRODUCED if negative else REFUTED if positive else UNCLEAR
    raise ValueError(f"direction must be '>' or '<', got {direction!r}")


def seeds_to_decide(samples, contrast, offset=0.0, level=0.95, most=1000):
    """The smallest n ≥ 2 such that n values in every arm, at the means and stds of `samples`, give an
    interval of Σ_k c_k·mean_k − offset that excludes 0, on the estimate's side (which may not be the
    predicted one); None when no n ≤ `most` does (or an arm has fewer than 2 values). With n in every
    arm, se² = Σ_k c_k²·s_k²/n and ν = se⁴ / Σ_k (c_k²·s_k²/n)²/(n − 1)."""
    arms = {arm: np.asarray(samples[arm], dtype=np.float64) for arm in contrast}
    if most < 2 or any(len(x) < 2 for x in arms.values()):
        return None
    est = abs(sum(c * arms[arm].mean() for arm, c in contrast.items()) - offset)
    spread = [c * c * arms[arm].var(ddof=1) for arm, c in contrast.items()]           # c_k²·s_k²

    def decides(n):
        return half_width([(v / n, n) for v in spread], level)[0] < est

    if not decides(most):
        return None
    low, high = 1, most                      # decides(high) holds; the half-width shrinks as n grows
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if decides(mid) else (mid, high)
    return high

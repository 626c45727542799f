"""
The statistics the claims are decided by, each a function of plain numbers: Student's t p-values
and critical values, the verdict of a difference (holds / does not hold / not significant), paired
per-prefix tests, Holm's step-down correction over the family of claims, the delete-one jackknife
SE, a studentised permutation test and an equivalence (TOST) p-value.
"""

import math

import numpy as np

Z_SIG = 2.0  # |difference| / SE beyond which a claim is decided with many prefixes
P_SIG = math.erfc(Z_SIG / math.sqrt(2))  # 0.0455: the two-sided p-value of |z| = 2
ALPHA = P_SIG  # every claim's level, alone (holds) and family-wise (holds_holm)

def t_pvalue(t, df=None):
    """Two-sided p-value P(|T| >= |t|) of Student's t with df (a positive integer) degrees of
    freedom; df None: the normal's. The finite sums of Abramowitz and Stegun 26.7.3 (odd df) and
    26.7.4 (even df) in theta = atan(|t| / sqrt(df)); exact up to rounding for any df."""
    if not math.isfinite(t):
        return 0.0 if math.isinf(t) else float('nan')
    if df is None:
        return math.erfc(abs(t) / math.sqrt(2))
    if df < 1 or df != int(df):
        raise ValueError(f"Student's t needs a positive integer df, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            total += term
        return max(0.0, 1.0 - s * total)
    term, total = 1.0, 0.0 if df == 1 else 1.0
    for j in range(1, (df - 1) // 2):
        term *= c2 * 2 * j / (2 * j + 1)
        total += term
    return max(0.0, 1.0 - 2 / math.pi * (theta + s * math.cos(theta) * total))


def t_critical(df=None, alpha=ALPHA):
    """|t| whose two-sided p-value is alpha (bisection on t_pvalue, to 1e-12)."""
    lo, hi = 0.0, 1e3
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_pvalue(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def decide(diff, p):
    """True / False / None: significant at ALPHA in the claim's direction / the other / neither."""
    if p is None or not p < ALPHA:
        return None
    return bool(diff > 0)


def verdict(diff, se, df=None):
    """True / False / None (not significant, or no SE: a single prefix) for a difference measured
    in the claim's direction, by its t-test with df degrees of freedom (None: normal)."""
    return decide(diff, t_pvalue(diff / se, df)) if se > 0 else None


def mean_se(d):
    """Mean and SE over prefixes of per-prefix values d."""
    d = np.asarray(d, dtype=np.float64)
    return dict(diff=float(d.mean()), se=float(d.std(ddof=1) / math.sqrt(len(d))))


def paired(d):
    """Mean and SE over prefixes of per-prefix differences d, with its one-sample t-test
    (len(d) - 1 degrees of freedom: 8 prefixes decide at |t| > 2.43, not 2) and the verdict."""
    res = mean_se(d)
    mean, se, df = res['diff'], res['se'], len(d) - 1
    p = t_pvalue(mean / se, df) if se > 0 else None
    return dict(res, z=mean / se if se > 0 else None, df=df, p=p, holds=decide(mean, p), prefixes=len(d))


def mcnemar(a, b):
    """Exact McNemar test of paired 0/1 outcomes a and b (one per problem, two decoders on the same
    problems and samples): the difference of their means with its paired SE, and the two-sided exact
    binomial p-value of the discordant pairs (a right and b wrong: k of them, the reverse: m),
    min(1, 2 P(X <= min(k, m))) for X ~ Binomial(k + m, 1/2); p = 1 with no discordant pair."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or not np.isin(np.concatenate([a, b]), (0.0, 1.0)).all():
        raise ValueError("McNemar's test needs two equally long vectors of 0/1 outcomes")
    k, m = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n = k + m
    tail = sum(math.comb(n, i) for i in range(min(k, m) + 1)) / 2 ** n if n else 1.0
    p = min(1.0, 2 * tail)
    res = mean_se(a - b)
    return dict(res, p=p, holds=decide(res['diff'], p), pairs=len(a), discordant=[k, m])


def holm(pvalues):
    """Holm's (1979) step-down adjusted p-values, in the order given: sorted ascending, the j-th
    smallest (j = 0, 1, ...) is max over i <= j of min(1, (m - i) p_(i)); a hypothesis is rejected
    at family-wise level alpha where its adjusted p-value is below alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [None] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def correct(claims):
    """Each claim's Holm-adjusted p (p_holm) and verdict (holds_holm) over the family of claims with a
    p-value, a claim that repeats another's test (same_as) counted once and given its result."""
    family = [k for k, c in claims.items() if c.get('p') is not None and not c.get('same_as')]
    for k, p in zip(family, holm([claims[k]['p'] for k in family])):
        claims[k].update(p_holm=p, holds_holm=claims[k]['holds'] if p < ALPHA else None)
    for c in claims.values():
        if c.get('same_as'):
            first = claims[c['same_as']]
            c.update(p_holm=first.get('p_holm'), holds_holm=first.get('holds_holm'))
        c.setdefault('p_holm', None)
        c.setdefault('holds_holm', None)
    return dict(method='Holm (1979) step-down', alpha=ALPHA, family=family)


def jackknife(stat, num_prefixes):
    """stat(all prefixes) and its delete-one jackknife SE over prefixes. A bootstrap resample
    repeats prefixes, and a repeated continuation repeats all its n-grams, deflating a pooled
    share of distinct n-grams (C6) and so its bootstrap SE; leaving one out repeats nothing."""
    idx = np.arange(num_prefixes)
    loo = np.array([stat(np.delete(idx, i)) for i in idx])
    se = math.sqrt((num_prefixes - 1) / num_prefixes * ((loo - loo.mean()) ** 2).sum())
    return stat(idx), se


def jackknife_se(loo):
    """The delete-one jackknife SE from leave-one-out values loo (..., N), along the last dim."""
    N = loo.shape[-1]
    return np.sqrt((N - 1) / N * ((loo - loo.mean(-1, keepdims=True)) ** 2).sum(-1))


def studentised_permutation(stat_se, num_prefixes, seed, reps):
    """A studentised permutation test (Janssen 1997; Chung and Romano 2013): stat_se(swap) ->
    (statistic, its jackknife SE), swap: per prefix, whether its two kinds of samples trade
    places. Exact under exchangeability of a prefix's two samples and, being studentised,
    asymptotically valid where only the statistic's mean is equal (equal diversity, different
    distributions), which the raw difference is not. Returns the statistic, its SE, its t and the
    two-sided p = (1 + #{|t*| >= |t|}) / (1 + reps) (t and p None without spread: se = 0)."""
    t_of = lambda d, s: d / s if s > 0 else float('nan')
    diff, se = stat_se(np.zeros(num_prefixes, bool))
    if not se > 0:
        return diff, se, None, None
    swaps = np.random.default_rng(seed).random((reps, num_prefixes)) < 0.5
    null = np.nan_to_num(np.array([t_of(*stat_se(s)) for s in swaps]), nan=0.0)
    t = diff / se
    return diff, se, t, float((1 + (np.abs(null) >= abs(t) - 1e-12).sum()) / (1 + reps))


def equivalence_p(diff, se, margin, df):
    """Two-sided-scale p-value of the equivalence decision the estimate leans to: inside the margin,
    the larger of the two one-sided tests' (Schuirmann's TOST, doubled); outside, the test of lying
    beyond the nearer margin (doubled). Below ALPHA exactly when the interval diff +- t_crit se lies
    inside (or outside) +-margin."""
    if not se > 0:
        return None
    if abs(diff) < margin:
        return max(t_pvalue((diff + margin) / se, df), t_pvalue((margin - diff) / se, df))
    return t_pvalue((abs(diff) - margin) / se, df)

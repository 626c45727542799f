"""
The statistics the claims are decided by, each a function of plain numbers: Student's t p-values
(accurate far into the tail, their logs beyond the double's range) and critical values, the verdict
of a difference (holds / does not hold / not significant), paired per-prefix tests, McNemar's exact
test, Holm's step-down correction over the family of claims, the delete-one jackknife SE, a
studentised permutation test and an equivalence (TOST) p-value.
"""

import math

import numpy as np

Z_SIG = 2.0  # |difference| / SE beyond which a claim is decided with many prefixes
P_SIG = math.erfc(Z_SIG / math.sqrt(2))  # 0.0455: the two-sided p-value of |z| = 2
ALPHA = P_SIG  # every claim's level, alone (holds) and family-wise (holds_holm)
LOG_TINY = math.log(2.2250738585072014e-308)  # the smallest normal double's log: p_of


def t_log_pvalue(t, df=None):
    """log of the two-sided p-value P(|T| >= |t|) of Student's t with df (a positive integer) degrees
    of freedom; df None: the normal's (normal_log_tail). Finite for every finite t (the normal's: up
    to |t| = 1e154, past which log p < -1e308), also where p underflows (below 4.9e-324).
    p = I_x(df/2, 1/2) at x = 1 / (1 + t^2/df), the regularised incomplete beta by its continued
    fraction (betacf) on the side where it converges fast (I_x(a, b) = 1 - I_{1-x}(b, a) on the
    other); x, 1 - x and the prefactor in logs."""
    if math.isnan(t):
        return t
    if math.isinf(t) or t == 0:
        return -math.inf if t else 0.0
    if df is None:
        return normal_log_tail(abs(t))
    if df < 1 or df != int(df):
        raise ValueError(f"Student's t needs a positive integer df, got {df}")
    a, b, log_u2 = df / 2, 0.5, 2 * math.log(abs(t)) - math.log(df)  # t^2 / df, never overflowing
    log_x = -max(log_u2, 0.0) - math.log1p(math.exp(-abs(log_u2)))  # log(1 / (1 + t^2/df))
    log_y = log_u2 + log_x  # log(1 - x), not 1 - x rounded
    log_front = a * log_x + b * log_y - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b)
    if math.exp(log_x) < (a + 1) / (a + b + 2):
        return log_front - math.log(a) + math.log(betacf(a, b, math.exp(log_x)))
    return math.log1p(-math.exp(log_front - math.log(b)) * betacf(b, a, math.exp(log_y)))


def t_pvalue(t, df=None):
    """Two-sided p-value P(|T| >= |t|) of Student's t with df degrees of freedom (None: the normal's),
    exp(t_log_pvalue): within 1e-10 relative of the exact value for df up to 1e4 (3e-10 at 1e5:
    lgamma's cancellation), 0.0 only below the smallest double, 4.9e-324, where t_log_pvalue still
    gives its log. Not 1 minus a finite sum (A&S 26.7.3-4, used here before 2026-11-29): off by 4% at
    p = 1e-14 and by every digit below 1e-16 (|t| > 8.5 at 511 df), it stored 0.0 for p = 1e-19 and 1e-73."""
    return math.exp(t_log_pvalue(t, df))


def betacf(a, b, x, eps=1e-15, max_terms=100_000):
    """The continued fraction of the regularised incomplete beta, I_x(a, b) = x^a (1-x)^b / (a B(a, b))
    * betacf(a, b, x): Numerical Recipes' betacf (Press et al. 2007, sec. 6.4) by the modified Lentz
    method; it converges in O(sqrt(max(a, b))) terms for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_terms):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d, c = 1 + aa * d, 1 + aa / c
            d, c = 1 / (d if abs(d) > tiny else tiny), (c if abs(c) > tiny else tiny)
            h *= d * c
        if abs(d * c - 1) < eps:
            return h
    raise ArithmeticError(f'betacf({a}, {b}, {x}) did not converge in {max_terms} terms')


def normal_log_tail(z):
    """log P(|Z| >= z) = log erfc(z / sqrt(2)) of the standard normal (erfc, not 1 - erf: that is 0
    beyond z = 8.3); from z = 37 on, where erfc nears the double's floor, the asymptotic series
    erfc(x) = exp(-x^2) / (x sqrt(pi)) (1 - 1/(2x^2) + 3/(4x^4) - ...) to 6 terms: error below 2e-15."""
    if z < 37:
        return math.log(math.erfc(z / math.sqrt(2)))
    x2 = z * z / 2
    series = sum((-1) ** k * math.prod(range(1, 2 * k, 2)) * (0.5 / x2) ** k for k in range(6))
    return -x2 - 0.5 * math.log(math.pi * x2) + math.log(series)


def format_p(p):
    """A p-value in 7 characters or fewer: 4 decimals from 1e-4 up, else 2 digits and an exponent
    (0.0000 would hide the tail: the addition claims' p-values reach 1e-73)."""
    return f'{p:.4f}' if p >= 1e-4 else f'{p:.1e}'


def format_log_p(log_p):
    """format_p of exp(log_p), also below the smallest double (10,000 problems give p of 1e-600):
    the mantissa and the exponent from log10 p."""
    if log_p >= LOG_TINY:
        return format_p(math.exp(log_p))
    exponent = math.floor(log_p / math.log(10))
    mantissa = round(10 ** (log_p / math.log(10) - exponent), 1)
    return f'{mantissa / 10:.1f}e{exponent + 1}' if mantissa >= 10 else f'{mantissa:.1f}e{exponent}'


def p_of(log_p):
    """exp(log_p) where a double holds it to full precision (from 2.2e-308 up), else None: a p-value
    stored in JSON beside its log_p, which alone holds it below that."""
    return None if log_p is None or log_p < LOG_TINY else math.exp(log_p)


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
    log_p = t_log_pvalue(mean / se, df) if se > 0 else None
    p = None if log_p is None else math.exp(log_p)
    return dict(res, z=mean / se if se > 0 else None, df=df, p=p, log_p=log_p, holds=decide(mean, p),
                prefixes=len(d))


def mcnemar(a, b):
    """Exact McNemar test of paired 0/1 outcomes a and b (one per problem, two decoders on the same
    problems and samples): the difference of their means with its paired SE, and the sign test's
    p-value (sign_test_log_p) of the discordant pairs (a right and b wrong: k of them, the reverse: m)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or not np.isin(np.concatenate([a, b]), (0.0, 1.0)).all():
        raise ValueError("McNemar's test needs two equally long vectors of 0/1 outcomes")
    k, m = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    log_p = sign_test_log_p(k, m)
    p, res = math.exp(log_p), mean_se(a - b)
    return dict(res, p=p, log_p=log_p, holds=decide(res['diff'], p), pairs=len(a), discordant=[k, m])


def sign_test_log_p(k, m):
    """log of the two-sided exact binomial p-value of k successes against m, min(1, 2 P(X <= j)) for
    X ~ Binomial(k + m, 1/2), j = min(k, m); 0 (p = 1) with k = m = 0. The tail in logs: C(n, j) / 2^n
    times the sum over i <= j of C(n, i) / C(n, j), each ratio at most 1 (no 1 - sum, no underflow)."""
    n, j = k + m, min(k, m)
    ratio, total = 1.0, 1.0
    for i in range(j, 0, -1):
        ratio *= i / (n - i + 1)
        total += ratio
        if ratio < 1e-17 * total:
            break
    return min(0.0, math.log(2) + math.log(math.comb(n, j)) - n * math.log(2) + math.log(total))


def holm(pvalues):
    """Holm's (1979) step-down adjusted p-values, in the order given: sorted ascending, the j-th
    smallest (j = 0, 1, ...) is max over i <= j of min(1, (m - i) p_(i)); a hypothesis is rejected
    at family-wise level alpha where its adjusted p-value is below alpha. holm_log in logs."""
    return [math.exp(a) for a in holm_log([math.log(p) if p > 0 else -math.inf for p in pvalues])]


def holm_log(log_ps):
    """holm of exp(log_ps), in logs: max over i <= j of min(0, log(m - i) + log p_(i)), for p-values
    below the smallest double (10,000 problems' paired t)."""
    m = len(log_ps)
    order = sorted(range(m), key=lambda i: log_ps[i])
    adjusted, running = [None] * m, -math.inf
    for rank, i in enumerate(order):
        running = max(running, min(0.0, math.log(m - rank) + log_ps[i]))
        adjusted[i] = running
    return adjusted


def correct(claims):
    """Each claim's Holm-adjusted p (p_holm) and verdict (holds_holm) over the family of claims with a
    p-value, a claim that repeats another's test (same_as) counted once and given its result. Holm in
    logs (holm_log): each claim's log_p is its p's log, or where p underflowed to 0.0 (McNemar on
    10,000 problems) the log its test computed; below 2.2e-308 p and p_holm are stored as None (p_of),
    never 0.0, their logs beside them."""
    for c in claims.values():
        c['log_p'] = claim_log_p(c)
        if c['log_p'] is not None and c['log_p'] < LOG_TINY:
            c['p'] = None
    family = [k for k, c in claims.items() if c['log_p'] is not None and not c.get('same_as')]
    for k, log_p_holm in zip(family, holm_log([claims[k]['log_p'] for k in family])):
        claims[k].update(p_holm=p_of(log_p_holm), log_p_holm=log_p_holm,
                         holds_holm=claims[k]['holds'] if log_p_holm < math.log(ALPHA) else None)
    for c in claims.values():
        if c.get('same_as'):
            first = claims[c['same_as']]
            c.update({k: first.get(k) for k in ('p_holm', 'log_p_holm', 'holds_holm')})
        for k in ('p_holm', 'log_p_holm', 'holds_holm'):
            c.setdefault(k, None)
    return dict(method='Holm (1979) step-down', alpha=ALPHA, family=family)


def claim_log_p(claim):
    """The log of a claim's p (None: no p, as where its verdict is withheld); a p of 0.0 is only ever
    exp of a log below the double's range, which the claim's test kept (log_p)."""
    p = claim.get('p')
    if p is None:
        return None
    return math.log(p) if p > 0 else claim['log_p']


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

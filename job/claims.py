"""
The paper's claims, each a test with a stated statistic, from the main job's outputs (ppl.json
of estimate_ppl.py, samples.json and samples_untruncated.json of sample.py, the LMs'
results.json). Writes claims.json and claims.txt:

    C1  JOINT BIT's conservative PPL below BALM's                       (Table 1)
    C2  JOINT UNIT's conservative PPL below RALM's (same architecture)  (Table 1)
    C3  JOINT BIT below JOINT UNIT, with fewer parameters               (Table 1)
    C4  the per-step gain larger early in the continuation than at its last step  (Fig. 1)
    C5  the log Z bounds' calibration: at the n of Table 1, the n_ref reference log Z lies between
        the expected lower and upper bounds (Theorem 2; each bound's expectation is its mean over
        the N / n disjoint groups of the reference's samples)
    C6  joint samples have more unique n-grams than base samples (characters, n = 4, 6, 8:
        about the paper's 1-2 words; word n-grams of 64 characters are all unique)  (Fig. 2 right)
    C7  the difference of log-likelihood means, own samples minus real text, smaller under the
        joint model than under the base LM                              (Fig. 3)
    C6u, C7u  the same on the joint model itself: untruncated LM proposals reweighted by exp(-E),
        beside C6 and C7's Algorithm 1 with top-k proposals (the paper's figures)

And, when the main job fitted the talk's metric energy (Ji et al., ICLR 2024; metric_ebm.py):

    T1  JOINT METRICS's conservative PPL below the base LM's (guaranteed where mu was fitted)
    T2  JOINT METRICS+BIT below JOINT BIT (the talk's aggregation of evaluation functions)
    T3  JOINT METRICS's gain equal to KL(p* || P_LM), the Pythagorean identity's prediction, within
        a margin of half the prediction (an equivalence test); reported as its two terms

A claim holds (true) when its statistic is significant in the paper's direction (|z| > 2, or a
permutation p-value below the same 4.6%), does not hold (false) when significant the other way,
and is not significant (null) otherwise: no verdict holds from a non-significant difference.
Model comparisons are per prefix on the test split (paired: every model scores the same
continuations), a joint model always at its conservative, high-PPL end. STATISTICS below says,
per claim, what is measured, how it is tested, and what it does not show.

    python job/claims.py --out_dir out
"""

import itertools
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from data import read_json, write_json, write_text
from plumbing import ArgumentParser, run_main

Z_SIG = 2.0  # |difference| / SE beyond which a claim is decided
P_SIG = math.erfc(Z_SIG / math.sqrt(2))  # 0.0455: the two-sided p-value of |z| = 2
T3_MARGIN = 0.5  # T3's equivalence margin, a fraction of the predicted gain


def verdict(diff, se):
    """True / False / None (not significant, or no SE: a single prefix) for a difference measured
    in the claim's direction."""
    if not se > 0:
        return None
    z = diff / se
    return True if z > Z_SIG else False if z < -Z_SIG else None


def mean_se(d):
    """Mean and SE over prefixes of per-prefix values d."""
    d = np.asarray(d, dtype=np.float64)
    return dict(diff=float(d.mean()), se=float(d.std(ddof=1) / math.sqrt(len(d))))


def paired(d):
    """Mean and SE over prefixes of per-prefix differences d, with the verdict."""
    res = mean_se(d)
    mean, se = res['diff'], res['se']
    return dict(res, z=mean / se if se > 0 else None, holds=verdict(mean, se), prefixes=len(d))


def log_probs(split):
    """Per prefix log-probs of every model on a split: the base LM, the extra LMs, and each
    joint model at its conservative end (the upper bound of log Z)."""
    cols, n = split['per_prefix'], str(split['num_samples'])
    out = {'BASE LM': np.array(cols['lm_logp'])}
    out.update({name: np.array(v) for name, v in cols['extra_logp'].items()})
    for name, e in cols['energy'].items():
        out[f'JOINT {name}'] = out['BASE LM'] - np.array(e) - np.array(cols['logz'][name][n]['high'])
    return out


def compare(lp, better, worse, L):
    """Per prefix, nats/token by which `better` beats `worse` (positive: the claim's direction)."""
    res = paired((lp[better] - lp[worse]) / L)
    res.update(models=[better, worse],
               ppl={m: float(np.exp(-lp[m].sum() / (len(lp[m]) * L))) for m in (better, worse)})
    return res


def claim_c3(lp, params, L):
    """JOINT BIT beats JOINT UNIT, and with fewer parameters: better with more is not the claim."""
    c3 = compare(lp, 'JOINT BIT', 'JOINT UNIT', L)
    c3['params'] = {m: params[m] for m in ('JOINT BIT', 'JOINT UNIT')}
    if c3['params']['JOINT BIT'] >= c3['params']['JOINT UNIT'] and c3['holds']:
        c3['holds'] = None
    return c3


def claim_c4(per_step):
    """The per-token gain over the LM of the first segment of the continuation minus the exact
    gain at its last step, per prefix."""
    seg = np.array(per_step['per_prefix_gain'])  # (prefixes, segments)
    last = np.array(per_step['per_prefix_last_step_gain_exact'])
    res = paired(seg[:, 0] - last)
    res.update(first_positions=per_step['position'][0], early_gain=float(seg[:, 0].mean()),
               last_step_gain_exact=float(last.mean()),
               last_step_gain_se=mean_se(last)['se'])
    return res


def claim_c5(calibration, energy):
    """The calibration (Theorem 2) of `energy`'s bounds at the n of Table 1, per calibration prefix:
    reference - E[lower] and E[upper] - reference (nats/token; both positive when the expected
    range holds the n_ref reference). It holds when both are significantly positive, fails when
    either is significantly negative (at small n the upper bound's bias is negative too). Shown:
    the weaker side. Not shown: that one n-sample range holds log Z; per prefix it is narrower
    than its own bias (`bracketed`: the share of (prefix, group) ranges that hold the reference)."""
    c = calibration[energy]
    sides = dict(lower=paired(-np.array(c['bias_lower_per_prefix'])),
                 upper=paired(np.array(c['bias_upper_per_prefix'])))
    verdicts = [r['holds'] for r in sides.values()]
    weaker = min(sides.values(), key=lambda r: -math.inf if r['z'] is None else r['z'])
    return dict(weaker, energy=energy, reference_samples=c['reference_samples'],
                holds=False if False in verdicts else True if all(verdicts) else None,
                below_reference=sides['lower'], above_reference=sides['upper'], bracketed=c['bracketed'])


def jackknife(stat, num_prefixes):
    """stat(all prefixes) and its delete-one jackknife SE over prefixes. A bootstrap resample
    repeats prefixes, and a repeated continuation repeats all its n-grams, deflating a pooled
    share of distinct n-grams (C6) and so its bootstrap SE; leaving one out repeats nothing."""
    idx = np.arange(num_prefixes)
    loo = np.array([stat(np.delete(idx, i)) for i in idx])
    se = math.sqrt((num_prefixes - 1) / num_prefixes * ((loo - loo.mean()) ** 2).sum())
    return stat(idx), se


def ngrams(text, n):
    return [text[i:i + n] for i in range(len(text) - n + 1)]


def unique_ngrams(texts, n):
    """% of distinct character n-grams among all character n-grams of the texts, pooled (the
    paper's Fig. 2 right counts word n-grams the same way)."""
    return pooled_unique([ngrams(t, n) for t in texts])


def pooled_unique(grams):
    """% of distinct n-grams among all of grams, a list of each text's n-grams."""
    total = sum(map(len, grams))
    return 100.0 * len(set(itertools.chain.from_iterable(grams))) / total if total else float('nan')


C6_N = (4, 6, 8)  # the n-grams of C6; Fig. 2 right also shows n = 2


def claim_c6(samples, seed, reps=1000):
    """Unique character n-grams of the joint samples minus the base samples', averaged over n in
    C6_N, each kind's continuations pooled (as the paper counts them); its jackknife SE over
    prefixes, and a permutation test: under the null a prefix's joint and base samples are
    exchangeable, so each permutation swaps them in a random half of the prefixes; p: the share of
    permutations at least as far from 0 as the data (two-sided)."""
    recs = samples['samples']
    kinds = [k for k in ('gold', 'base', 'joint') if k in recs[0]]
    texts = {k: [r[k] for r in recs] for k in kinds}
    grams = {k: {n: [ngrams(t, n) for t in texts[k]] for n in C6_N} for k in ('joint', 'base')}

    def stat(idx, swap=None):  # swap: per prefix, whether its joint and base samples trade places
        swap = np.zeros(len(recs), bool) if swap is None else swap
        pick = lambda a, b, n: [grams[b if swap[i] else a][n][i] for i in idx]
        return float(np.mean([pooled_unique(pick('joint', 'base', n))
                              - pooled_unique(pick('base', 'joint', n)) for n in C6_N]))

    diff, se = jackknife(stat, len(recs))
    swaps = np.random.default_rng(seed).random((reps, len(recs))) < 0.5
    every = np.arange(len(recs))
    null = np.array([stat(every, s) for s in swaps])
    p = float((1 + (np.abs(null) >= abs(diff) - 1e-12).sum()) / (1 + reps))
    ns = (2,) + C6_N
    return dict(diff=diff, se=se, z=diff / se if se > 0 else None, p=p, permutations=reps,
                holds=None if p >= P_SIG else diff > 0, prefixes=len(recs), n=list(ns),
                top_k=samples.get('args', {}).get('top_k'),
                unique_pct={k: [unique_ngrams(t, n) for n in ns] for k, t in texts.items()})


def claim_c7(samples):
    """|mean(own samples) - mean(real)| of log-likelihoods under the base LM minus the same under
    the joint model (log P_LM - E - log Z; log Z cancels within a prefix), per sequence, with its
    jackknife SE over prefixes."""
    recs = samples['samples']
    base = np.array([r['lm_logp']['base'] - r['lm_logp']['gold'] for r in recs])
    joint = np.array([(r['lm_logp']['joint'] - r['joint_energy']) - (r['lm_logp']['gold'] - r['gold_energy'])
                      for r in recs])
    diff, se = jackknife(lambda i: float(abs(base[i].mean()) - abs(joint[i].mean())), len(recs))
    return dict(diff=diff, se=se, z=diff / se if se > 0 else None, holds=verdict(diff, se),
                prefixes=len(recs), base_diff_of_means=float(base.mean()),
                joint_diff_of_means=float(joint.mean()), top_k=samples.get('args', {}).get('top_k'))


def lm_convergence(out_dir):
    """Each LM's stopping: best and last step, best selection loss, and whether the stopping rule
    (train_lm.stopped_early) fired before the step cap."""
    res = {}
    for name, folder in (('BASE', 'lm'), ('RALM', 'ralm'), ('BALM', 'balm'), ('TAILR', 'tailr')):
        path = os.path.join(out_dir, folder, 'results.json')
        if name == 'TAILR' and not os.path.exists(path):
            continue
        r = read_json(path, 'rerun its stage (reproduce.py)')
        res[name] = dict(best_step=r.get('best_iter'), last_step=r.get('last_iter', r['iters']),
                         best_select_loss=r['best_select_loss'], converged=r.get('converged', False),
                         params=r['params'], val_loss=r.get('val_loss'))
    return res


def measure(out_dir, split='test', seed=0):
    """claims.json's content from a finished main job's folder."""
    path = os.path.join(out_dir, 'ppl.json')
    ppl = read_json(path, 'run estimate_ppl.py (reproduce.py runs it)')
    if not isinstance(ppl, dict) or not isinstance(ppl.get('splits'), dict) or not ppl['splits']:
        raise ValueError(f"{path} holds no split: rerun estimate_ppl.py (reproduce.py runs it)")
    if split not in ppl['splits']:
        raise ValueError(f"--split {split}: {path} has only {', '.join(ppl['splits'])}")
    samples = read_json(os.path.join(out_dir, 'samples.json'), 'run sample.py (reproduce.py runs it)')
    res = ppl['splits'][split]
    L, lp = res['gen_len'], log_probs(res)
    claims = dict(C1=compare(lp, 'JOINT BIT', 'BALM', L), C2=compare(lp, 'JOINT UNIT', 'RALM', L),
                  C3=claim_c3(lp, {r['model']: r['params'] for r in ppl['rows']}, L),
                  C4=claim_c4(res['per_step']))
    if res.get('calibration'):
        if 'bias_upper_per_prefix' not in next(iter(res['calibration'].values())):
            raise ValueError(f"{path} has no per-prefix calibration (an older estimate_ppl.py): rerun it")
        claims['C5'] = claim_c5(res['calibration'], res['per_step']['energy'])
    claims.update(C6=claim_c6(samples, seed), C7=claim_c7(samples))
    untruncated = os.path.join(out_dir, 'samples_untruncated.json')
    if os.path.exists(untruncated):
        samples = read_json(untruncated, 'rerun sample.py --top_k 0 (reproduce.py runs it)')
        claims.update(C6u=claim_c6(samples, seed), C7u=claim_c7(samples))
    if 'JOINT METRICS' in lp:
        claims.update(talk_claims(lp, res, L))
    return dict(split=split, lms=lm_convergence(out_dir), claims=claims, statistics=STATISTICS)


def talk_claims(lp, res, L):
    """T1-T3 (Ji et al.'s talk): the metric energy's gain, the aggregation, and the Pythagorean prediction."""
    out = dict(T1=compare(lp, 'JOINT METRICS', 'BASE LM', L))
    if 'JOINT METRICS+BIT' in lp:
        out['T2'] = compare(lp, 'JOINT METRICS+BIT', 'JOINT BIT', L)
    cols, n = res['per_prefix'], str(res['num_samples'])
    per_token = lambda v: np.array(v) / L
    out['T3'] = claim_t3((lp['JOINT METRICS'] - lp['BASE LM']) / L, per_token(cols['kl']['METRICS']),
                         per_token(cols['energy']['METRICS']), per_token(cols['logz']['METRICS'][n]['low']),
                         per_token(cols['logz']['METRICS'][n]['high']))
    return out


def claim_t3(gain, kl, e_real, T_n, high):
    """Measured gain minus KL(p* || P_LM), per prefix and token, and its two terms:
        gain - KL = mu . (E_p*[f] - f_real) - (high - T_n)
    (KL = -mu . E_p*[f] - T_n over the same n samples), the moment transfer (0 where mu was fitted,
    the identity then exact) minus the bound's width (>= 0). An equivalence test: holds when
    the 2-SE interval lies within +-T3_MARGIN x the mean prediction, fails when it lies outside."""
    res = paired(gain - kl)
    margin = T3_MARGIN * float(kl.mean())
    lo, hi = res['diff'] - Z_SIG * res['se'], res['diff'] + Z_SIG * res['se']
    res.update(margin=margin, predicted_gain=float(kl.mean()), measured_gain=float(gain.mean()),
               moment_transfer=mean_se(-kl - T_n - e_real), bound_width=mean_se(high - T_n),
               holds=True if -margin < lo and hi < margin else False if lo > margin or hi < -margin else None)
    return res


STATISTICS = dict(  # per claim: what is measured, how it is tested, what it does not show
    C1='per-prefix difference of log-probs (nats/token), JOINT BIT at its high end; paired z; not '
       'shown: the joint model at its true PPL, which lies inside the range',
    C2='the same, JOINT UNIT against RALM', C3='the same, JOINT BIT against JOINT UNIT, and the '
    'parameter counts; a better BIT with more parameters is not significant',
    C4='gain of the first segment minus the exact last-step gain (Eq. 5), per prefix; paired z',
    C5='reference log Z (n_ref samples) minus the mean lower bound, and mean upper bound minus it, '
       'per prefix; both z > 2: holds; not shown: that one n-sample range holds the true log Z',
    C6='pooled unique character n-grams (n = 4, 6, 8), joint minus base; jackknife SE, permutation '
       'p (joint and base swapped within prefixes); not shown: that the joint model is more diverse '
       'than real text',
    C7='|mean log-lik. gap to real text| under the base LM minus under the joint model (nats per '
       'sequence); jackknife SE; with top-k proposals the gap is mostly truncation (C7u: without)',
    C6u='C6 with untruncated proposals: samples of the joint model itself',
    C7u='C7 with untruncated proposals: samples of the joint model itself',
    T1='as C1, JOINT METRICS against the base LM', T2='as C1, JOINT METRICS+BIT against JOINT BIT',
    T3='gain minus KL(p*||P_LM) per prefix, an equivalence test with margin half the prediction; '
       'its terms: moment transfer from the split mu was fitted on, minus the bound width; on test '
       'it measures the transfer, not the identity (exact where the moments match)')

CLAIM_TEXT = dict(C1='JOINT BIT below BALM (PPL)', C2='JOINT UNIT below RALM (PPL)',
                  C3='JOINT BIT below JOINT UNIT, fewer params', C4='per-step gain: early > last step',
                  C5='log Z bounds bracket the n_ref reference',
                  C6='Alg. 1 (top-k): more unique char n-grams',
                  C7='Alg. 1 (top-k): closer to real log-lik.', C6u='joint model: more unique char n-grams',
                  C7u='joint model: closer to real log-lik.', T1='JOINT METRICS below BASE LM (PPL)',
                  T2='JOINT METRICS+BIT below JOINT BIT (PPL)', T3='METRICS gain = KL(p*||P_LM) (+-50%)')
UNITS = dict(C1='nats/token', C2='nats/token', C3='nats/token', C4='nats/token', C5='nats/token',
             C6='% points', C7='nats/sequence', C6u='% points', C7u='nats/sequence', T1='nats/token',
             T2='nats/token', T3='nats/token')


def format_claims(result):
    lines = [f"{'claim':<5} {'what':<44} {'difference (SE)':>22} {'unit':<13} verdict"]
    for k, c in result['claims'].items():
        v = {True: 'holds', False: 'does not hold', None: 'not significant'}[c['holds']]
        if k == 'T3' and c['holds'] is None:
            v = 'inconclusive'
        extra = f" (permutation p {c['p']:.3f})" if 'p' in c else ''
        lines.append(f"{k:<5} {CLAIM_TEXT[k]:<44} {c['diff']:>+12.5f} ({c['se']:.5f}) {UNITS[k]:<13} "
                     f"{v}{extra}")
    if 'T3' in result['claims']:
        t3 = result['claims']['T3']
        lines.append(f"T3's terms: moment transfer {t3['moment_transfer']['diff']:+.5f} "
                     f"({t3['moment_transfer']['se']:.5f}) minus bound width {t3['bound_width']['diff']:.5f} "
                     f"({t3['bound_width']['se']:.5f}); margin +-{t3['margin']:.5f}")
    for name, m in result['lms'].items():
        why = 'converged: the stopping rule fired' if m['converged'] else 'NOT converged: stopped at the cap'
        lines.append(f"{name}: best selection loss {m['best_select_loss']:.4f} at step {m['best_step']} of "
                     f"{m['last_step']} ({why})")
    return '\n'.join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('--out_dir', default='out',
                   help="the main job's folder (ppl.json, samples.json, lm/, ralm/, balm/)")
    p.add_argument('--split', default='test', help='the split of the model comparisons')
    p.add_argument('--seed', type=int, default=1337, help="of C6's permutation test")
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    result = measure(args.out_dir, args.split, args.seed)
    text = format_claims(result)
    write_json(result, os.path.join(args.out_dir, 'claims.json'))
    write_text(text + '\n', os.path.join(args.out_dir, 'claims.txt'))
    print(text + f"\n-> {os.path.join(args.out_dir, 'claims.json')}")
    return result


if __name__ == '__main__':
    run_main(main)

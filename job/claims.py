"""
The paper's claims, each as a measured number with its standard error over prefixes, from the
main job's outputs (ppl.json of estimate_ppl.py, samples.json of sample.py, the LMs'
results.json). Writes claims.json and claims.txt:

    C1  JOINT BIT's conservative PPL below BALM's                       (Table 1)
    C2  JOINT UNIT's conservative PPL below RALM's (same architecture)  (Table 1)
    C3  JOINT BIT below JOINT UNIT, with fewer parameters               (Table 1)
    C4  the per-step gain larger early in the continuation than at its last step  (Fig. 1)
    C5  the bounds of log Z close in as n grows                         (Fig. 2 left, Theorem 2)
    C6  joint samples have more unique n-grams than base samples (characters, n = 4, 6, 8:
        about the paper's 1-2 words; word n-grams of 64 characters are all unique)  (Fig. 2 right)
    C7  the difference of log-likelihood means, own samples minus real text, smaller under the
        joint model than under the base LM                              (Fig. 3)

And, when the main job fitted the talk's metric energy (Ji et al., ICLR 2024; metric_ebm.py):

    T1  JOINT METRICS's conservative PPL below the base LM's (guaranteed where mu was fitted)
    T2  JOINT METRICS+BIT below JOINT BIT (the talk's aggregation of evaluation functions)
    T3  JOINT METRICS's gain equal to KL(p* || P_LM), the Pythagorean identity's prediction
        (holds: within 2 SE of it; does not hold: further)

A claim holds (true) when its measured difference is more than 2 SE in the paper's direction,
does not hold (false) when it is more than 2 SE the other way, and is not significant (null)
otherwise. Model comparisons are per prefix on the test split (paired: every model scores the
same continuations), a joint model always at its conservative, high-PPL end. C6 and C7 use a
bootstrap over prefixes (their statistics are not per-prefix means).

    python job/claims.py --out_dir out
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from data import read_json, write_json, write_text
from plumbing import ArgumentParser, run_main

Z_SIG = 2.0  # |difference| / SE beyond which a claim is decided


def verdict(diff, se):
    """True / False / None (not significant, or no SE: a single prefix) for a difference measured
    in the claim's direction."""
    if not se > 0:
        return None
    z = diff / se
    return True if z > Z_SIG else False if z < -Z_SIG else None


def paired(d):
    """Mean and SE over prefixes of per-prefix differences d, with the verdict."""
    d = np.asarray(d, dtype=np.float64)
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    return dict(diff=mean, se=se, z=mean / se if se > 0 else None, holds=verdict(mean, se), prefixes=len(d))


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


def claim_c4(per_step):
    """The per-token gain over the LM of the first segment of the continuation minus the exact
    gain at its last step, per prefix."""
    seg = np.array(per_step['per_prefix_gain'])  # (prefixes, segments)
    last = np.array(per_step['per_prefix_last_step_gain_exact'])
    res = paired(seg[:, 0] - last)
    res.update(first_positions=per_step['position'][0], early_gain=float(seg[:, 0].mean()),
               last_step_gain_exact=float(last.mean()),
               last_step_gain_se=float(last.std(ddof=1) / math.sqrt(len(last))))
    return res


def claim_c5(split, energy, L):
    """Width of the log Z range (upper - lower bound, nats/token) at the smallest n of the sweep
    minus at the largest, per prefix."""
    logz = split['per_prefix']['logz'][energy]
    ns = sorted(logz, key=int)
    width = {n: (np.array(logz[n]['high']) - np.array(logz[n]['low'])) / L for n in ns}
    res = paired(width[ns[0]] - width[ns[-1]])
    res.update(energy=energy, n=[int(ns[0]), int(ns[-1])],
               width_by_n={n: float(w.mean()) for n, w in width.items()})
    return res


def bootstrap(stat, num_prefixes, seed, reps=1000):
    """stat(all prefixes) and its bootstrap SE over prefixes (resampled with replacement)."""
    rng = np.random.default_rng(seed)
    draws = [stat(rng.integers(num_prefixes, size=num_prefixes)) for _ in range(reps)]
    return stat(np.arange(num_prefixes)), float(np.std(draws, ddof=1))


def unique_ngrams(texts, n):
    """% of distinct character n-grams among all character n-grams of the texts, pooled (the
    paper's Fig. 2 right counts word n-grams the same way)."""
    grams = [t[i:i + n] for t in texts for i in range(len(t) - n + 1)]
    return 100.0 * len(set(grams)) / len(grams) if grams else float('nan')


C6_N = (4, 6, 8)  # the n-grams of C6; Fig. 2 right also shows n = 2


def claim_c6(samples, seed):
    """Unique character n-grams of the joint samples minus the base samples', averaged over
    n in C6_N, over all prefixes' continuations pooled (as the paper counts them)."""
    recs = samples['samples']
    kinds = [k for k in ('gold', 'base', 'joint') if k in recs[0]]
    texts = {k: np.array([r[k] for r in recs], dtype=object) for k in kinds}
    stat = lambda i: float(np.mean([unique_ngrams(texts['joint'][i], n) - unique_ngrams(texts['base'][i], n)
                                    for n in C6_N]))
    diff, se = bootstrap(stat, len(recs), seed)
    ns = (2,) + C6_N
    return dict(diff=diff, se=se, z=diff / se if se > 0 else None, holds=verdict(diff, se),
                prefixes=len(recs), n=list(ns),
                unique_pct={k: [unique_ngrams(t, n) for n in ns] for k, t in texts.items()})


def claim_c7(samples, seed):
    """|mean(own samples) - mean(real)| of log-likelihoods under the base LM minus the same under
    the joint model (log P_LM - E - log Z; log Z cancels within a prefix), per sequence."""
    recs = samples['samples']
    base = np.array([r['lm_logp']['base'] - r['lm_logp']['gold'] for r in recs])
    joint = np.array([(r['lm_logp']['joint'] - r['joint_energy']) - (r['lm_logp']['gold'] - r['gold_energy'])
                      for r in recs])
    stat = lambda i: float(abs(base[i].mean()) - abs(joint[i].mean()))
    diff, se = bootstrap(stat, len(recs), seed)
    return dict(diff=diff, se=se, z=diff / se if se > 0 else None, holds=verdict(diff, se),
                prefixes=len(recs), base_diff_of_means=float(base.mean()),
                joint_diff_of_means=float(joint.mean()))


def lm_convergence(out_dir):
    """Each LM's early stopping: best and last step, best selection loss, whether it stopped
    because the selection loss no longer improved."""
    res = {}
    for name, folder in (('BASE', 'lm'), ('RALM', 'ralm'), ('BALM', 'balm')):
        r = read_json(os.path.join(out_dir, folder, 'results.json'), 'rerun its stage (reproduce.py)')
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
    L = res['gen_len']
    lp = log_probs(res)
    params = {r['model']: r['params'] for r in ppl['rows']}
    c3 = compare(lp, 'JOINT BIT', 'JOINT UNIT', L)
    c3['params'] = {m: params[m] for m in ('JOINT BIT', 'JOINT UNIT')}
    if c3['params']['JOINT BIT'] >= c3['params']['JOINT UNIT'] and c3['holds']:
        c3['holds'] = None  # better, but not with fewer parameters
    claims = dict(C1=compare(lp, 'JOINT BIT', 'BALM', L), C2=compare(lp, 'JOINT UNIT', 'RALM', L), C3=c3,
                  C4=claim_c4(res['per_step']), C5=claim_c5(res, res['per_step']['energy'], L),
                  C6=claim_c6(samples, seed), C7=claim_c7(samples, seed))
    if 'JOINT METRICS' in lp:
        claims.update(talk_claims(lp, res, L))
    return dict(split=split, lms=lm_convergence(out_dir), claims=claims)


def talk_claims(lp, res, L):
    """T1-T3 (Ji et al.'s talk): the metric energy's gain, the aggregation, and the Pythagorean prediction."""
    out = dict(T1=compare(lp, 'JOINT METRICS', 'BASE LM', L))
    if 'JOINT METRICS+BIT' in lp:
        out['T2'] = compare(lp, 'JOINT METRICS+BIT', 'JOINT BIT', L)
    t3 = paired((lp['JOINT METRICS'] - lp['BASE LM']) / L - np.array(res['per_prefix']['kl']['METRICS']) / L)
    t3['holds'] = None if t3['z'] is None else abs(t3['z']) <= Z_SIG
    out['T3'] = t3
    return out


CLAIM_TEXT = dict(C1='JOINT BIT below BALM (PPL)', C2='JOINT UNIT below RALM (PPL)',
                  C3='JOINT BIT below JOINT UNIT, fewer params', C4='per-step gain: early > last step',
                  C5='log Z range narrows as n grows', C6='joint: more unique char 4-8-grams',
                  C7='joint closer to real text (log-lik. means)', T1='JOINT METRICS below BASE LM (PPL)',
                  T2='JOINT METRICS+BIT below JOINT BIT (PPL)', T3='METRICS gain = KL(p*||P_LM) (Pythagoras)')
UNITS = dict(C1='nats/token', C2='nats/token', C3='nats/token', C4='nats/token', C5='nats/token',
             C6='% points', C7='nats/sequence', T1='nats/token', T2='nats/token', T3='nats/token')


def format_claims(result):
    lines = [f"{'claim':<4} {'what':<44} {'difference (SE)':>22} {'unit':<13} verdict"]
    for k, c in result['claims'].items():
        v = {True: 'holds', False: 'does not hold', None: 'not significant'}[c['holds']]
        lines.append(f"{k:<4} {CLAIM_TEXT[k]:<44} {c['diff']:>+12.5f} ({c['se']:.5f}) {UNITS[k]:<13} {v}")
    for name, m in result['lms'].items():
        lines.append(f"{name}: best selection loss {m['best_select_loss']:.4f} at step {m['best_step']} of "
                     f"{m['last_step']} "
                     f"({'converged: early-stopped' if m['converged'] else 'NOT converged'})")
    return '\n'.join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('--out_dir', default='out',
                   help="the main job's folder (ppl.json, samples.json, lm/, ralm/, balm/)")
    p.add_argument('--split', default='test', help='the split of the model comparisons')
    p.add_argument('--seed', type=int, default=1337, help='of the bootstrap')
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

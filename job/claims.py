"""
The paper's claims, each a test with a stated statistic, from the main job's outputs (ppl.json
of estimate_ppl.py, samples.json and samples_untruncated.json of sample.py, the LMs'
results.json). Writes claims.json and claims.txt:

    C1  JOINT BIT's conservative PPL below BALM's                       (Table 1)
    C2  JOINT UNIT's conservative PPL below RALM's (same architecture)  (Table 1)
    C3  JOINT BIT below JOINT UNIT, with fewer parameters               (Table 1)
    C4  the per-step gain larger early in the continuation than at its last step, the early gain
        at its conservative end  (Fig. 1)
    C5  the log Z bounds' calibration: at the n of Table 1, the expected lower bound lies below an
        n_ref-sample reference log Z and the expected upper bound above it (Theorem 2; each bound's
        expectation is its mean over groups of n samples drawn apart from the reference's)
    C6  joint samples have more unique n-grams than base samples (characters, n = 4, 6, 8, about
        one or two words: the paper's n = 2-4, of units it does not name, over longer texts; word
        n-grams of 64 characters are all unique)                        (Fig. 2 right)
    C7  the difference of log-likelihood means, own samples minus real text, smaller under the
        joint model than under the base LM                              (Fig. 3)
    C6u, C7u  the same on the joint model itself: untruncated LM proposals reweighted by exp(-E),
        beside C6 and C7's Algorithm 1 with top-k proposals (the paper's figures)

And, when the main job fitted the talk's metric energy (Ji et al., ICLR 2024; metric_ebm.py):

    T1  JOINT METRICS's conservative PPL below the base LM's (guaranteed where mu was fitted)
    T2  JOINT METRICS+BIT below JOINT BIT (the talk's aggregation of evaluation functions)
    T3  JOINT METRICS's gain equal to KL(p* || P_LM), the Pythagorean identity's prediction, within
        a margin of half the prediction (an equivalence test); reported as its two terms

A claim holds (true) when its statistic is significant in the paper's direction, does not hold
(false) when significant the other way, and is not significant (null) otherwise: no verdict holds
from a non-significant difference. Every claim has a two-sided p-value (`p`): Student's t with
prefixes - 1 degrees of freedom for a mean or jackknife over prefixes, a studentised permutation
test for C6 and C7; `holds` decides at ALPHA = 4.55% (the level of |z| > 2) alone, `holds_holm`
at the same family-wise level over all the claims of the file, by Holm's (1979) step-down method
(the tests themselves: job/stats.py). Model comparisons are per prefix on the test split (paired:
every model scores the same continuations), a joint model always at its conservative, high-PPL
end. STATISTICS below says, per claim, what is measured, how it is tested, and what it does not
show.

    python -m job.claims --out_dir out
"""

import itertools
import math
import os
import sys

import numpy as np

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.claims")
from job import (ACCURACY, ACCURACY_FIX, NUMBER, NUMBER_OR_NULL, NUMBERS, check_same_lm, check_same_model,
                 check_shape, decoder_pairs, input_hashes, read_report)
from job.stats import (ALPHA, correct, decide, equivalence_p, format_log_p, format_p, jackknife_se, mcnemar,
                       mean_se, p_of, paired, studentised_permutation)
from plumbing import ArgumentParser, common_flags, run_main, write_json, write_text

T3_MARGIN = 0.5  # T3's equivalence margin, a fraction of the predicted gain


def log_probs(split):
    """Per prefix log-probs of every model on a split: the base LM, the extra LMs, and each
    joint model at its conservative end (the upper bound of log Z)."""
    cols, n = split['per_prefix'], str(split['num_samples'])
    out = {'BASE LM': np.array(cols['lm_logp'])}
    out.update({name: np.array(v) for name, v in cols['extra_logp'].items()})
    for name, e in cols['energy'].items():
        out[f'JOINT {name}'] = out['BASE LM'] - np.array(e) - np.array(cols['logz'][name][n]['high'])
    return out


def enumerated_log_probs(split):
    """As log_probs, each joint model with log Z from energy.logz_enumerate (an estimate), where
    estimate_ppl.py wrote it; {} otherwise."""
    cols = split['per_prefix']
    lp = np.array(cols['lm_logp'])
    return {f'JOINT {name}': lp - np.array(cols['energy'][name]) - np.array(z['estimate'])
            for name, z in cols.get('enum', {}).items()}


def withhold_if_flagged(claim, split, lp, L):
    """A claim on joint models whose Eq. 4 ranges logz_diagnostics flags on any prefix gets no verdict
    and no p (it leaves Holm's family): those ranges are not bounds. It keeps, labelled an estimate, the
    same comparison with log Z from logz_enumerate."""
    enum = split['per_prefix'].get('enum', {})
    flagged = {m: float(np.mean(enum[m[6:]]['flagged'])) for m in claim['models']
               if m.startswith('JOINT ') and m[6:] in enum}
    if not any(flagged.values()):
        return claim
    est = compare(dict(lp, **enumerated_log_probs(split)), *claim['models'], L)
    claim.update(holds=None, p=None, eq4_flagged=flagged,
                 not_measurable="Eq. 4's range is flagged (energy.logz_diagnostics) on " + ', '.join(
                     f"{100 * v:.1f}% of {m}'s prefixes" for m, v in flagged.items() if v),
                 enumerated=dict(est, p=p_of(est['log_p'])))  # out of Holm's family: stored as it prints
    return claim


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


def either_end(low, high):
    """A claim on a quantity known as a range per prefix (low <= high in expectation): it holds
    when the low end is significantly positive, fails when the high end is significantly negative.
    p: that end's two-sided p-value (1 when the range straddles 0); shown: that end's statistic."""
    lo, hi = paired(low), paired(high)
    side = lo if lo['diff'] > 0 else hi if hi['diff'] < 0 else None
    if side is None:  # the mean range straddles 0: neither end can decide
        return dict(lo, p=1.0, holds=None)
    decided = lo['holds'] is True if side is lo else hi['holds'] is False
    return dict(side, holds=(side is lo) if decided else None)


def claim_c4(per_step):
    """The per-token gain over the LM of the first segment of the continuation minus the exact gain
    at its last step, per prefix. The early gain is a range from the bounds of log Z at its two
    ends (Eq. 4 in Eq. 5: low numerator over high denominator, and the reverse); the claim holds
    from its conservative (low) end, fails from its high end: no midpoint, whose bias (up to half
    the bounds' width at each end) is larger at k = 0, in the claim's direction."""
    if 'per_prefix_gain_low' not in per_step:
        raise ValueError("ppl.json's per_step has no per_prefix_gain_low (an older estimate_ppl.py): "
                         "rerun it")
    last = np.array(per_step['per_prefix_last_step_gain_exact'])
    low, high = (np.array(per_step[f'per_prefix_gain_{end}'])[:, 0] for end in ('low', 'high'))
    res = either_end(low - last, high - last)
    res.update(first_positions=per_step['position'][0], early_gain=float(np.mean(per_step['per_prefix_gain'],
                                                                                  0)[0]),
               early_gain_low=float(low.mean()), early_gain_high=float(high.mean()),
               last_step_gain_exact=float(last.mean()), last_step_gain_se=mean_se(last)['se'])
    return res


def claim_c5(calibration, energy):
    """The calibration (Theorem 2) of `energy`'s bounds at the n of Table 1, per calibration prefix:
    reference - E[lower] and E[upper] - reference (nats/token; both positive when the expected
    range holds the reference), the reference from n_ref samples drawn apart from the groups that
    give E[lower] and E[upper] (estimate_ppl.calibrate): each side can come out either way. Holds
    when both are significantly positive (t, prefixes - 1 df), fails when either is significantly
    negative (at small n with heavy tails the upper bound's bias is negative). Shown: the weaker
    side. Not shown: that one n-sample range holds log Z (`bracketed`: the share of (prefix,
    group) ranges that hold the reference)."""
    c = calibration[energy]
    if not c.get('independent_reference'):
        raise ValueError("ppl.json's calibration has its reference from the groups' own samples "
                         "(an older estimate_ppl.py): rerun it")
    sides = dict(lower=paired(-np.array(c['bias_lower_per_prefix'])),
                 upper=paired(np.array(c['bias_upper_per_prefix'])))
    verdicts = [r['holds'] for r in sides.values()]
    weaker = min(sides.values(), key=lambda r: -math.inf if r['z'] is None else r['z'])
    return dict(weaker, energy=energy, reference_samples=c['reference_samples'],
                holds=False if False in verdicts else True if all(verdicts) else None,
                below_reference=sides['lower'], above_reference=sides['upper'], bracketed=c['bracketed'])


def ngrams(text, n):
    return [text[i:i + n] for i in range(len(text) - n + 1)]


def unique_ngrams(texts, n):
    """% of distinct character n-grams among all character n-grams of the texts, pooled (the
    paper's Fig. 2 right pools its n-grams the same way)."""
    return pooled_unique([ngrams(t, n) for t in texts])


def pooled_unique(grams):
    """% of distinct n-grams among all of grams, a list of each text's n-grams."""
    total = sum(map(len, grams))
    return 100.0 * len(set(itertools.chain.from_iterable(grams))) / total if total else float('nan')


C6_N = (4, 6, 8)  # the n-grams of C6; this project's Fig. 2 right also shows n = 2
PERMUTATIONS = 1000


class PooledGrams:
    """The character n-grams of each prefix's two texts (kinds a and b) as integer ids, for the
    pooled share of distinct n-grams (pooled_unique) of either pool under any swap, and its
    leave-one-prefix-out values, from counts (no set per left-out prefix)."""

    def __init__(self, texts_a, texts_b, n):
        grams = [[ngrams(t, n) for t in texts] for texts in (texts_a, texts_b)]
        vocab = {g: i for i, g in enumerate(sorted(set(itertools.chain.from_iterable(
            itertools.chain.from_iterable(grams)))))}
        self.V, self.N = len(vocab), len(texts_a)
        self.kinds = []
        for per_text in grams:  # per kind: each text's distinct ids, their counts, and the text
            ids, counts = zip(*[np.unique(np.array([vocab[g] for g in gs], dtype=np.int64),
                                          return_counts=True) for gs in per_text])
            owner = np.concatenate([np.full(len(u), i) for i, u in enumerate(ids)]).astype(np.int64)
            self.kinds.append((np.concatenate(ids).astype(np.int64), np.concatenate(counts), owner,
                               np.array([len(gs) for gs in per_text], dtype=np.float64)))

    def shares(self, take_b):
        """(share of the whole pool, leave-one-out shares (N,)) in %, the pool taking prefix i's
        text of kind b where take_b[i], of kind a elsewhere."""
        parts = [(ids[m], cnt[m], own[m]) for (ids, cnt, own, _), m in
                 zip(self.kinds, (~take_b[self.kinds[0][2]], take_b[self.kinds[1][2]]))]
        ids, cnt, own = (np.concatenate(x) for x in zip(*parts))
        lengths = np.where(take_b, self.kinds[1][3], self.kinds[0][3])
        total = np.bincount(ids, weights=cnt, minlength=self.V)
        distinct, size = float((total > 0).sum()), lengths.sum()
        only_here = np.bincount(own, weights=(total[ids] == cnt), minlength=self.N)  # ids no other text has
        with np.errstate(invalid='ignore', divide='ignore'):
            return 100 * distinct / size, 100 * (distinct - only_here) / (size - lengths)


def claim_c6(samples, seed, reps=PERMUTATIONS):
    """Unique character n-grams of the joint samples minus the base samples', averaged over n in
    C6_N, each kind's continuations pooled (as the paper counts them); its jackknife SE over
    prefixes, and a studentised permutation test (studentised_permutation): under the null a
    prefix's joint and base samples trade places, and each permutation's difference is divided by
    its own jackknife SE."""
    recs = samples['samples']
    kinds = [k for k in ('gold', 'base', 'joint') if k in recs[0]]
    texts = {k: [r[k] for r in recs] for k in kinds}
    pools = [PooledGrams(texts['joint'], texts['base'], n) for n in C6_N]

    def stat_se(swap):
        whole, loo = np.zeros(2), np.zeros((2, len(recs)))
        for g in pools:
            for side, take in enumerate((swap, ~swap)):
                w, l = g.shares(take)
                whole[side], loo[side] = whole[side] + w / len(pools), loo[side] + l / len(pools)
        return float(whole[0] - whole[1]), float(jackknife_se(loo[0] - loo[1]))

    diff, se, t, p = studentised_permutation(stat_se, len(recs), seed, reps)
    ns = (2,) + C6_N
    return dict(diff=diff, se=se, z=t, p=p, permutations=reps,
                holds=decide(diff, p), prefixes=len(recs), n=list(ns),
                top_k=samples.get('args', {}).get('top_k'),
                unique_pct={k: [unique_ngrams(t, n) for n in ns] for k, t in texts.items()})


def claim_c7(samples, seed=0, reps=PERMUTATIONS):
    """|mean(own samples) - mean(real)| of log-likelihoods under the base LM minus the same under
    the joint model (log P_LM - E - log Z; log Z cancels within a prefix), per sequence, with its
    jackknife SE over prefixes and a studentised permutation test (studentised_permutation): under
    the null a prefix's two gaps to real text, the base LM's and the joint model's, trade places."""
    recs = samples['samples']
    base = np.array([r['lm_logp']['base'] - r['lm_logp']['gold'] for r in recs])
    joint = np.array([(r['lm_logp']['joint'] - r['joint_energy']) - (r['lm_logp']['gold'] - r['gold_energy'])
                      for r in recs])
    N = len(recs)

    def stat_se(swap):
        a, b = np.where(swap, joint, base), np.where(swap, base, joint)
        loo = lambda v: (v.sum() - v) / (N - 1)
        return float(abs(a.mean()) - abs(b.mean())), float(jackknife_se(np.abs(loo(a)) - np.abs(loo(b))))

    diff, se, t, p = studentised_permutation(stat_se, N, seed, reps)
    return dict(diff=diff, se=se, z=t, p=p,
                permutations=reps, holds=decide(diff, p), prefixes=N, base_diff_of_means=float(base.mean()),
                joint_diff_of_means=float(joint.mean()), top_k=samples.get('args', {}).get('top_k'))


def same_samples(a, b):
    """The share of prefixes whose joint and base texts are the same in both samples files."""
    ra, rb = a['samples'], b['samples']
    if len(ra) != len(rb):
        return 0.0
    return sum(x['joint'] == y['joint'] and x['base'] == y['base'] for x, y in zip(ra, rb)) / len(ra)


LMS = (('BASE', 'lm', 'BASE LM'), ('RALM', 'ralm', 'RALM'), ('BALM', 'balm', 'BALM'),
       ('TAILR', 'tailr', 'TAILR'))  # claims.json's name, the folder, ppl.json's name
LM_RESULTS = {'params': int, 'iters': int, 'best_select_loss': NUMBER, 'best_iter?': int, 'last_iter?': int,
              'converged?': bool, 'patience?': int, 'val_loss?': NUMBER_OR_NULL}


def lm_convergence(out_dir, ppl, ppl_path):
    """Each LM's stopping: best and last step, best selection loss, and whether the stopping rule
    (model.stopped_early) fired before the step cap or the LM trained a fixed budget (patience 0);
    each results.json of the LM ppl.json scored."""
    res = {}
    for name, folder, model in LMS:
        path = os.path.join(out_dir, folder, 'results.json')
        if name == 'TAILR' and not os.path.exists(path):
            continue
        r = read_report(out_dir, os.path.join(folder, 'results.json'), 'rerun its stage (reproduce.py)',
                        LM_RESULTS)
        check_same_model(r, path, model, ppl, ppl_path)
        res[name] = dict(best_step=r.get('best_iter'), last_step=r.get('last_iter', r['iters']),
                         best_select_loss=r['best_select_loss'], converged=r.get('converged', False),
                         fixed_budget=r.get('patience') == 0,
                         params=r['params'], val_loss=r.get('val_loss'))
    return res


# what claims.py reads of ppl.json (estimate_ppl.py) and samples.json (sample.py)
PPL_RUN = {'rows': [{'model': str, 'params': int}], 'hashes?': {'*': str}}
PER_PREFIX = {'lm_logp': NUMBERS, 'extra_logp': {'*': NUMBERS}, 'energy': {'*': NUMBERS},
              'logz': {'*': {'*': {'low': NUMBERS, 'high': NUMBERS}}}, 'kl?': {'*': NUMBERS},
              'enum?': {'*': {'estimate': NUMBERS, 'flagged': NUMBERS}}}
PER_STEP = {'energy': str, 'position': list, 'per_prefix_gain': [NUMBERS],
            'per_prefix_last_step_gain_exact': NUMBERS, 'per_prefix_gain_low?': [NUMBERS],
            'per_prefix_gain_high?': [NUMBERS]}
PPL_SPLIT = {'gen_len': int, 'num_samples': int, 'per_prefix': PER_PREFIX, 'per_step?': PER_STEP,
             'calibration?': {'*': dict}}
SAMPLE = {'base': str, 'joint': str, 'gold?': str, 'joint_energy': NUMBER, 'gold_energy': NUMBER,
          'lm_logp': {'base': NUMBER, 'joint': NUMBER, 'gold': NUMBER}}
SAMPLES = {'args?': {'lm?': str}, 'samples': [SAMPLE]}
NEEDED = {'extra_logp': ('RALM', 'BALM'), 'energy': ('BIT', 'UNIT')}  # C1-C3's models
PPL_FIX = 'rerun estimate_ppl.py (reproduce.py runs it)'


def read_ppl(out_dir, split):
    """ppl.json and its split `split`, checked: the shape claims.py reads, C1-C3's models, one
    value per prefix in every column."""
    path = os.path.join(out_dir, 'ppl.json')
    ppl = read_report(out_dir, 'ppl.json', PPL_FIX, {'splits?': dict})
    if not ppl.get('splits'):
        raise ValueError(f"{path} holds no split: {PPL_FIX}")
    if split not in ppl['splits']:
        raise ValueError(f"--split {split}: {path} has only {', '.join(ppl['splits'])}")
    check_shape(ppl, dict(PPL_RUN, splits={split: PPL_SPLIT}), path, PPL_FIX)
    check_models(ppl, path, split)
    return ppl, path


def check_models(ppl, path, split):
    """C1-C3's models in ppl.json's split, log Z at its n for every energy, one value per prefix
    in every column."""
    res, where = ppl['splits'][split], f'splits.{split}.per_prefix'
    cols, n = res['per_prefix'], str(res['num_samples'])
    missing = [(key, m) for key, models in NEEDED.items() for m in models if m not in cols[key]]
    if missing:
        key, m = missing[0]
        raise ValueError(f"{path}: its {split} split has no {m} ({where}.{key}: a run without it); "
                         f"rerun estimate_ppl.py with {m} among its models (reproduce.py runs them all)")
    for m in ('JOINT BIT', 'JOINT UNIT'):
        if m not in {r['model'] for r in ppl['rows']}:
            raise ValueError(f"{path}: its rows have no {m} (its parameters); {PPL_FIX}")
    for m, by_n in cols['logz'].items():
        if n not in by_n:
            raise ValueError(f"{path}: {where}.logz.{m} has no n = {n} (num_samples); {PPL_FIX}")
    columns = [cols['lm_logp'], *(b for by_n in cols['logz'].values() for b in by_n[n].values()),
               *(c for key in ('extra_logp', 'energy', 'kl') for c in cols.get(key, {}).values())]
    if len({len(c) for c in columns}) > 1:
        raise ValueError(f"{path}: the columns of {where} differ in length (one value per prefix); {PPL_FIX}")


def read_samples(out_dir, name, ppl, ppl_path, fix):
    """samples.json or samples_untruncated.json, of the LM ppl.json scored, with 2 prefixes or more."""
    path = os.path.join(out_dir, name)
    samples = read_report(out_dir, name, fix, SAMPLES)
    if len(samples['samples']) < 2:
        raise ValueError(f"{path}: holds {len(samples['samples'])} prefixes' samples, and C6 and C7's "
                         f"standard errors need 2 or more; rerun sample.py with --num_prefixes 2 or more")
    check_same_lm(samples, path, ppl, ppl_path)
    return samples


def measure(out_dir, split='test', seed=0):
    """claims.json's content from a finished main job's folder."""
    ppl, path = read_ppl(out_dir, split)
    samples = read_samples(out_dir, 'samples.json', ppl, path, 'run sample.py (reproduce.py runs it)')
    res = ppl['splits'][split]
    L, lp = res['gen_len'], log_probs(res)
    claims = dict(C1=compare(lp, 'JOINT BIT', 'BALM', L), C2=compare(lp, 'JOINT UNIT', 'RALM', L),
                  C3=claim_c3(lp, {r['model']: r['params'] for r in ppl['rows']}, L))
    for k in ('C1', 'C2', 'C3'):
        withhold_if_flagged(claims[k], res, lp, L)
    if res.get('per_step'):  # estimate_ppl.py --per_step measures it on one split (test)
        claims['C4'] = claim_c4(res['per_step'])
    if res.get('calibration') and res.get('per_step'):
        if 'bias_upper_per_prefix' not in next(iter(res['calibration'].values())):
            raise ValueError(f"{path} has no per-prefix calibration (an older estimate_ppl.py): rerun it")
        claims['C5'] = claim_c5(res['calibration'], res['per_step']['energy'])
    claims.update(C6=claim_c6(samples, seed), C7=claim_c7(samples, seed))
    if os.path.exists(os.path.join(out_dir, 'samples_untruncated.json')):
        untruncated = read_samples(out_dir, 'samples_untruncated.json', ppl, path,
                                   'rerun sample.py --top_k 0 (reproduce.py runs it)')
        claims.update(untruncated_claims(samples, untruncated, seed))
    if 'JOINT METRICS' in lp:
        claims.update(talk_claims(lp, res, L))
    if os.path.exists(os.path.join(out_dir, 'accuracy.json')):  # a task with a known answer: addition
        claims.update(decoder_claims(read_report(out_dir, 'accuracy.json', ACCURACY_FIX, ACCURACY)))
    multiplicity = correct(claims)
    return dict(split=split, lms=lm_convergence(out_dir, ppl, path), claims=claims,
                multiplicity=multiplicity, statistics=STATISTICS, inputs=input_hashes(out_dir))


def decoder_claims(acc):
    """D1..: on a task with a known answer (extensions/addition_eval.py's accuracy.json), the
    decoder_pairs: exact McNemar tests on the per-problem exact matches (paired: same problems, same
    samples)."""
    per = acc['per_problem']
    out = {}
    for i, (what, (m1, c1), (m2, c2)) in enumerate(decoder_pairs(acc), 1):
        out[f'D{i}'] = dict(mcnemar(np.array(per[m1][c1]), np.array(per[m2][c2])), models=[m1, m2],
                            decoders=[c1.split('_')[0], c2.split('_')[0]], what=what)
    return out


def untruncated_claims(samples, untruncated, seed):
    """C6u and C7u, and whether their samples are C6 and C7's: where top-k truncation dropped only
    tokens that no draw reached (the same generator draws the same texts; on addition the k = 10
    kept tokens hold every digit), the untruncated texts equal the top-k ones, C6u = C6 and C7u = C7
    to every digit, and they are not separate evidence (same_as: counted once by Holm)."""
    share = same_samples(samples, untruncated)
    out = dict(C6u=claim_c6(untruncated, seed), C7u=claim_c7(untruncated, seed))
    for name, c in out.items():
        c['same_samples_share'] = share
        if share == 1.0:
            c['same_as'] = name[:2]
    return out


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
    the t interval at ALPHA (two one-sided tests at ALPHA / 2) lies within +-T3_MARGIN x the mean
    prediction, fails when it lies outside."""
    res = paired(gain - kl)
    margin = T3_MARGIN * float(kl.mean())
    p = equivalence_p(res['diff'], res['se'], margin, res['df'])
    inside = abs(res['diff']) < margin
    res.update(margin=margin, predicted_gain=float(kl.mean()), measured_gain=float(gain.mean()),
               moment_transfer=mean_se(-kl - T_n - e_real), bound_width=mean_se(high - T_n), p=p,
               holds=None if p is None or not p < ALPHA else inside)
    return res


STATISTICS = dict(  # per claim: what is measured, how it is tested, what it does not show
    C1='per-prefix difference of log-probs (nats/token), JOINT BIT at its high end; paired t; not '
       'shown: the joint model at its true PPL, which lies inside the range',
    C2='the same, JOINT UNIT against RALM', C3='the same, JOINT BIT against JOINT UNIT, and the '
    'parameter counts; a better BIT with more parameters is not significant',
    C4='gain of the first segment at its conservative (low) end minus the exact last-step gain (Eq. 5), '
       'per prefix; paired t (fails from the high end); not shown: the midpoint gain, biased up at k = 0',
    C5='reference log Z (n_ref samples drawn apart from the groups) minus the mean lower bound, and the '
       'mean upper bound minus it, per prefix; both significant by t (prefixes - 1 df): holds; not '
       'shown: that one n-sample range holds the true log Z',
    C6='pooled unique character n-grams (n = 4, 6, 8), joint minus base; jackknife SE, studentised '
       'permutation p (joint and base swapped within prefixes, each permutation over its own SE); not '
       'shown: that the joint model is more diverse than real text',
    D='exact match per problem, the first decoder minus the second, on the same problems and (among n) the '
      'same base-LM samples; exact McNemar test on the discordant problems; not shown: another task',
    C7='|mean log-lik. gap to real text| under the base LM minus under the joint model (nats per '
       'sequence); jackknife SE, studentised permutation p (the two gaps swapped within prefixes); with '
       'top-k proposals the gap is mostly truncation (C7u: without)',
    C6u='C6 with untruncated proposals: samples of the joint model itself; same_as C6 where the '
        'texts are the same (top-k dropped no sampled token): then not separate evidence',
    C7u='C7 with untruncated proposals: samples of the joint model itself; same_as C7 as C6u',
    T1='as C1, JOINT METRICS against the base LM', T2='as C1, JOINT METRICS+BIT against JOINT BIT',
    T3='gain minus KL(p*||P_LM) per prefix, an equivalence test (two one-sided t-tests) with margin '
       'half the prediction; its terms: moment transfer from the split mu was fitted on, minus the '
       'bound width; on test it measures the transfer, not the identity (exact where the moments match)',
    holm='p_holm: Holm (1979) step-down adjusted p over every claim with a p-value (a claim with '
         'same_as counted once); holds_holm: the verdict at family-wise level ALPHA = 4.55%')

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


VERDICT = {True: 'holds', False: 'does not hold', None: 'not significant'}


def format_claims(result):
    """claims.txt: per claim its statistic (SE), p, the verdict alone and Holm's; then T3's terms,
    C6u / C7u's sameness, and the LMs' stopping."""
    lines = [f"{'claim':<5} {'what':<44} {'difference (SE)':>24} {'unit':<13} {'p':>7} "
             f"{'verdict (alone)':<16} verdict (Holm)"]
    for k, c in result['claims'].items():
        v, vh = VERDICT[c['holds']], VERDICT[c.get('holds_holm')]
        what, unit = CLAIM_TEXT.get(k, c.get('what', '')[:44]), UNITS.get(k, 'exact match')
        if c.get('not_measurable'):
            v = vh = 'not measurable'
        if k == 'T3':
            v, vh = (x if h is not None else 'inconclusive'
                     for x, h in ((v, c['holds']), (vh, c.get('holds_holm'))))
        p = (format_log_p(c['log_p']) if c.get('log_p') is not None  # below 2.2e-308 p is None
             else 'n/a' if c.get('p') is None else format_p(c['p']))
        diff = '(see below)' if c.get('not_measurable') else f"{c['diff']:>+12.5f} ({c['se']:.5f})"
        lines.append(f"{k:<5} {what:<44} {diff:>24} {unit:<13} {p:>7} "
                     f"{v:<16} {vh}" + (f" (= {c['same_as']})" if c.get('same_as') else ''))
    for k, c in result['claims'].items():
        if c.get('not_measurable'):
            e = c['enumerated']
            lines.append(f"{k}: not measurable from Eq. 4: {c['not_measurable']}; with log Z enumerated (an "
                         f"estimate) {e['diff']:+.5f} ({e['se']:.5f}) {UNITS[k]}, p "
                         + (format_log_p(e['log_p']) if e.get('log_p') is not None else format_p(e['p'])))
    m = result.get('multiplicity')
    if m:
        lines.append(f"Holm: {len(m['family'])} claims at family-wise level {m['alpha']:.4f} "
                     f"({', '.join(m['family'])})")
    if 'T3' in result['claims']:
        t3 = result['claims']['T3']
        lines.append(f"T3's terms: moment transfer {t3['moment_transfer']['diff']:+.5f} "
                     f"({t3['moment_transfer']['se']:.5f}) minus bound width {t3['bound_width']['diff']:.5f} "
                     f"({t3['bound_width']['se']:.5f}); margin +-{t3['margin']:.5f}")
    if result['claims'].get('C6u', {}).get('same_as'):
        lines.append("C6u, C7u: the untruncated samples are the top-k samples' texts for every prefix (top-k "
                     "dropped no token a draw reached), so C6u = C6 and C7u = C7: not separate evidence")
    for name, m in result['lms'].items():
        why = ('a fixed budget' if m.get('fixed_budget') else 'converged: the stopping rule fired'
               if m['converged'] else 'NOT converged: stopped at the cap')
        lines.append(f"{name}: best selection loss {m['best_select_loss']:.4f} at step {m['best_step']} of "
                     f"{m['last_step']} ({why})")
    return '\n'.join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    common_flags(p, 'out_dir', default=dict(out_dir='out'),
                 help=dict(out_dir="the main job's folder (ppl.json, samples.json, lm/, ralm/, balm/)"))
    p.add_argument('--split', default='test', help='the split of the model comparisons')
    common_flags(p, 'seed', help=dict(seed="of C6 and C7's permutation tests"))
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

"""
The addition table over seeds: every model trained again at each seed on the same data, its
accuracy.json (extensions/addition_eval.py) read from each run, and per row the exact match at each
seed, their mean and spread (the sample SD over seeds); then the decoders of job.claims compared
on all seeds at once. A problem is the unit (the seeds share the problems): per problem, the
difference of the two decoders' exact matches averaged over the seeds, a paired t-test over
problems, Holm (1979) over the comparisons; McNemar's exact p at each seed beside it. Then the
seed as the unit (seed_level): the per-seed differences t-tested over seeds (df = seeds - 1) and by
the exact sign test, each with Holm over the family: what holds whatever the training seed.

    for s in 1337 2 3; do python -m job.reproduce --data addition --jobs 2 --seed $s \\
        --out_dir out-addition-s$s; done
    python -m job.seeds out-addition-s1337 out-addition-s2 out-addition-s3 --out assets/seeds_addition.json

Writes the JSON and, beside it, the same as a table (.txt).
"""

import math
import os
import statistics
import sys

import numpy as np

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.seeds")
from data import read_json
from job import ACCURACY, ACCURACY_FIX, decoder_pairs, read_report
from job.stats import ALPHA, holm, mcnemar, paired, sign_test_log_p
from plumbing import ArgumentParser, check_writable, common_flags, run_main, write_json, write_text


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('runs', nargs='+',
                   help="the --out_dir of each seed's run of job.reproduce --data addition")
    p.add_argument('--out', default='out/seeds_addition.json', help='the JSON (the table: .txt beside it)')
    common_flags(p, 'seed', help=dict(seed='unused: nothing here is random'))
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        raise ValueError(f"{len(args.runs)} run: a spread over seeds needs at least 2 runs' --out_dir")
    check_writable(args.out, '--out', folder=False)
    return args


def data_hash(run):
    """The hash of the prepared data that run's LM trained on (its provenance.json)."""
    prov = read_json(os.path.join(run, 'provenance.json'), 'rerun it with python -m job.reproduce')
    return prov.get('lm', {}).get('inputs', {}).get('prepare')


def read_runs(runs):
    """accuracy.json of each run, checked to be of different seeds on the same data and problems."""
    accs = [read_report(run, 'accuracy.json', ACCURACY_FIX, ACCURACY) for run in runs]
    hashes = [data_hash(run) for run in runs]
    if hashes[0] is None or any(h != hashes[0] for h in hashes):
        raise ValueError(f"{', '.join(runs)}: not trained on the same data (their provenance.json's "
                         f"prepared data differ); rerun them with one --data_seed")
    for key in ('split', 'num_prefixes', 'ns'):
        if any(a.get(key) != accs[0].get(key) for a in accs):
            raise ValueError(f"{', '.join(runs)}: their accuracy.json differ in {key}; rerun "
                             f"extensions.addition_eval with the same flags on each")
    seeds = [a.get('seed') for a in accs]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"{', '.join(runs)}: two runs of the same --seed {seeds}; give one run per seed")
    return accs, seeds


def spread(values):
    values = [float(v) for v in values]
    return dict(per_seed=values, mean=statistics.fmean(values), sd=statistics.stdev(values),
                min=min(values), max=max(values))


def rows_over_seeds(accs):
    """Each row of accuracy.json (model, method, n) with its exact match and P(correct) over seeds."""
    out = []
    for i, row in enumerate(accs[0]['rows']):
        rows = [a['rows'][i] for a in accs]
        if any((r['model'], r['method'], r['n']) != (row['model'], row['method'], row['n']) for r in rows):
            raise ValueError("the runs' accuracy.json list different rows; rerun extensions.addition_eval "
                             "with the same flags on each")
        out.append(dict(model=row['model'], method=row['method'], n=row['n'],
                        exact=spread(r['exact'] for r in rows),
                        **({'p_correct': spread(r['p_correct'] for r in rows)}
                           if all(r.get('p_correct') is not None for r in rows) else {})))
    return out


def comparisons(accs):
    """decoder_pairs over all seeds: the per-problem difference averaged over seeds, t-tested over
    problems, Holm over the family; each seed's McNemar p and difference beside it."""
    out = []
    for what, (m1, c1), (m2, c2) in decoder_pairs(accs[0]):
        a = np.array([acc['per_problem'][m1][c1] for acc in accs], dtype=np.float64)
        b = np.array([acc['per_problem'][m2][c2] for acc in accs], dtype=np.float64)
        per_seed = [mcnemar(x, y) for x, y in zip(a, b)]
        out.append(dict(paired((a - b).mean(axis=0)), what=what, better=[m1, c1], worse=[m2, c2],
                        diff_per_seed=[r['diff'] for r in per_seed],
                        mcnemar_p_per_seed=[r['p'] for r in per_seed]))
    for row, p_holm in zip(out, holm([r['p'] for r in out])):
        row['p_holm'] = p_holm
        row['holds_holm'] = bool(row['diff'] > 0) if p_holm < ALPHA else None
    return seed_level(out)


def seed_level(out):
    """Each comparison with the seed as the unit: its per-seed differences (diff_per_seed) by a
    paired t over seeds and by the exact sign test (seeds better against seeds worse, ties left
    out), each with Holm over the family. Three seeds cannot pass the sign test (p >= 0.25)."""
    for c in out:
        d = c['diff_per_seed']
        t = paired(d) if len(d) > 1 else {}
        better, worse = sum(x > 0 for x in d), sum(x < 0 for x in d)
        c['seed_level'] = dict(t_p=t.get('p'), t_df=t.get('df'), sign=[better, worse],
                               sign_p=math.exp(sign_test_log_p(better, worse)))
    for key in ('t_p', 'sign_p'):
        ps = [c['seed_level'][key] for c in out]
        if None not in ps:
            for c, p_holm in zip(out, holm(ps)):
                c['seed_level'][f'{key}_holm'] = p_holm
    return out


def fmt(result):
    seeds = ', '.join(map(str, result['seeds']))
    lines = [f"exact match on {result['split']} ({result['num_prefixes']} problems) at seeds {seeds}: "
             f"mean (SD) [min, max]"]
    for r in result['rows']:
        e = r['exact']
        lines.append(f"  {r['model']:8s} {r['method']:28s} {e['mean']:.3f} ({e['sd']:.3f}) "
                     f"[{e['min']:.3f}, {e['max']:.3f}]")
    lines.append("decoders compared on every seed: per-problem difference averaged over seeds, paired t over "
                 "problems, Holm")
    for c in result['comparisons']:
        per_seed = ' '.join(f'{d:+.3f}' for d in c['diff_per_seed'])
        lines.append(f"  {c['what']:48s} {c['diff']:+.3f} ({c['se']:.3f})  p {c['p']:.1e}  "
                     f"p_holm {c['p_holm']:.1e}  per seed {per_seed}")
    lines.append("the seed as the unit: paired t over the per-seed differences, Holm; exact sign test, Holm")
    for c in result['comparisons']:
        s = c['seed_level']
        t = (f"t p {s['t_p']:.2g}, Holm {s['t_p_holm']:.2g}" if s.get('t_p_holm') is not None
             else 't: no spread')
        lines.append(f"  {c['what']:48s} {t}; sign {s['sign'][0]}-{s['sign'][1]} p {s['sign_p']:.2g}, "
                     f"Holm {s['sign_p_holm']:.2g}")
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = get_args(argv)
    accs, seeds = read_runs(args.runs)
    result = dict(runs=args.runs, seeds=seeds, split=accs[0]['split'], num_prefixes=accs[0]['num_prefixes'],
                  rows=rows_over_seeds(accs), comparisons=comparisons(accs))
    table = fmt(result)
    print(table, end='')
    write_json(result, args.out)
    write_text(table, os.path.splitext(args.out)[0] + '.txt')


if __name__ == '__main__':
    run_main(main)

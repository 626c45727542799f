"""
Exact match by the problem's lookahead and longest carry chain (extensions/carry.py), from outcomes
already committed: job.seeds' _outcomes.json.gz files (every seed's per-problem outcomes), regrouped
with the problems they were scored on, which the files do not hold: the prepared split, read again.
Per model and decoder, the mean over the seeds that hold it, at each lookahead (and carry chain).

    python -m job.lookahead assets/seeds_addition_lm7000_e16000_test10000_outcomes.json.gz \\
        assets/exo_set_addition_outcomes.json.gz --data_dir data/addition_test10000 \\
        --out assets/lookahead_addition_test10000.json --plot assets/figures/fig_addition_lookahead.png

The problems are addition_eval's windows (evenly spaced over the split, as many as the outcomes); the
files' carry chains must be those of the problems read, else the data is not theirs and it stops.
"""

import gzip
import json
import os
import statistics
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.lookahead")
from data import load_meta, load_split, window_tokens, windows  # noqa: E402
from extensions.carry import (GROUPINGS, answer_layout, carry_chains, carry_lines, exact_by,  # noqa: E402
                              lookahead, plot_carry)
from job import parse_report_flags  # noqa: E402
from plumbing import ArgumentParser, run_main, write_json, write_text  # noqa: E402


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('outcomes', nargs='+', help="job.seeds' _outcomes.json.gz files of one split's problems")
    p.add_argument('--data_dir', required=True, path=True,
                   help='the prepared data the outcomes were scored on (e.g. <data_dir>_test<N> of '
                        'job.reproduce --test_problems N)')
    p.add_argument('--out', default='out/lookahead_addition.json',
                   help='the JSON (the table: .txt beside it)')
    p.add_argument('--plot', default=None, help='a PNG of both groupings (needs matplotlib)')
    return parse_report_flags(p, argv)


def read(paths):
    """The files' split, number of problems, ns, outcomes as {model: {column: {seed: per-problem list}}}
    and carry chains (of the files that hold them); the files must be of one split and number of problems."""
    data = []
    for path in paths:
        with gzip.open(path, 'rt') as f:
            data.append(json.load(f))
    splits = {d['split'] for d in data}
    sizes = {len(v) for d in data for models in d['per_problem'].values() for cols in models.values()
             for v in cols.values()}
    if len(splits) > 1 or len(sizes) > 1:
        raise ValueError(f"the outcomes are of splits {sorted(splits)} and sizes {sorted(sizes)}: give files "
                         "of one split's problems")
    out = {}
    for d in data:
        for seed, models in d['per_problem'].items():
            for model, cols in models.items():
                for col, v in cols.items():
                    if col.endswith('_exact'):
                        out.setdefault(model, {}).setdefault(col, {})[seed] = v
    chains = [d['carry_chain'] for d in data if d.get('carry_chain')]
    ns = sorted({n for d in data for n in d.get('ns', [1])})
    return splits.pop(), sizes.pop(), ns, out, chains


def main(argv=None):
    args = get_args(argv)
    split, n, ns, outcomes, chains = read(args.outcomes)
    meta = load_meta(args.data_dir)
    data = load_split(args.data_dir, split, meta)
    P, L = answer_layout(data, meta)
    pre = window_tokens(data, windows(data, P, L, max_windows=n), P + L)[:, :P]
    if len(pre) != n:
        raise ValueError(f"--data_dir {args.data_dir}: {len(pre)} {split} problems, the outcomes {n}: "
                         "give the data they were scored on")
    groups = dict(by_carry_chain=carry_chains(pre, meta), by_lookahead=lookahead(pre, meta))
    if any(c != groups['by_carry_chain'].tolist() for c in chains):
        raise ValueError(f"--data_dir {args.data_dir}: its problems' carry chains are not the outcomes': "
                         "give the data they were scored on")
    mean = {m: {c: [statistics.fmean(v) for v in zip(*by_seed.values())] for c, by_seed in cols.items()}
            for m, cols in outcomes.items()}
    seeds = {m: {c: sorted(by_seed, key=int) for c, by_seed in cols.items()} for m, cols in outcomes.items()}
    res = dict(outcomes=args.outcomes, data_dir=args.data_dir, split=split, num_prefixes=n, ns=ns,
               seeds=seeds, **{key: exact_by(g, mean) for key, g in groups.items()})
    table = '\n'.join(line for key, name in GROUPINGS for line in carry_lines(res[key], name)) + '\n'
    write_json(res, args.out)
    write_text(table, os.path.splitext(args.out)[0] + '.txt')
    if not args.quiet:
        print(table, end='')
    if args.plot:
        plot_carry(dict(res, split=f'{split}, mean over seeds'), args.plot)


if __name__ == '__main__':
    run_main(main)

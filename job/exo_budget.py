"""
EXO's budget curve: the distilled LM's greedy exact match against EXO's steps, read from the
evaluations extensions.exo records every --eval_interval steps (its `curve`, `select_greedy_exact`:
the share of the selection prefixes whose greedy continuation is the real one; step 0 is the model
EXO starts from, BALM with --init_from) of runs kept in committed assets (their `runs`). Per run,
and the mean over the runs at each step they all reached: what each budget would have bought.

    python -m job.exo_budget assets/exo_bf16_addition.json:g2400_fp32 \\
        assets/exo2400_seeds_addition.json:g2400_bf16_s2_bit ... \\
        --out assets/exo_budget_curve.json --plot assets/figures/fig_exo_budget.png

Nothing is retrained or rescored: the numbers are the runs' own, chosen and read on the selection
split (their best.pt is chosen on the same problems; test is scored elsewhere).
"""

import json
import os
import statistics
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.exo_budget")
from job import parse_report_flags  # noqa: E402
from plumbing import ArgumentParser, atomic_write, run_main, write_json, write_text  # noqa: E402


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('runs', nargs='+', metavar='ASSET:RUN',
                   help="a committed asset and the name of one of its `runs` (extensions.exo's curve)")
    p.add_argument('--out', default='out/exo_budget_curve.json', help='the JSON (the table: .txt beside it)')
    p.add_argument('--plot', default=None, help='a PNG of the curves (needs matplotlib)')
    p.add_argument('--goal', type=float, default=0.97, at_least=0, at_most=1,
                   help='a dotted line on the plot at this exact match')
    return parse_report_flags(p, argv)


def read_run(spec):
    """One run of an asset: its seed, energy, best step and {step: greedy exact match}."""
    path, _, name = spec.rpartition(':')
    if not path or not os.path.isfile(path):
        raise ValueError(f"{spec}: give ASSET:RUN, ASSET an existing JSON file (e.g. "
                         "assets/exo2400_seeds_addition.json:g2400_bf16_s4)")
    with open(path) as f:
        runs = json.load(f).get('runs', {})
    if name not in runs:
        raise ValueError(f"{spec}: {path} has no run {name!r}; it has {', '.join(sorted(runs))}")
    r = runs[name]
    curve = {c['iter']: c['greedy_exact'] for c in r['curve'] if c.get('greedy_exact') is not None}
    if 0 not in curve:
        raise ValueError(f"{spec}: its curve has no greedy exact match at step 0 (run extensions.exo with "
                         "--eval_prefixes on the selection problems)")
    return dict(asset=path, run=name, seed=r['flags']['seed'], energy=r.get('energy', 'energy not recorded'),
                best_iter=r['best_iter'], dtype=r['dtype'], greedy_exact=curve)


def budget_curve(runs):
    """The steps every run evaluated, the mean greedy exact match over the runs at each, its SD over
    the runs, and the step where the mean is highest (the earliest such step)."""
    steps = sorted(set.intersection(*(set(r['greedy_exact']) for r in runs)))
    mean = [statistics.fmean(r['greedy_exact'][s] for r in runs) for s in steps]
    sd = [statistics.stdev([r['greedy_exact'][s] for r in runs]) if len(runs) > 1 else 0.0 for s in steps]
    return dict(steps=steps, mean=mean, sd=sd, best_step=steps[mean.index(max(mean))], best_mean=max(mean))


def table(runs, curve):
    head = ['step'] + [f"seed {r['seed']} ({r['energy']})" for r in runs] + ['mean (SD)']
    lines = ['\t'.join(head)]
    for i, s in enumerate(curve['steps']):
        cells = [f"{r['greedy_exact'][s]:.3f}" + ('*' if s == r['best_iter'] else '') for r in runs]
        lines.append('\t'.join([str(s)] + cells + [f"{curve['mean'][i]:.3f} ({curve['sd'][i]:.3f})"]))
    lines.append("* the run's best.pt; step 0: the model EXO starts from")
    return '\n'.join(lines) + '\n'


def plot(runs, curve, path, goal):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        steps = sorted(r['greedy_exact'])
        ax.plot(steps, [r['greedy_exact'][s] for s in steps], '-', lw=1, alpha=0.7,
                label=f"seed {r['seed']} ({r['energy']})")
        best = r['best_iter']
        ax.plot([best], [r['greedy_exact'][best]], 'o', color=ax.lines[-1].get_color(), ms=4)
    ax.plot(curve['steps'], curve['mean'], 'k-', lw=2.5, label=f'mean of {len(runs)}')
    ax.axhline(goal, color='grey', ls=':', lw=1)
    ax.set_xlabel("EXO's steps (0: the model it starts from; dots: each run's best.pt)")
    ax.set_ylabel('greedy exact match, selection problems')
    ax.legend(fontsize=7, loc='lower right')
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format='png'))
    plt.close(fig)


def main(argv=None):
    args = get_args(argv)
    runs = [read_run(spec) for spec in args.runs]
    curve = budget_curve(runs)
    text = table(runs, curve)
    write_json(dict(runs=[dict(r, greedy_exact={str(s): v for s, v in sorted(r['greedy_exact'].items())})
                          for r in runs], **curve), args.out)
    write_text(text, os.path.splitext(args.out)[0] + '.txt')
    if not args.quiet:
        print(text, end='')
    if args.plot:
        plot(runs, curve, args.plot, args.goal)


if __name__ == '__main__':
    run_main(main)

"""
The paper's figures, drawn from the main job's JSON: out/ppl.json (estimate_ppl.py) and
out/samples.json (sample.py). PNGs land beside them:

    fig1_per_step.png        Fig. 1: per-step PPL (Eq. 5) of the base LM and the joint model's range,
                             with the exact last step (the vocabulary enumerated)
    fig2_left_bounds.png     Fig. 2 left: the joint PPL bounds as the number n of samples grows (Eq. 4)
    fig2_right_ngrams.png    Fig. 2 right: unique word n-grams (%) of real text, BASE LM and JOINT samples
    fig3_lm_loglik.png       Fig. 3 (left): base LM log-likelihood of real, BASE LM and JOINT continuations

    python figures.py --out_dir out
    python figures.py --out_dir out --copy_to assets/figures     # the small copies README shows

matplotlib is this script's own dependency (run.sh installs it); nothing else in rebm needs it.
"""

import argparse
import json
import os
import shutil

import numpy as np

from runtime import run_main

# the paper's Fig. 3 colours: real text red, BASE LM black, the joint model green
KINDS = {'gold': ('real text', 'tab:red'), 'base': ('BASE LM', 'black'), 'joint': ('JOINT', 'tab:green'),
         'autoregressive': ('JOINT (top-k AR)', 'tab:blue')}


def load_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("matplotlib is not installed: pip install matplotlib")
    matplotlib.use('Agg')  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def fig1_per_step(ax, ppl, split):
    """Fig. 1: base LM PPL at each continuation position, the joint range (Eq. 5 with the log Z
    bounds of Eq. 4 at both ends), and the exact joint PPL at the last position."""
    ps = ppl['splits'][split]['per_step']
    pos = ps['position']
    ax.plot(pos, ps['base_ppl'], color='black', lw=1, label='BASE LM')
    ax.fill_between(pos, ps['joint_ppl_low'], ps['joint_ppl_high'], color='tab:green', alpha=0.5,
                    label=f"JOINT {ps['energy']} (bounds, m = {ps['step_samples']})")
    ax.scatter([pos[-1]], [ps['last_step_exact_ppl']], color='tab:red', marker='x', zorder=3, label='JOINT exact (last step)')
    ax.set(xlabel='position in the continuation', ylabel='PPL',
           title=f"Fig. 1: per-step PPL ({split}, {ps['num_prefixes']} prefixes)")
    ax.legend(fontsize=7)


def fig2_left_bounds(ax, ppl, split):
    """Fig. 2 left: the lower and upper joint PPL estimates of each joint model against n."""
    res = ppl['splits'][split]
    ns = sorted(res['sweep'], key=int)
    for k, row in enumerate(res['sweep'][ns[0]]):
        line, = ax.plot([int(n) for n in ns], [res['sweep'][n][k]['ppl_high'] for n in ns], 'o-', ms=3, label=f"{row['model']} upper")
        ax.plot([int(n) for n in ns], [res['sweep'][n][k]['ppl_low'] for n in ns], 'o--', ms=3, color=line.get_color(),
                label=f"{row['model']} lower")
    ax.axhline(res['base_ppl'], color='black', lw=0.8, label='BASE LM')
    ax.set_xscale('log', base=2)
    ax.set(xlabel='n samples per prefix', ylabel='PPL',
           title=f"Fig. 2 left: PPL bounds vs n ({split}, {res['num_prefixes']} prefixes)")
    ax.legend(fontsize=7)


def fig2_right_ngrams(ax, samples):
    """Fig. 2 right: % of distinct word n-grams, n = 1..4, per kind of continuation."""
    kinds = [k for k in KINDS if k in samples['unique_ngrams']]
    width = 0.8 / len(kinds)
    for j, k in enumerate(kinds):
        vals = [np.nan if v is None else v for v in samples['unique_ngrams'][k]]
        ax.bar(np.arange(1, 5) + (j - (len(kinds) - 1) / 2) * width, vals, width, label=KINDS[k][0], color=KINDS[k][1])
    ax.set_xticks(range(1, 5))
    ax.set(xlabel='n', ylabel='unique n-grams (%)', ylim=(0, 122),
           title=f"Fig. 2 right: unique word n-grams ({len(samples['samples'])} prefixes)")
    ax.legend(fontsize=7, loc='upper center', ncol=len(kinds))  # above the bars, which reach 100


def fig3_lm_loglik(ax, samples):
    """Fig. 3 (left): histograms (as densities) of log P_LM(continuation | prefix), one value per
    prefix and kind, with each kind's mean dashed."""
    recs = samples['samples']
    kinds = [k for k in KINDS if k in recs[0]['lm_logp']]
    vals = {k: np.array([r['lm_logp'][k] for r in recs]) for k in kinds}
    bins = np.histogram_bin_edges(np.concatenate(list(vals.values())), bins=min(30, max(5, len(recs) // 2)))
    for k in kinds:
        name, color = KINDS[k]
        ax.hist(vals[k], bins=bins, density=True, histtype='stepfilled', alpha=0.3, color=color)
        ax.hist(vals[k], bins=bins, density=True, histtype='step', color=color, label=f'{name} (mean {vals[k].mean():.1f})')
        ax.axvline(vals[k].mean(), color=color, ls='--', lw=1)
    ax.set(xlabel=f"log P_LM(continuation | prefix), nats ({samples['args']['gen_len']} tokens)", ylabel='density',
           title=f'Fig. 3: base LM log-likelihood ({len(recs)} prefixes)')
    ax.legend(fontsize=7)


def save(plt, fig, path, dpi):
    """Atomic PNG write: a reader never sees half a figure."""
    fig.savefig(path + '.tmp', format='png', dpi=dpi, bbox_inches='tight')
    plt.close(fig)
    os.replace(path + '.tmp', path)
    return path


def read_json(path, what):
    if not os.path.isfile(path):
        raise ValueError(f"no {path}: run {what} first (or reproduce.py, which runs it)")
    with open(path) as f:
        return json.load(f)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out_dir', default='out', help='where ppl.json and samples.json are, and the PNGs go')
    p.add_argument('--split', default=None, help="split of Fig. 1 and Fig. 2 left (default: the one ppl.json's per-step PPL used)")
    p.add_argument('--copy_to', default=None, help='also copy the PNGs here (e.g. assets/figures, shown by README)')
    p.add_argument('--dpi', type=int, default=90)
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    plt = load_pyplot()
    ppl = read_json(os.path.join(args.out_dir, 'ppl.json'), 'estimate_ppl.py')
    samples = read_json(os.path.join(args.out_dir, 'samples.json'), 'sample.py')
    split = args.split or next((s for s, r in ppl['splits'].items() if 'per_step' in r), list(ppl['splits'])[-1])
    if split not in ppl['splits']:
        raise ValueError(f"--split {split}: ppl.json has only {', '.join(ppl['splits'])}")
    res = ppl['splits'][split]
    figures = [('fig1_per_step.png', fig1_per_step, (ppl, split), 'per_step' in res, 'estimate_ppl.py --per_step'),
               ('fig2_left_bounds.png', fig2_left_bounds, (ppl, split), 'sweep' in res, 'estimate_ppl.py --sweep'),
               ('fig2_right_ngrams.png', fig2_right_ngrams, (samples,), bool(samples['samples']), 'sample.py'),
               ('fig3_lm_loglik.png', fig3_lm_loglik, (samples,), bool(samples['samples']), 'sample.py')]
    written = []
    for name, draw, data, present, how in figures:
        if not present:
            print(f"{name}: skipped, its data is not in the JSON (run {how})")
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        draw(ax, *data)
        written.append(save(plt, fig, os.path.join(args.out_dir, name), args.dpi))
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        for path in written:
            dst = os.path.join(args.copy_to, os.path.basename(path))
            shutil.copyfile(path, dst + '.tmp')
            os.replace(dst + '.tmp', dst)
    print(f"figures: {', '.join(written)}" + (f" (copied to {args.copy_to})" if args.copy_to else ''))
    return written


if __name__ == '__main__':
    run_main(main)

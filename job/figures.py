"""
The paper's figures, drawn from the main job's JSON: out/ppl.json (estimate_ppl.py) and
out/samples.json (sample.py). PNGs land beside them:

    fig1_per_step.png        Fig. 1: per-step PPL (Eq. 5) of the base LM and the joint model's range,
                             with the exact last step (the vocabulary enumerated)
    fig2_left_bounds.png     Fig. 2 left: the joint PPL bounds as the number n of samples grows (Eq. 4)
    fig2_right_ngrams.png    Fig. 2 right: unique character n-grams (%) of real text, BASE LM and JOINT
                             samples
    fig3_loglik.png          Fig. 3: real text vs own samples, scored by the base LM (left) and by the
                             joint model (right)
    fig4_ordering.png        the gain of BALM and of JOINT BIT over BASE as the base LM trains
                             (reproduce.py --ordering)

Titles carry the claim each figure measures (claims.json, when present).
    python -m job.figures --out_dir out
    python -m job.figures --out_dir out --copy_to assets/figures     # the small copies README shows

matplotlib is this script's own dependency (run.sh installs it); nothing else in rebm needs it.
"""

import os
import shutil
import sys

import numpy as np

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.figures")
from job import (NUMBER, NUMBER_OR_NULL, NUMBERS, check_claims_inputs, check_same_lm, read_report)
from plumbing import ArgumentParser, check_writable, common_flags, run_main

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


def num(v, spec):
    """A number of claims.json as text ('n/a': JSON's null, a NaN when it was written)."""
    return 'n/a' if v is None else format(v, spec)


def fig1_per_step(ax, ppl, split, claims):
    """Fig. 1: the joint model's gain over the base LM per position of the continuation (Eq. 5,
    log Z at the bounds' midpoint, segments between grid points), +- 2 SE over prefixes, and the
    exact gain at the last step (the vocabulary enumerated)."""
    ps = ppl['splits'][split]['per_step']
    pos, gain, se = np.array(ps['position']), np.array(ps['gain']), np.array(ps['gain_se'])
    ax.axhline(0, color='black', lw=0.8, label='BASE LM')
    ax.plot(pos, gain, 'o-', ms=3, color='tab:green',
            label=f"JOINT {ps['energy']} (m = {ps['step_samples']})")
    ax.fill_between(pos, gain - 2 * se, gain + 2 * se, color='tab:green', alpha=0.3,
                    label='+- 2 SE over prefixes')
    c = claims['claims'].get('C4') if claims else None  # claims.py --split val has none
    if c:
        ax.errorbar([pos[-1]], [c['last_step_gain_exact']], yerr=[2 * c['last_step_gain_se']],
                    color='tab:red', marker='x', zorder=3, label='exact last step')
    ax.set(xlabel='position in the continuation', ylabel='gain over the LM, nats/token',
           title=f"Fig. 1: per-step gain ({split}, {ps['num_prefixes']} prefixes)"
                 + (f"\nC4: first segment (low end) - last step = {num(c['diff'], '+.4f')} "
                    f"({num(c['se'], '.4f')} SE)" if c else ''))
    ax.legend(fontsize=7)


def fig2_left_bounds(ax, ppl, split, claims):
    """Fig. 2 left: the lower and upper joint PPL estimates of each joint model against n."""
    res = ppl['splits'][split]
    ns = sorted(res['sweep'], key=int)
    for k, row in enumerate(res['sweep'][ns[0]]):
        line, = ax.plot([int(n) for n in ns], [res['sweep'][n][k]['ppl_high'] for n in ns], 'o-', ms=3,
                        label=f"{row['model']} upper")
        ax.plot([int(n) for n in ns], [res['sweep'][n][k]['ppl_low'] for n in ns], 'o--', ms=3,
                color=line.get_color(), label=f"{row['model']} lower")
    ax.axhline(res['base_ppl'], color='black', lw=0.8, label='BASE LM')
    ax.set_ylim(top=max(ax.get_ylim()[1], res['base_ppl'] * 1.002))  # the BASE LM line stays in view
    ax.set_xscale('log', base=2)
    c = claims['claims'].get('C5') if claims else None
    ax.set(xlabel='n samples per prefix', ylabel='PPL',
           title=f"Fig. 2 left: PPL bounds vs n ({split}, {res['num_prefixes']} prefixes)"
                 + (f"\nC5: n_ref log Z - E[lower] {num(c['below_reference']['diff'], '+.5f')}, "
                    f"E[upper] - it {num(c['above_reference']['diff'], '+.5f')} nats/token" if c else ''))
    ax.legend(fontsize=7)


def fig2_right_ngrams(ax, claims):
    """Fig. 2 right: % of distinct character n-grams of real text, base and joint samples, pooled
    over all prefixes (claims.json's C6)."""
    c = claims['claims']['C6']
    kinds = [k for k in KINDS if k in c['unique_pct']]
    width = 0.8 / len(kinds)
    for j, k in enumerate(kinds):
        vals = [np.nan if v is None else v for v in c['unique_pct'][k]]
        ax.bar(np.arange(len(c['n'])) + (j - (len(kinds) - 1) / 2) * width, vals, width, label=KINDS[k][0],
               color=KINDS[k][1])
    ax.set_xticks(range(len(c['n'])), [str(n) for n in c['n']])
    ax.set(xlabel='n (characters)', ylabel='unique n-grams (%)', ylim=(0, 122),
           title=f"Fig. 2 right: unique character n-grams ({c['prefixes']} prefixes)\n"
                 f"C6: joint - base (n = 4, 6, 8) {num(c['diff'], '+.2f')} ({num(c['se'], '.2f')} SE, "
                 f"permutation p {num(c.get('p'), '.3f')}) points")
    ax.legend(fontsize=7, loc='upper center', ncol=len(kinds))  # above the bars, which reach 100


def fig3_loglik(axes, samples, claims):
    """Fig. 3 as the paper draws it: left, the base LM's log-likelihood of real text and of its own
    samples; right, the joint model's (log P_LM - E - log Z) of real text and of its own samples.
    Histograms as densities, means dashed."""
    recs = samples['samples']
    logz = np.array([r.get('logz', 0.0) for r in recs])
    lm = lambda k: np.array([r['lm_logp'][k] for r in recs])
    joint = lambda k: lm(k) - np.array([r[f'{k}_energy'] for r in recs]) - logz
    panels = [('base LM', {'gold': lm('gold'), 'base': lm('base')}),
              ('joint model', {'gold': joint('gold'), 'joint': joint('joint')})]
    c = claims['claims']['C7'] if claims else None
    for ax, (scorer, vals) in zip(axes, panels):
        bins = np.histogram_bin_edges(np.concatenate(list(vals.values())),
                                      bins=min(30, max(5, len(recs) // 8)))
        for k, v in vals.items():
            name, color = KINDS[k]
            ax.hist(v, bins=bins, density=True, histtype='stepfilled', alpha=0.3, color=color)
            ax.hist(v, bins=bins, density=True, histtype='step', color=color,
                    label=f'{name} (mean {v.mean():.1f})')
            ax.axvline(v.mean(), color=color, ls='--', lw=1)
        diff = np.mean(list(vals.values())[1]) - np.mean(list(vals.values())[0])
        ax.set(xlabel=f"log-likelihood under the {scorer}, nats ({samples['args']['gen_len']} tokens)",
               ylabel='density', title=f"{scorer}: own samples - real = {diff:+.2f}")
        ax.legend(fontsize=7)
    axes[0].figure.suptitle(f"Fig. 3 ({len(recs)} prefixes)"
                            + (f"; C7: |base| - |joint| = {num(c['diff'], '+.2f')} "
                               f"({num(c['se'], '.2f')} SE) nats" if c else ''), fontsize=9)


def fig4_ordering(ax, ordering):
    """The gain over BASE of BALM and of JOINT BIT as the base LM trains (each LM checkpoint with
    its own energy): where the ordering of Table 1 flips, if it does."""
    pts = ordering['points']
    x = [p['base_select_loss'] for p in pts]
    for key, name, color in (('balm', 'BALM', 'tab:blue'),
                             ('joint', f"JOINT {ordering['energy']}", 'tab:green')):
        g, se = np.array([p[f'{key}_gain'] for p in pts]), np.array([p[f'{key}_gain_se'] for p in pts])
        ax.errorbar(x, g, yerr=2 * se, marker='o', ms=3, capsize=2, color=color, label=f'{name} (+- 2 SE)')
    for p in pts:
        ax.annotate(f"{p['iter']}", (p['base_select_loss'], p['joint_gain']), fontsize=6, xytext=(2, 2),
                    textcoords='offset points')
    ax.axhline(0, color='black', lw=0.8)
    ax.invert_xaxis()  # training goes left to right
    ax.set(xlabel="base LM's selection loss (nats/token; labels: its step)",
           ylabel=f"gain over BASE, nats/token ({ordering['split']})",
           title=f"Fig. 4 (this project's): the ordering as the base LM trains "
                 f"({ordering['num_prefixes']} prefixes)")
    ax.legend(fontsize=7)


def save(plt, fig, path, dpi):
    """Atomic PNG write: a reader never sees half a figure."""
    fig.savefig(path + '.tmp', format='png', dpi=dpi, bbox_inches='tight')
    plt.close(fig)
    os.replace(path + '.tmp', path)
    return path


# what figures.py reads of the main job's JSON (each figure is drawn where its part is present)
PER_STEP = {'energy': str, 'step_samples': int, 'num_prefixes': int, 'position': NUMBERS, 'gain': NUMBERS,
            'gain_se': NUMBERS}
SWEEP = {'*': [{'model': str, 'ppl_low': NUMBER, 'ppl_high': NUMBER}]}
PPL = {'splits?': {'*': {'num_prefixes': int, 'base_ppl': NUMBER, 'per_step?': PER_STEP, 'sweep?': SWEEP}},
       'hashes?': {'*': str}}
SAMPLES = {'args': {'gen_len': int, 'lm?': str},
           'samples': [{'lm_logp': {'gold': NUMBER, 'base': NUMBER, 'joint': NUMBER}, 'gold_energy': NUMBER,
                        'joint_energy': NUMBER, 'logz?': NUMBER}]}
STAT = {'diff': NUMBER_OR_NULL, 'se': NUMBER_OR_NULL}
CLAIMS = {'inputs?': {'*': str}, 'claims': {
    'C4?': dict(STAT, last_step_gain_exact=NUMBER, last_step_gain_se=NUMBER),
    'C5?': {'below_reference': STAT, 'above_reference': STAT},
    'C6': dict(STAT, prefixes=int, n=NUMBERS, unique_pct={'*': [NUMBER_OR_NULL]}, **{'p?': NUMBER_OR_NULL}),
    'C7': STAT}}
POINT = {'iter': int, 'base_select_loss': NUMBER, 'balm_gain': NUMBER, 'balm_gain_se': NUMBER,
         'joint_gain': NUMBER, 'joint_gain_se': NUMBER}
ORDERING = {'energy': str, 'split': str, 'num_prefixes': int, 'points': [POINT]}


def read_inputs(out_dir):
    """ppl.json, samples.json, and claims.json and ordering.json where present (None where not),
    each checked (read_report) and all of one run."""
    fix = lambda script: f"rerun {script} (reproduce.py runs it)"
    ppl = read_report(out_dir, 'ppl.json', fix('estimate_ppl.py'), PPL)
    samples = read_report(out_dir, 'samples.json', fix('sample.py'), SAMPLES)
    check_same_lm(samples, os.path.join(out_dir, 'samples.json'), ppl, os.path.join(out_dir, 'ppl.json'))
    claims = ordering = None
    if os.path.exists(os.path.join(out_dir, 'claims.json')):
        claims = read_report(out_dir, 'claims.json', fix('claims.py'), CLAIMS)
        check_claims_inputs(claims, os.path.join(out_dir, 'claims.json'), out_dir)
    if os.path.exists(os.path.join(out_dir, 'ordering.json')):
        ordering = read_report(out_dir, 'ordering.json', 'rerun reproduce.py --ordering', ORDERING)
    return ppl, samples, claims, ordering


MAX_DPI = 1200


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    common_flags(p, 'out_dir', default=dict(out_dir='out'),
                 help=dict(out_dir='where ppl.json and samples.json are, and the PNGs go'))
    p.add_argument('--split', default=None,
                   help="split of Fig. 1 and Fig. 2 left (default: the one ppl.json's per-step PPL used)")
    p.add_argument('--copy_to', default=None,
                   help='also copy the PNGs here (e.g. assets/figures, shown by README)')
    # 100,000 dpi: gigapixel PNGs, tens of GB of memory; print quality is 300-600
    p.add_argument('--dpi', type=int, default=90, at_least=1, at_most=MAX_DPI,
                   help=f'resolution of the PNGs (1 to {MAX_DPI})')
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    if args.copy_to is not None:  # refused before any PNG is written
        check_writable(args.copy_to, '--copy_to')
    ppl, samples, claims, ordering = read_inputs(args.out_dir)
    plt = load_pyplot()
    if not ppl.get('splits'):
        raise ValueError(f"{args.out_dir}/ppl.json holds no split: rerun estimate_ppl.py")
    split = args.split or next((s for s, r in ppl['splits'].items() if 'per_step' in r),
                               list(ppl['splits'])[-1])
    if split not in ppl['splits']:
        raise ValueError(f"--split {split}: ppl.json has only {', '.join(ppl['splits'])}")
    res, has_samples = ppl['splits'][split], bool(samples['samples'])
    figures = [('fig1_per_step.png', fig1_per_step, (ppl, split, claims), 'per_step' in res,
                'estimate_ppl.py --per_step'),
               ('fig2_left_bounds.png', fig2_left_bounds, (ppl, split, claims), 'sweep' in res,
                'estimate_ppl.py --ns'),
               ('fig2_right_ngrams.png', fig2_right_ngrams, (claims,), claims is not None, 'claims.py'),
               ('fig3_loglik.png', fig3_loglik, (samples, claims), has_samples, 'sample.py')]
    if ordering:
        figures.append(('fig4_ordering.png', fig4_ordering, (ordering,), True, ''))
    written = []
    for name, draw, data, present, how in figures:
        if not present:
            print(f"{name}: skipped, its data is not in the JSON (run {how})", file=sys.stderr)
            continue
        two = draw is fig3_loglik
        fig, ax = plt.subplots(1, 2 if two else 1, figsize=(10, 3.8) if two else (5.5, 3.8))
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

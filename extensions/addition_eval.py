"""
Accuracy with a known answer (data/addition/prepare.py): how often each model writes the correct
sum of a test problem, and how much probability it puts on it.

- BASE LM and every --extra_lm (BALM, an EXO-distilled LM from extensions/exo.py): greedy
  (temperature 0) and one untruncated sample; the exact probability of the correct sum,
  exp log P_LM(c | x).
- JOINT (the LM reweighted by --energy, Eq. 2 of Deng et al., ICLR 2020): Algorithm 1 (Section
  3.3) at each n of --ns: of max(ns) LM samples per problem, the first n, one resampled
  ∝ exp(-E) (Gumbel-max, as sample.algorithm_1 and energy.joint_sample draw it); the
  best-of-n oracle (any of the n samples correct; its best per-digit accuracy). Its probability
  on the correct sum, exp(log P_LM(c|x) - E(x, c) - log Z(x)), is a range: log Z from the
  untruncated samples by Eq. 4's two estimates (estimate_ppl.logz_bounds), T_n (low) giving the
  high end of the probability.

Accuracy: exact match (every digit and the end of text) and per-digit (the N + 1 sum digits),
means over --num_prefixes test problems with their standard errors. Cost: LM samples per answer
(greedy: 1), the x-axis of the figure (--plot). Writes --out (JSON) and a table beside it (.txt).

    python extensions/addition_eval.py --lm out-addition/lm/best.pt --energy out-addition/bit/best.pt \\
        --extra_lm BALM=out-addition/balm/best.pt EXO=out-addition/exo/best.pt --out out-addition/acc.json
"""

import math
import os
import sys
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # first: threads' wait policy, read once as torch loads (plumbing.py; skip it)
import torch

from data import SPLITS, check_fits, load_lm_and_data, load_split, window_tokens, windows, write_json
from energy import gumbel_keys, score_continuations
from estimate_ppl import logz_bounds
from extensions.metrics import load_any_energy
from model import load_lm
from plumbing import ArgumentParser, at_least, check_new, check_writable, rng, run_main, setup


def answer_layout(data, meta):
    """(prefix_len, gen_len) of a split of fixed-length problems (data/addition/prepare.py): the
    first document up to and including '=' (the problem), and the rest with the end of text."""
    ends = (data[:4096] == meta['eot_id']).nonzero()[0]
    doc = [meta['chars'][t - 1] for t in data[:ends[0]]] if meta.get('chars') and len(ends) > 1 else []
    if '=' not in doc or ends[1] - ends[0] != ends[0] + 1:
        raise ValueError("this split does not hold fixed-length problems `a+b=c` "
                         "(data/addition/prepare.py): give the LM of an addition corpus")
    P = doc.index('=') + 1
    return P, int(ends[0]) + 1 - P


def scores(pred, gold):
    """pred (B, k, L), gold (B, L) -> exact match (B, k) (every token, end of text included) and
    per-digit accuracy (B, k) over the L - 1 answer digits."""
    hit = pred == gold[:, None]
    return hit.all(-1).double(), hit[..., :-1].double().mean(-1)


def mean_se(x):
    """(mean, standard error) of a 1-d tensor of per-problem values."""
    x = x.double()
    return x.mean().item(), (x.std() / math.sqrt(len(x))).item() if len(x) > 1 else float('nan')


@torch.no_grad()
def lm_columns(lm, pre, gold, g):
    """Per-problem columns of one LM: greedy and sampled exact/digit scores, log P(correct sum)."""
    L = gold.size(1)
    out = {}
    for how, temp in (('greedy', 0), ('sampled', 1.0)):
        ex, dg = scores(lm.generate(pre, L, temperature=temp, generator=g)[0], gold)
        out[f'{how}_exact'], out[f'{how}_digit'] = ex[:, 0], dg[:, 0]
    out['logp_correct'] = lm.sequence_logprob(torch.cat([pre, gold], 1), pre.size(1)).double()
    return out


@torch.no_grad()
def joint_columns(lm, energy, pre, gold, ns, top_k, g):
    """Per-problem columns of the joint model: Algorithm 1 at each n (the first n of max(ns)
    samples), the best-of-n oracle, and log P_joint(correct sum) low/high (Eq. 2 with Eq. 4's
    log Z bounds over max(ns) untruncated samples)."""
    P, L, m = pre.size(1), gold.size(1), max(ns)
    x = lm.generate(pre, L, num_samples=m, top_k=top_k or None, generator=g)[0]  # (B, m, L)
    E = score_continuations(energy, pre, x, P, nullcontext())  # (B, m)
    ex, dg = scores(x, gold)
    rows, out = torch.arange(pre.size(0)), {}
    for n in ns:
        i = gumbel_keys(-E[:, :n], g).argmax(1)  # a draw ∝ exp(-E) among the first n
        out[f'a1_{n}_exact'], out[f'a1_{n}_digit'] = ex[rows, i], dg[rows, i]
        out[f'oracle_{n}_exact'], out[f'oracle_{n}_digit'] = ex[:, :n].amax(1), dg[:, :n].amax(1)
    if top_k:  # log Z needs samples of P_LM itself
        x = lm.generate(pre, L, num_samples=m, generator=g)[0]
        E = score_continuations(energy, pre, x, P, nullcontext())
    z_low, z_high = logz_bounds(-E)
    e_gold = score_continuations(energy, pre, gold[:, None], P, nullcontext())[:, 0]
    logp = lm.sequence_logprob(torch.cat([pre, gold], 1), P).double()
    out['logp_correct_low'], out['logp_correct_high'] = logp - e_gold - z_high, logp - e_gold - z_low
    return out


def rows_of(name, cols, ns, params):
    """The table's rows (dicts) from per-problem columns."""
    def acc(prefix):
        (e, e_se), (d, d_se) = mean_se(cols[f'{prefix}_exact']), mean_se(cols[f'{prefix}_digit'])
        return dict(exact=e, exact_se=e_se, digit=d, digit_se=d_se)

    if name == 'JOINT':
        p_low, p_high = (cols[f'logp_correct_{end}'].exp().mean().item() for end in ('low', 'high'))
        return [dict(model=name, method=f'Algorithm 1, n = {n}', n=n, lm_samples=n, params=params,
                     **acc(f'a1_{n}'), oracle_exact=mean_se(cols[f'oracle_{n}_exact'])[0],
                     oracle_digit=mean_se(cols[f'oracle_{n}_digit'])[0], p_correct_low=p_low,
                     p_correct_high=p_high) for n in ns]
    p = cols['logp_correct'].exp().mean().item()
    return [dict(model=name, method=how, n=1, lm_samples=1, params=params, **acc(how), p_correct=p)
            for how in ('greedy', 'sampled')]


def format_table(rows):
    lines = [f"{'model':<10} {'method':<20} {'LM samples':>10} {'exact (SE)':>16} {'per digit (SE)':>16} "
             f"{'oracle exact':>12} {'P(correct)':>15}"]
    for r in rows:
        p = (f"{r['p_correct_low']:.3f}-{r['p_correct_high']:.3f}" if 'p_correct_low' in r
             else f"{r['p_correct']:.3f}")
        oracle = f"{r['oracle_exact']:.3f}" if 'oracle_exact' in r else ''
        lines.append(f"{r['model']:<10} {r['method']:<20} {r['lm_samples']:>10} "
                     f"{r['exact']:>8.3f} ({r['exact_se']:.3f}) {r['digit']:>8.3f} ({r['digit_se']:.3f}) "
                     f"{oracle:>12} {p:>15}")
    return '\n'.join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', required=True, help='the base LM (train_lm.py best.pt)')
    a('--energy', default=None,
      help="the joint model's energy (nce_train.py best.pt or metric_ebm.py energy.pt)")
    a('--extra_lm', nargs='*', default=[], metavar='NAME=PATH', help='more LMs: BALM, EXO, ...')
    a('--data_dir', default=None, help="default: the data the LM was trained on")
    a('--split', default='test', choices=SPLITS, help='val and test are only reported')
    a('--num_prefixes', type=int, default=1000, help='problems (evenly spaced over the split)')
    a('--ns', default='1,5,20,80', help="Algorithm 1's numbers of LM samples")
    a('--top_k', type=int, default=0, help="Algorithm 1's proposal: top-k of the LM (0: untruncated)")
    a('--batch', type=int, default=64, help='problems per batch')
    a('--out', required=True, help='JSON results (and a .txt table beside it)')
    a('--plot', default=None, help='a PNG of accuracy against LM samples per answer (needs matplotlib)')
    a('--force', action='store_true', help='replace --out')
    a('--device', default='cpu')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true', help='no table printed (it is still written)')
    args = p.parse_args(argv)
    at_least(args, 1, 'num_prefixes', 'batch')
    at_least(args, 0, 'top_k')
    try:
        args.ns = sorted({int(n) for n in args.ns.split(',')})
    except ValueError:
        raise ValueError(f"--ns {args.ns}: give comma-separated integers, e.g. 1,5,20,80") from None
    if args.ns[0] < 1 or (args.energy and args.ns[-1] < 2):
        raise ValueError(f"--ns {args.ns}: each at least 1, the largest at least 2 (log Z needs 2 samples)")
    for spec in args.extra_lm:
        if '=' not in spec:
            raise ValueError(f"--extra_lm {spec}: give NAME=PATH")
    check_writable(args.out, '--out', folder=False)
    check_new(args.out, '--out', args.force)
    return args


def main(argv=None):
    args = get_args(argv)
    device = setup(args.device)[2]
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    lms = {'BASE LM': lm}
    lms.update({name: load_lm(path, device, meta)[0]
                for name, path in (s.split('=', 1) for s in args.extra_lm)})
    energy = load_any_energy(args.energy, args.lm, device)[0] if args.energy else None
    data = load_split(data_dir, args.split, meta)
    P, L = answer_layout(data, meta)
    check_fits(P + L, lms)
    offsets = windows(data, P, L, max_windows=args.num_prefixes)
    x = window_tokens(data, offsets, P + L).to(device)
    cols = {name: [] for name in list(lms) + (['JOINT'] if energy else [])}
    for b, batch in enumerate(x.split(args.batch)):
        pre, gold = batch[:, :P], batch[:, P:]
        for name, model in lms.items():
            cols[name].append(lm_columns(model, pre, gold, rng(args.seed, f'addition {name}', args.split, b,
                                                               device)))
        if energy:
            cols['JOINT'].append(joint_columns(lm, energy, pre, gold, args.ns, args.top_k,
                                               rng(args.seed, 'addition joint', args.split, b, device)))
    rows = []
    for name, parts in cols.items():
        merged = {k: torch.cat([c[k] for c in parts]).cpu() for k in parts[0]}
        params = (lm if name == 'JOINT' else lms[name]).num_params() + (
            sum(p.numel() for p in energy.parameters()) if name == 'JOINT' else 0)
        rows += rows_of(name, merged, args.ns, params)
    res = dict(split=args.split, num_prefixes=len(offsets), prefix_len=P, gen_len=L, ns=args.ns,
               top_k=args.top_k, lm=args.lm, energy=args.energy, extra_lm=args.extra_lm, seed=args.seed,
               rows=rows)
    write_json(res, args.out)
    table = format_table(rows)
    with open(os.path.splitext(args.out)[0] + '.txt', 'w') as f:
        f.write(table + '\n')
    if not args.quiet:
        print(table)
    if args.plot:
        plot(rows, args.plot, args.split)


def plot(rows, path, split='test'):
    """Exact match against LM samples per answer: each LM (greedy, sampled) a point, Algorithm 1 a
    curve over n, its best-of-n oracle dashed."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    joint = [r for r in rows if r['model'] == 'JOINT']
    if joint:
        ns = [r['n'] for r in joint]
        ax.plot(ns, [r['exact'] for r in joint], 'o-', label='Algorithm 1 (LM + energy)')
        ax.plot(ns, [r['oracle_exact'] for r in joint], 'o--', color='grey', label='best-of-n oracle')
    for r in rows:
        if r['model'] != 'JOINT':
            ax.plot(1, r['exact'], 'v' if r['method'] == 'greedy' else 's',
                    label=f"{r['model']} ({r['method']})")
    ax.set_xscale('log')
    ax.set_xlabel('LM samples per answer')
    ax.set_ylabel(f'exact match ({split})')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == '__main__':
    run_main(main)

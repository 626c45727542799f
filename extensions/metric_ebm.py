"""
The talk's residual EBM from evaluation metrics (Ji et al., ICLR 2024), fitted without
training: E(x) = mu . f(x), mu chosen so that the joint model's expected metrics equal real
text's on the selection split (moment matching, metrics.py). Then:

- the moment gaps before (the LM) and after (the joint model p*) on the selection split, where
  mu was fitted, and on val/test, where it was not;
- the Pythagorean prediction of its gain, KL(p* || P_LM) per token (estimate_ppl.py measures the
  gain itself: --energy METRICS=out/metrics/energy.pt);
- with --table, the talk's metrics table: real text, the LM at temperature 1, top-k, top-p and
  greedy decoding, and the joint model of each --compare energy and of this one (Algorithm 1
  from n untruncated LM samples: the joint model itself as n grows, where a top-k proposal
  would sample another distribution), each metric's mean and its gap to real text, SE over
  prefixes.

    python -m extensions.metric_ebm --lm out/lm/best.pt --out_dir out/metrics
    python -m extensions.metric_ebm --lm out/lm/best.pt --energy_metric BIT=out/bit/best.pt \
        --table --compare BIT=out/bit/best.pt

Writes out_dir/energy.pt (loads wherever an energy does; with --energy_metric also
energy_aggregate.pt, mu over the metrics and those energies, fitted on the same LM samples),
results.json and results.txt.
"""

import math
import os
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.metric_ebm")
import torch

from data import SPLITS, check_fits, load_lm_and_data, load_split, window_tokens, windows
from energy import joint_sample, kl_to_lm, load_any_energy, load_energy
from extensions.metrics import METRIC_HELP, MetricEnergy, fit_mu, metric_energy_state, parse_metrics
from model import load_lm
from plumbing import (ArgumentParser, Precision, check_memory, check_new, check_writable, common_flags,
                      file_hash, json_text, named_paths, precision, progress, rng, run_main, save_checkpoints,
                      setup)




def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/best.pt', help='the base LM')
    a('--metrics', default='rep-4,tr-32,div,coh,logp', help=f'comma-separated: {METRIC_HELP}')
    a('--energy_metric', nargs='*', default=[], metavar='NAME=CKPT', help='trained energies as more metrics')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='tokens of each prefix')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='tokens of each continuation')
    a('--num_prefixes', dest='prefixes', type=int, default=512, at_least=2, at_most='count',
      help='selection-split prefixes mu is fitted on (a standard error: at least 2)')
    a('--fit_samples', dest='pool', type=int, default=64, at_least=2, at_most='samples',
      help='untruncated LM samples per prefix that fit mu (importance sampling)')
    a('--check_split', dest='check_splits', default='val,test',
      help="comma-separated splits whose moments are checked, not fitted ('': none)")
    a('--check_prefixes', type=int, default=128, at_least=1, at_most='count',
      help='prefixes of each --check_split')
    a('--table', action='store_true', help="the talk's metrics table of decoding methods on --table_split")
    a('--table_split', default='test', choices=SPLITS, help="the split of the talk's table")
    a('--table_prefixes', type=int, default=256, at_least=1, at_most='count',
      help="prefixes of the talk's table")
    a('--compare', nargs='*', default=[], metavar='NAME=CKPT', help='energies in the table (Algorithm 1)')
    a('--extra_lm', nargs='*', default=[], metavar='NAME=CKPT', help='LMs in the table (temperature 1)')
    a('--num_samples', dest='n', type=int, default=32, at_least=1, at_most='samples',
      help='Algorithm 1: top-k LM samples per prefix to resample from')
    a('--top_k', type=int, default=10, at_least=1, at_most=None, help="top-k decoding (the table's row)")
    a('--joint_top_k', type=int, default=0, at_least=0, at_most=None,
      help="the table's joint samples: Algorithm 1 from n top-k LM samples (0: untruncated: the joint model)")
    a('--top_p', type=float, default=0.9, above=0, at_most=1,
      help='top-p (nucleus) decoding, in (0, 1]')
    a('--chunk', type=int, default=16, at_least=1, at_most='count', help='prefixes per batch')
    common_flags(p, 'out_dir', 'force', 'device', 'deterministic', 'dtype', 'seed', 'quiet',
                 default=dict(out_dir='out/metrics'),
                 help=dict(force='replace the results of an earlier fit in --out_dir',
                           dtype='autocast dtype of sampling, scoring (auto: from the hardware)'))
    args = p.parse_args(argv)
    for flag in ('energy_metric', 'compare', 'extra_lm'):
        named_paths(getattr(args, flag), f'--{flag}')
    args.check_splits = [s for s in args.check_splits.split(',') if s]
    if any(s not in SPLITS for s in args.check_splits):
        raise ValueError(f"--check_split {','.join(args.check_splits)}: must be comma-separated names of "
                         f"{', '.join(SPLITS)} (or '' for none)")
    # held at once: float64 features (B, pool, K) of every split, a chunk of samples with their energies
    K = len(args.metrics.split(',')) + len(args.energy_metric)
    prefixes = args.prefixes + args.check_prefixes * len(args.check_splits)
    rows = max(args.pool, args.n)  # samples per prefix held in one chunk
    check_memory(8 * K * prefixes * args.pool + args.chunk * rows * (8 * args.gen_len + 8),
                 f"--num_prefixes/--check_prefixes {prefixes} x --fit_samples {args.pool}"
                 + (f" (and --chunk {args.chunk} x --num_samples {args.n})" if args.n > args.pool else ''),
                 "lower them")
    check_writable(args.out_dir, '--out_dir')
    check_new(os.path.join(args.out_dir, 'results.json'), '--out_dir', args.force,
              also=[os.path.join(args.out_dir, f) for f in ('energy.pt', 'energy_aggregate.pt')])
    return args


# -----------------------------------------------------------------------------
# the pools: metrics of real continuations and of untruncated LM samples

@torch.no_grad()
def pool_features(energy, lm, data, offsets, args, amp, split, n):
    """f_data (B, K) of the real continuations of the prefixes at offsets and f_pool (B, n, K) of
    n untruncated LM samples of each (float64, on the CPU)."""
    P, L = args.prefix_len, args.gen_len
    f_data, f_pool = [], []
    for s in progress(range(0, len(offsets), args.chunk), quiet=args.quiet, desc=f'metrics ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P + L).to(lm.lm_head.weight.device)
        with amp.lm:
            g = rng(args.seed, 'metric_pool', split, s, x.device)
            tokens, _ = lm.generate(x[:, :P], L, num_samples=n, generator=g)  # (B, n, L)
        with amp.energy:
            f_data.append(energy.features(x, P).cpu())
            f_pool.append(energy.features_shared(x[:, :P], tokens, P).cpu())  # (B, n, K)
    return torch.cat(f_data), torch.cat(f_pool)


def moments(f_data, f_pool, mu):
    """Each metric's mean over prefixes: real text, the LM (plain pool mean) and p* (the pool
    reweighted by softmax(-mu . f)); and KL(p* || P_LM) per prefix (the predicted gain)."""
    lw = -(f_pool @ mu)
    w = torch.softmax(lw, -1)
    joint = torch.einsum('bn,bnk->bk', w, f_pool)
    means = dict(real=f_data.mean(0).tolist(), lm=f_pool.mean((0, 1)).tolist(), joint=joint.mean(0).tolist())
    return means, kl_to_lm(lw)


def split_report(f_data, f_pool, mu, names, L):
    """One split's moments (real, LM, p*) and the predicted gain KL(p*||P_LM) per token with SE."""
    m, kl = moments(f_data, f_pool, mu)
    kl = kl / L
    return dict(prefixes=f_data.size(0), pool=f_pool.size(1), metrics=names, **m,
                predicted_gain_nats_per_token=kl.mean().item(),
                predicted_gain_se=(kl.std() / math.sqrt(len(kl))).item())


# -----------------------------------------------------------------------------
# the talk's table: every decoding method's metrics against real text's

@torch.no_grad()
def decoded(lm, extra_lms, compare, data, offsets, args, amp):
    """{system: (B, L) continuations} of each decoding method for the prefixes at offsets."""
    P, L = args.prefix_len, args.gen_len
    x = window_tokens(data, offsets, P + L).to(lm.lm_head.weight.device)
    g = rng(args.seed, 'metric_table', args.table_split, 0, x.device)
    out = {'real': [x[:, P:]]}
    for s in progress(range(0, len(offsets), args.chunk), quiet=args.quiet, desc='decoding'):
        pre = x[s:s + args.chunk, :P]
        ways = {'LM (t = 1)': dict(), f'top-k ({args.top_k})': dict(top_k=args.top_k),
                f'top-p ({args.top_p})': dict(top_p=args.top_p), 'greedy': dict(temperature=0.0)}
        with amp.lm:
            for name, kw in ways.items():
                out.setdefault(name, []).append(lm.generate(pre, L, generator=g, **kw)[0][:, 0])
            for name, m in extra_lms.items():
                out.setdefault(f'{name} (t = 1)', []).append(m.generate(pre, L, generator=g)[0][:, 0])
        for name, e in compare.items():
            j = joint_sample(lm, e, pre, args.n, L, args.joint_top_k or None, generator=g, amp=amp)
            out.setdefault(f'JOINT {name} (n = {args.n})', []).append(j['joint'])
    return {k: torch.cat(v) for k, v in out.items()}


def metrics_table(energy, systems, prefixes, ctx):
    """Each system's mean metrics over prefixes and the paired gap to real text, with SE."""
    P = prefixes.size(1)
    with ctx:
        feats = {k: torch.cat([energy.features(b, P) for b in torch.cat([prefixes, y], 1).split(256)])
                 for k, y in systems.items()}
    rows = {}
    for name, f in feats.items():
        gap = f - feats['real']
        rows[name] = dict(mean=f.mean(0).tolist(), gap=gap.mean(0).tolist(),
                          gap_se=(gap.std(0) / math.sqrt(f.size(0))).tolist())
    return rows


def format_table(rows, names):
    head = f"{'system':<26}" + ''.join(f"{n:>25}" for n in names)
    lines = [head, f"{'':<26}" + ''.join(f"{'mean (gap to real, SE)':>25}" for _ in names)]
    for sys_name, r in rows.items():
        cells = [f"{m:.3f}" if sys_name == 'real' else f"{m:.3f} ({g:+.3f}, {se:.3f})"
                 for m, g, se in zip(r['mean'], r['gap'], r['gap_se'])]
        lines.append(f"{sys_name:<26}" + ''.join(f"{c:>25}" for c in cells))
    return '\n'.join(lines)


# -----------------------------------------------------------------------------

def load_all(args, device):
    """The LM, its data, the metric energy (mu = 0) and the models the table compares."""
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    names = parse_metrics(args.metrics, meta['vocab_size'], args.gen_len)
    specs = [s.split('=', 1) for s in args.energy_metric]
    energy = MetricEnergy(names, lm, {n: load_energy(p, args.lm, device)[0] for n, p in specs}).to(device)
    compare = {n: load_any_energy(p, args.lm, device)[0] for n, p in (s.split('=', 1) for s in args.compare)}
    extra = {n: load_lm(p, device, meta=meta)[0] for n, p in (s.split('=', 1) for s in args.extra_lm)}
    models = {'LM': lm, **{f'energy {n}': e for n, e in {**energy.energies, **compare}.items()},
              **{f'LM {n}': e for n, e in extra.items()}}
    check_fits(args.prefix_len + args.gen_len, models)
    files = {n: (p, file_hash(p)) for n, p in specs}
    return lm, meta, data_dir, energy, compare, extra, files


def main(argv=None):
    args = get_args(argv)
    device = setup(args.device, args.deterministic)[2]
    lm, meta, data_dir, energy, compare, extra, files = load_all(args, device)
    P, L = args.prefix_len, args.gen_len
    on_lm = precision(device, args.dtype, 'sample', width=lm.config.n_embd)[1]
    width = max(e.config.n_embd for e in [lm, *energy.energies.values(), *compare.values()])
    edtype, on_energy = precision(device, args.dtype, 'score', width=width)
    amp = Precision(lm=on_lm, energy=on_energy)

    def split_offsets(split, k):  # the first k windows of a split
        return windows(load_split(data_dir, split, meta), P, L, max_windows=k)

    pools = {}  # split -> (f_data (B, K), f_pool (B, n, K)), the metrics first, the energies last
    for split, k in [('select', args.prefixes)] + [(s, args.check_prefixes) for s in args.check_splits]:
        data = load_split(data_dir, split, meta)
        offsets = split_offsets(split, k)
        pools[split] = pool_features(energy, lm, data, offsets, args, amp, split, args.pool)
    # one fit on the metrics alone; with --energy_metric, a second on the metrics and those
    # energies (the talk's aggregation), from the same LM samples
    fits = {'energy': MetricEnergy(energy.names, lm)}
    if energy.energies:
        fits['energy_aggregate'] = energy
    res, text, saves = dict(dtype=edtype), [], []
    for name, e in fits.items():
        res[name], state = fit(e, pools, args, meta, files)
        saves.append((state, os.path.join(args.out_dir, f'{name}.pt')))
        text.append(f"{name}.pt: " + format_moments(res[name]))
    if args.table:
        joint = dict(compare, METRICS=fits['energy'])
        if energy.energies:
            joint['METRICS+' + '+'.join(energy.energies)] = energy
        res['table'] = table(lm, extra, joint, data_dir, meta, split_offsets, args, amp)
        text.append(format_table(res['table']['rows'], res['table']['metrics']))
    # the energies with their results, together (results.json last), not before the table has worked
    save_checkpoints(saves, [('\n\n'.join(text) + '\n', os.path.join(args.out_dir, 'results.txt')),
                             (json_text(res), os.path.join(args.out_dir, 'results.json'))])
    print('\n\n'.join(text) + f"\n-> {args.out_dir}")
    return res


def fit(e, pools, args, meta, files):
    """mu of the metric energy e (its first K columns of the pools) by moment matching on the
    selection split, set in e; the report of every split, and the checkpoint to save."""
    K, names = e.num_metrics, e.feature_names()
    mu, steps = fit_mu(pools['select'][0][:, :K], pools['select'][1][..., :K], names)
    e.mu.copy_(mu)
    how = dict(split='select', prefixes=pools['select'][0].size(0), pool=args.pool,
               prefix_len=args.prefix_len, gen_len=args.gen_len, seed=args.seed)
    state = metric_energy_state(e, args.lm, file_hash(args.lm), meta, files if e.energies else {}, how)
    splits = {s: split_report(f_data[:, :K], f_pool[..., :K], mu, names, args.gen_len)
              for s, (f_data, f_pool) in pools.items()}
    return dict(metrics=names, mu=mu.tolist(), newton_steps=steps, splits=splits), state


def table(lm, extra, compare, data_dir, meta, split_offsets, args, amp):
    """The talk's table on --table_split: each decoding method's metrics against real text's."""
    data = load_split(data_dir, args.table_split, meta)
    offsets = split_offsets(args.table_split, args.table_prefixes)
    systems = decoded(lm, extra, compare, data, offsets, args, amp)
    plain = compare['METRICS']  # its named metrics only: the table has no trained energy among them
    prefixes = window_tokens(data, offsets, args.prefix_len).to(lm.lm_head.weight.device)
    return dict(split=args.table_split, prefixes=len(offsets), metrics=plain.feature_names(),
                rows=metrics_table(plain, systems, prefixes, amp.energy))


def format_moments(res):
    """mu, and per split each metric's mean under real text, the LM and p*, and the predicted gain."""
    mu = ', '.join(f"{n} {m:+.4f}" for n, m in zip(res['metrics'], res['mu']))
    lines = [f"mu ({res['newton_steps']} Newton steps): {mu}"]
    for split, r in res['splits'].items():
        lines.append(f"{split} ({r['prefixes']} prefixes x {r['pool']} LM samples"
                     f"{', fitted here' if split == 'select' else ''}): predicted gain KL(p*||P_LM) "
                     f"{r['predicted_gain_nats_per_token']:.5f} nats/token (SE {r['predicted_gain_se']:.5f})")
        for k, n in enumerate(r['metrics']):
            real, lm, joint = r['real'][k], r['lm'][k], r['joint'][k]
            lines.append(f"  {n:<10} real {real:>9.4f}   LM {lm:>9.4f} ({lm - real:+.4f})"
                         f"   joint {joint:>9.4f} ({joint - real:+.4f})")
    return '\n'.join(lines)


if __name__ == '__main__':
    run_main(main)

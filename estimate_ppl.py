"""
Perplexity of the joint model P_LM exp(-E) / Z (Eq. 2), which needs the partition function
log Z(prefix) = log E_{x~P_LM}[exp(-E(x))] (Section 3.2). From n samples of the *untruncated* LM
(the expectation is under P_LM itself; top-k samples would estimate another quantity):

    lower  T_n = log (1/n) sum_i exp(-E(x_i))                        (Eq. 4, left)
    upper  (2n-1) T_n - 2(n-1) mean_i T_{n-1}^{(-i)}                 (Eq. 4, right; leave-one-out)

Both are biased, in opposite directions, and tighten as n grows (Theorem 2), so the joint PPL is a
range: its low end uses the lower bound of log Z, its high end the upper bound.

Also: per-step perplexity (Eq. 5, Fig. 1) with --per_step, exact at the last position by
enumerating the vocabulary; and the bounds as n grows (Fig. 2 left) with --sweep.

    python estimate_ppl.py --lm out/lm/ckpt.pt --energy out/bit/ckpt.pt --splits val,test
    torchrun --standalone --nproc_per_node 2 estimate_ppl.py ...      # prefixes sharded over ranks
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from data import load_meta, load_split, write_json
from energy import load_energy
from model import check_vocab, file_hash, load_lm
from negatives import chunk_seed, window_tokens, windows
from tokenizer import load_tokenizer
from train_lm import progress, resolve_device, setup_distributed


def leave_one_out_lse(lw):
    """log sum_{j != i} exp(lw_j) for every i along the last dim, combined from prefix and suffix
    log-cum-sum-exps: no log(S - w_i), which cancels catastrophically when w_i dominates S."""
    ninf = torch.full_like(lw[..., :1], float('-inf'))
    before = torch.cat([ninf, torch.logcumsumexp(lw, -1)[..., :-1]], -1)
    after = torch.cat([torch.logcumsumexp(lw.flip(-1), -1).flip(-1)[..., 1:], ninf], -1)
    return torch.logaddexp(before, after)


def logz_bounds(log_w):
    """(lower, upper) estimates of log E[w] from log-weights log_w (..., n), log_w = -E(x_i) with
    x_i ~ P_LM: T_n and (2n-1) T_n - 2(n-1) T_{n-1}, T_{n-1} the mean of the n leave-one-out
    estimates (Eq. 4; Nowozin 2018). Computed in float64 log space over the last dim."""
    n = log_w.size(-1)
    if n < 2:
        raise ValueError(f"the log Z bounds need at least 2 samples, got {n}")
    lw = log_w.double()
    T_n = torch.logsumexp(lw, -1) - math.log(n)
    T_n1 = (leave_one_out_lse(lw) - math.log(n - 1)).mean(-1)
    return T_n, (2 * n - 1) * T_n - 2 * (n - 1) * T_n1


# -----------------------------------------------------------------------------
# scoring

@torch.no_grad()
def score(energy, x, prefix_len, ctx, max_rows=256, max_tokens=8192):
    """Energies of the rows of x (N, T), at most max_rows and about max_tokens tokens per forward:
    on a CPU, blocks whose activations stay in cache ran 1.4x faster than 256 rows of 192 tokens."""
    rows = max(1, min(max_rows, max_tokens // x.size(1)))
    with ctx:
        return torch.cat([energy(b, prefix_len) for b in x.split(rows)]).double()


@torch.no_grad()
def sample_log_weights(lm, energies, prefixes, gen_len, n, ctx, generator, max_rows=256, prefix_len=None):
    """log w = -E(x) of n untruncated LM continuations of each prefix, for each energy:
    (num_energies, B, n). The prefixes run through the LM once, the models see at most max_rows
    sequences at a time, and memory beyond that holds only the n sampled token ids per prefix.
    prefix_len: where the energy's prefix ends (default all of `prefixes`); Eq. 5 conditions on real
    continuation tokens too, but E(x) is the same function of the whole sequence, its prefix the
    original one."""
    B, P = prefixes.shape
    prefix_len = P if prefix_len is None else prefix_len
    with ctx:
        tokens, _ = lm.generate(prefixes, gen_len, num_samples=n, generator=generator, max_rows=max_rows)
    per = max(1, max_rows // B)
    out = []
    for s in range(0, n, per):
        c = min(per, n - s)
        x = torch.cat([prefixes[:, None].expand(-1, c, -1), tokens[:, s:s + c]], dim=2).flatten(0, 1)
        out.append(torch.stack([-score(e, x, prefix_len, ctx, max_rows).view(B, c) for e in energies]))
    return torch.cat(out, dim=2)


@torch.no_grad()
def last_step_logz(lm, energy, x, prefix_len, ctx):
    """Exact log Z(x_<T) = log sum_v P_LM(v | x_<T) exp(-E(x_<T, v)): the denominator of Eq. 5
    at the last position, by enumerating the vocabulary (batched energy calls). x: (B, T), its
    first prefix_len tokens the prefix that E(x) was defined with."""
    V = lm.config.vocab_size
    with ctx:
        logp = torch.log_softmax(lm(x[:, :-1])[0][:, -1].double(), -1)  # (B, V)
    out = []
    for b in range(x.size(0)):
        cand = x[b].repeat(V, 1)
        cand[:, -1] = torch.arange(V, device=x.device)
        out.append(torch.logsumexp(logp[b] - score(energy, cand, prefix_len, ctx), 0))
    return torch.stack(out)


# -----------------------------------------------------------------------------
# sequence-level joint PPL (Table 1)

def evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, ctx, device, rank, world_size, split):
    """Per-prefix log-probs, energies and log Z bounds, each rank taking every world_size-th
    chunk of prefixes; every chunk has its own seed, so results do not depend on world_size."""
    P, L = args.prefix_len, args.gen_len
    sweep = sorted(set(args.sweep + [args.num_samples]))
    recs = []
    chunks = range(0, len(offsets), args.chunk)
    mine = list(chunks)[rank::world_size]
    for s in progress(mine, quiet=args.quiet or rank != 0, desc=f'log Z ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P + L).to(device)
        g = torch.Generator(device).manual_seed(chunk_seed(args.seed, split, s, purpose=1))
        with ctx:
            lp = lm.sequence_logprob(x, P).double()
            extra = [m.sequence_logprob(x, P).double() for m in extra_lms]
        e_real = [score(e, x, P, ctx) for e in energies]
        log_w = sample_log_weights(lm, energies, x[:, :P], L, max(sweep), ctx, g, args.max_rows)
        bounds = {n: logz_bounds(log_w[..., :n]) for n in sweep}
        for b in range(x.size(0)):
            recs.append(dict(index=s + b, lm_logp=lp[b].item(), extra_logp=[t[b].item() for t in extra],
                             energy=[t[b].item() for t in e_real],
                             logz={n: [[lo[k, b].item(), hi[k, b].item()] for k in range(len(energies))]
                                   for n, (lo, hi) in bounds.items()}))
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, recs)
        recs = [r for part in gathered for r in part]
    return sorted(recs, key=lambda r: r['index'])


def summarize(recs, names, extra_names, num_tokens, n, num_chars=None):
    """PPL of each model over the prefixes: the base LM, extra LMs, and each joint model as a
    range, with the per-prefix gain over the base LM (nats/token, conservative end) and its SE."""
    lp = np.array([r['lm_logp'] for r in recs])
    ppl = lambda logp, count: float(np.exp(-logp.sum() / count))
    rows = [dict(model='BASE LM', ppl=ppl(lp, num_tokens))]
    for j, name in enumerate(extra_names):
        rows.append(dict(model=name, ppl=ppl(np.array([r['extra_logp'][j] for r in recs]), num_tokens)))
    L = num_tokens / len(recs)
    for k, name in enumerate(names):
        e = np.array([r['energy'][k] for r in recs])
        lo = np.array([r['logz'][n][k][0] for r in recs])
        hi = np.array([r['logz'][n][k][1] for r in recs])
        joint_high, joint_low = lp - e - lo, lp - e - hi  # log P bounds: low log Z -> high log P
        gain = (joint_low - lp) / L  # per-prefix nats/token gained over the base LM, upper-bound PPL
        rows.append(dict(model=f'JOINT {name}', ppl_low=ppl(joint_high, num_tokens), ppl_high=ppl(joint_low, num_tokens),
                         gain_nats_per_token=float(gain.mean()), gain_se=float(gain.std(ddof=1) / math.sqrt(len(gain))),
                         **({'ppl_char_low': ppl(joint_high, num_chars), 'ppl_char_high': ppl(joint_low, num_chars)} if num_chars else {})))
    if num_chars:
        rows[0]['ppl_char'] = ppl(lp, num_chars)
    return rows


# -----------------------------------------------------------------------------
# per-step PPL (Eq. 5, Fig. 1)

@torch.no_grad()
def per_step(lm, energy, x, P, m, ctx, generator, max_rows=256):
    """For each position t of the continuation of every row of x (B, P+L): log P_LM(x_t | x_<t)
    and bounds of log Z(x_<=t) for k = t - P = 0..L real continuation tokens fixed, the rest
    marginalised with m LM samples; Z with all L fixed is exp(-E(x)), exactly. Each Z is
    computed once: the numerator of step t is the denominator of step t+1.
    Returns lp (B, L), logz_lo and logz_hi (B, L+1)."""
    B, T = x.shape
    L = T - P
    with ctx:
        _, lp = lm.sequence_logprob(x, P, per_token=True)
    lo, hi = torch.empty(B, L + 1, dtype=torch.float64), torch.empty(B, L + 1, dtype=torch.float64)
    for k in range(L):
        log_w = sample_log_weights(lm, [energy], x[:, :P + k], L - k, m, ctx, generator, max_rows, prefix_len=P)[0]
        lo[:, k], hi[:, k] = (t.cpu() for t in logz_bounds(log_w))
    lo[:, L] = hi[:, L] = -score(energy, x, P, ctx).cpu()
    return lp.double().cpu(), lo, hi


def per_step_report(lm, energy, data, offsets, args, ctx, device):
    """Fig. 1: base and joint PPL at each continuation position, with the exact last step."""
    P, L = args.prefix_len, args.gen_len
    x = window_tokens(data, offsets[:args.step_prefixes], P + L).to(device)
    g = torch.Generator(device).manual_seed(args.seed)
    lp, lo, hi = per_step(lm, energy, x, P, args.step_samples, ctx, g, args.max_rows)
    step_low = lp + lo[:, 1:] - hi[:, :-1]  # log P(x_t|x_<t): low numerator, high denominator
    step_high = lp + hi[:, 1:] - lo[:, :-1]
    exact_last = lp[:, -1] + lo[:, -1] - last_step_logz(lm, energy, x, P, ctx).cpu()
    return dict(num_prefixes=x.size(0), step_samples=args.step_samples,
                position=list(range(1, L + 1)),
                base_ppl=torch.exp(-lp.mean(0)).tolist(),
                joint_ppl_low=torch.exp(-step_high.mean(0)).tolist(),
                joint_ppl_high=torch.exp(-step_low.mean(0)).tolist(),
                last_step_exact_ppl=math.exp(-exact_last.mean().item()),
                last_step_base_ppl=math.exp(-lp[:, -1].mean().item()))


# -----------------------------------------------------------------------------

def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a('--lm', default='out/lm/ckpt.pt', help='the base LM')
    a('--energy', nargs='*', default=[], metavar='NAME=CKPT', help='energies of the joint models, e.g. BIT=out/bit/ckpt.pt')
    a('--extra_lm', nargs='*', default=[], metavar='NAME=CKPT', help='more LMs to report as rows (BALM, RALM)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--splits', default='test', help='comma-separated: val,test')
    a('--prefix_len', type=int, default=128)
    a('--gen_len', type=int, default=64)
    a('--max_prefixes', type=int, default=128, help='evenly spaced prefixes per split (0: all)')
    a('--num_samples', type=int, default=64, help='n LM samples per prefix for the log Z bounds')
    a('--sweep', default='', help='comma-separated n values for the bounds as n grows (Fig. 2 left)')
    a('--per_step', nargs='?', const='', default=None, metavar='NAME',
      help='per-step PPL (Eq. 5, Fig. 1) on the last split, of energy NAME (default: the first)')
    a('--step_prefixes', type=int, default=8)
    a('--step_samples', type=int, default=16, help='m LM samples per position for Eq. 5')
    a('--chunk', type=int, default=16, help='prefixes per batch')
    a('--max_rows', type=int, default=256, help='sequences per forward (bounds memory)')
    a('--out', default='out/ppl.json', help='JSON results (plus a .png per figure if matplotlib is installed)')
    a('--device', default='auto')
    a('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true')
    args = p.parse_args(argv)
    args.sweep = [int(n) for n in args.sweep.split(',') if n]
    args.splits = [s for s in args.splits.split(',') if s]
    for spec in args.energy + args.extra_lm:
        if '=' not in spec:
            raise ValueError(f"'{spec}' must be NAME=CHECKPOINT, e.g. BIT=out/bit/ckpt.pt")
    names = ['BASE LM'] + [s.split('=', 1)[0] for s in args.energy + args.extra_lm]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct (and not 'BASE LM'): {names[1:]}")
    if min([args.num_samples] + args.sweep) < 2:
        raise ValueError("--num_samples and --sweep values must be at least 2 (the upper bound needs leave-one-out)")
    return args


def print_table(rows, splits):
    print(f"{'model':<14} {'params':>8} " + ' '.join(f"{s + ' PPL':>16}" for s in splits))
    for name in dict.fromkeys(r['model'] for r in rows):
        cells = {r['split']: r for r in rows if r['model'] == name}
        first = next(iter(cells.values()))
        fmt = lambda r: f"{r['ppl']:.3f}" if 'ppl' in r else f"{r['ppl_low']:.3f}-{r['ppl_high']:.3f}"
        print(f"{name:<14} {first['params'] / 1e6:>7.2f}M " + ' '.join(f"{fmt(cells[s]) if s in cells else '':>16}" for s in splits))


def main(argv=None):
    args = get_args(argv)
    device, dtype, ctx = resolve_device(args.device, args.dtype)
    rank, world_size, device = setup_distributed(device)
    lm, lm_ckpt = load_lm(args.lm, device)
    data_dir = args.data_dir or lm_ckpt['meta']['data_dir']
    meta = load_meta(data_dir)
    check_vocab(lm_ckpt, meta, args.lm)
    names, energies = [], []
    for spec in args.energy:
        name, path = spec.split('=', 1)
        names.append(name)
        energies.append(load_energy(path, args.lm, device)[0])
    extra_names, extra_lms = [], []
    for spec in args.extra_lm:
        name, path = spec.split('=', 1)
        extra_names.append(name)
        extra_lms.append(load_lm(path, device, meta=meta)[0])
    if args.per_step and args.per_step not in names:
        raise ValueError(f"--per_step {args.per_step} names no energy (have: {', '.join(names)})")
    P, L = args.prefix_len, args.gen_len
    for model in [lm] + energies + extra_lms:
        if P + L > model.config.block_size:
            raise ValueError(f"prefix_len + gen_len = {P + L} exceeds a model's block_size {model.config.block_size}")
    params = dict(zip(['BASE LM'] + extra_names + [f'JOINT {n}' for n in names],
                      [lm.num_params()] + [m.num_params() for m in extra_lms] + [lm.num_params() + e.num_params() for e in energies]))
    tok = load_tokenizer(meta)

    hashes = {'BASE LM': file_hash(args.lm)}
    hashes.update({s.split('=', 1)[0]: file_hash(s.split('=', 1)[1]) for s in args.energy + args.extra_lm})
    out = dict(hashes=hashes, splits={}, rows=[])
    for split in args.splits:
        data = load_split(data_dir, split, meta)
        offsets = windows(data, meta['eot_id'], P, L, max_windows=args.max_prefixes or None)
        if len(offsets) < 2:
            raise ValueError(f"the {split} split has fewer than 2 windows of {P + L} tokens: lower --prefix_len/--gen_len")
        recs = evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, ctx, device, rank, world_size, split)
        num_chars = None if meta['tokenizer'] == 'char' else \
            sum(len(tok.decode(data[o + P:o + P + L].tolist())) for o in offsets)
        rows = summarize(recs, names, extra_names, len(offsets) * L, args.num_samples, num_chars)
        summary = dict(split=split, num_samples=args.num_samples, num_prefixes=len(offsets), num_tokens=len(offsets) * L,
                       prefix_len=P, gen_len=L, base_ppl=rows[0]['ppl'])
        if names:
            summary.update(joint_ppl_low=rows[len(extra_names) + 1]['ppl_low'], joint_ppl_high=rows[len(extra_names) + 1]['ppl_high'])
        if args.sweep:
            summary['sweep'] = {n: summarize(recs, names, [], len(offsets) * L, n)[1:] for n in sorted(set(args.sweep))}
        out['splits'][split] = dict(summary, rows=rows)
        out['rows'] += [dict(r, split=split, params=params[r['model']]) for r in rows]
        if args.per_step is not None and energies and rank == 0 and split == args.splits[-1]:  # one split is enough
            k = names.index(args.per_step) if args.per_step else 0
            out['splits'][split]['per_step'] = dict(per_step_report(lm, energies[k], data, offsets, args, ctx, device), energy=names[k])
    if rank == 0:
        write_json(out, args.out)
        print_table(out['rows'], args.splits)
        print(f"joint PPL as a range from {args.num_samples} LM samples per prefix (Eq. 4); -> {args.out}")
        plot(out, args.out)
    if world_size > 1:
        dist.destroy_process_group()
    return out


def plot(out, path):
    """Fig. 1 (per-step PPL) and Fig. 2 left (bounds vs n) as PNGs, if matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    base = os.path.splitext(path)[0]
    for split, res in out['splits'].items():
        if 'per_step' in res:
            ps = res['per_step']
            plt.figure(figsize=(6, 4))
            plt.plot(ps['position'], ps['base_ppl'], label='BASE LM')
            plt.fill_between(ps['position'], ps['joint_ppl_low'], ps['joint_ppl_high'], alpha=0.5, label='JOINT (bounds)')
            plt.scatter([ps['position'][-1]], [ps['last_step_exact_ppl']], color='k', zorder=3, label='JOINT exact (last step)')
            plt.xlabel('position in continuation'), plt.ylabel('PPL'), plt.legend(), plt.title(f'per-step PPL ({split})')
            plt.savefig(f'{base}_per_step_{split}.png', dpi=120, bbox_inches='tight')
            plt.close()
        if 'sweep' in res:
            ns = sorted(res['sweep'], key=int)
            plt.figure(figsize=(6, 4))
            for k, row in enumerate(res['sweep'][ns[0]]):
                plt.plot(ns, [res['sweep'][n][k]['ppl_low'] for n in ns], label=f"{row['model']} low")
                plt.plot(ns, [res['sweep'][n][k]['ppl_high'] for n in ns], '--', label=f"{row['model']} high")
            plt.axhline(res['base_ppl'], color='k', lw=0.8, label='BASE LM')
            plt.xscale('log'), plt.xlabel('n samples'), plt.ylabel('PPL'), plt.legend(), plt.title(f'bounds vs n ({split})')
            plt.savefig(f'{base}_sweep_{split}.png', dpi=120, bbox_inches='tight')
            plt.close()


if __name__ == '__main__':
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")

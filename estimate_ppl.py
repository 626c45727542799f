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

import math
import os

import numpy as np
import torch
import torch.distributed as dist

from data import SPLITS, load_meta, load_split, window_tokens, windows, write_json, write_text
from energy import load_energy, sample_log_weights, score, score_continuations
from model import check_vocab, file_hash, load_lm
from tokenizer import load_tokenizer
from runtime import (DTYPES, ArgumentParser, at_least, check, check_writable, precision, progress, rng, run_main, sampling_probe,
                     scoring_probe, setup, teardown_distributed)


def leave_one_out_lse(lw):
    """log sum_{j != i} exp(lw_j) for every i along the last dim, combined from prefix and suffix
    log-cum-sum-exps: no log(S - w_i), which cancels catastrophically when w_i dominates S."""
    ninf = torch.full_like(lw[..., :1], float('-inf'))
    before = torch.cat([ninf, torch.logcumsumexp(lw, -1)[..., :-1]], -1)
    after = torch.cat([torch.logcumsumexp(lw.flip(-1), -1).flip(-1)[..., 1:], ninf], -1)
    return torch.logaddexp(before, after)


def mc_se(log_w):
    """Monte-Carlo standard error of T_n (..., n) by the delta method, sd(w) / (sqrt(n) mean(w)):
    the spread of one draw of the estimate, which the bounds' range (their expected gap) omits."""
    lw = log_w.double()
    w = torch.exp(lw - lw.amax(-1, keepdim=True))
    return w.std(-1) / (w.mean(-1) * math.sqrt(log_w.size(-1)))


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
# Z exactly, at the last step

@torch.no_grad()
def last_step_logz(lm, energy, x, prefix_len, ctx, ectx=None):
    """Exact log Z(x_<T) = log sum_v P_LM(v | x_<T) exp(-E(x_<T, v)): the denominator of Eq. 5
    at the last position, by enumerating the vocabulary (batched energy calls). x: (B, T), its
    first prefix_len tokens the prefix that E(x) was defined with."""
    V = lm.config.vocab_size
    with ctx:
        logp = torch.log_softmax(lm.logits(x[:, :-1], first=x.size(1) - 2)[:, -1].double(), -1)  # (B, V)
    vocab = torch.arange(V, device=x.device).expand(x.size(0), V)[..., None]  # every v after each x_<T
    return torch.logsumexp(logp - score_continuations(energy, x[:, :-1], vocab, prefix_len, ectx or ctx), -1)


# -----------------------------------------------------------------------------
# sequence-level joint PPL (Table 1)

def evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, ctx, ectx, device, rank, world_size, split):
    """Per-prefix log-probs, energies and log Z bounds, each rank taking every world_size-th
    chunk of prefixes; every chunk has its own seed, so results do not depend on world_size."""
    P, L = args.prefix_len, args.gen_len
    sweep = sorted(set(args.sweep + [args.num_samples]))
    recs = []
    chunks = range(0, len(offsets), args.chunk)
    mine = list(chunks)[rank::world_size]
    for s in progress(mine, quiet=args.quiet or rank != 0, desc=f'log Z ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P + L).to(device)
        g = rng(args.seed, 'log_z', split, s, device)
        with ctx:
            lp = lm.sequence_logprob(x, P).double()
            extra = [m.sequence_logprob(x, P).double() for m in extra_lms]
        e_real = [score(e, x, P, ectx) for e in energies]
        log_w = sample_log_weights(lm, energies, x[:, :P], L, max(sweep), ctx, g, args.max_rows, ectx=ectx)
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
    range; for every model but the base, the per-prefix gain over the base LM in nats per token
    (for a joint model at its conservative, high-PPL end) with its standard error."""
    lp = np.array([r['lm_logp'] for r in recs])
    ppl = lambda logp, count: float(np.exp(-logp.sum() / count))
    L = num_tokens / len(recs)
    gain = lambda logp: dict(gain_nats_per_token=float(((logp - lp) / L).mean()),
                             gain_se=float(((logp - lp) / L).std(ddof=1) / math.sqrt(len(lp))))
    rows = [dict(model='BASE LM', ppl=ppl(lp, num_tokens))]
    for j, name in enumerate(extra_names):
        logp = np.array([r['extra_logp'][j] for r in recs])
        rows.append(dict(model=name, ppl=ppl(logp, num_tokens), **gain(logp)))
    for k, name in enumerate(names):
        e = np.array([r['energy'][k] for r in recs])
        lo = np.array([r['logz'][n][k][0] for r in recs])
        hi = np.array([r['logz'][n][k][1] for r in recs])
        joint_high, joint_low = lp - e - lo, lp - e - hi  # log P bounds: low log Z -> high log P
        rows.append(dict(model=f'JOINT {name}', ppl_low=ppl(joint_high, num_tokens), ppl_high=ppl(joint_low, num_tokens),
                         **gain(joint_low),
                         **({'ppl_char_low': ppl(joint_high, num_chars), 'ppl_char_high': ppl(joint_low, num_chars)} if num_chars else {})))
    if num_chars:
        rows[0]['ppl_char'] = ppl(lp, num_chars)
    return rows


# -----------------------------------------------------------------------------
# calibration: how far the n-sample bounds are from log Z

def calibrate(log_w, n, L):
    """Bias of the n-sample bounds of Eq. 4, measured against a reference from all N samples of
    log_w (..., B, N) (many more than n): the N samples are cut into N // n disjoint groups of
    n, the mean of a bound over groups estimates its expectation, and bias = that minus the
    reference log Z, per token (/ L) and averaged over the B prefixes. Theorem 2 makes the
    lower bias negative and, for n large enough, the upper one positive; at small n with
    heavy-tailed weights both are negative. Also: the fraction of (prefix, group) ranges that
    contain the reference, and how wide the reference's own range is (it should be << the
    biases it measures)."""
    N = log_w.size(-1)
    ref_lo, ref_hi = logz_bounds(log_w)
    ref = (ref_lo + ref_hi) / 2
    lo, hi = logz_bounds(log_w[..., :N // n * n].unflatten(-1, (N // n, n)))  # (..., B, groups)
    covered = (lo <= ref[..., None]) & (ref[..., None] <= hi)
    return dict(n=n, reference_samples=N, bias_lower=((lo.mean(-1) - ref) / L).mean(-1).tolist(),
                bias_upper=((hi.mean(-1) - ref) / L).mean(-1).tolist(),
                bracketed=covered.double().mean((-2, -1)).tolist(),
                reference_width=(ref_hi - ref_lo).abs().mean(-1).tolist())


def calibration_report(lm, energies, names, data, offsets, args, ctx, ectx, device, split):
    """calibrate() on an evenly spaced subset of the split's prefixes, for every energy and for
    every power-of-two n up to N / 8 (the default n included), in nats per token."""
    P, L, B = args.prefix_len, args.gen_len, args.calib_prefixes
    offsets = offsets[np.linspace(0, len(offsets) - 1, min(B, len(offsets))).round().astype(int)]
    log_w = []
    for s in progress(range(0, len(offsets), args.chunk), quiet=args.quiet, desc=f'calibration ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P).to(device)
        g = rng(args.seed, 'calibration', split, s, device)
        log_w.append(sample_log_weights(lm, energies, x, L, args.calib_samples, ctx, g, args.max_rows, ectx=ectx))
    log_w = torch.cat(log_w, dim=1)  # (energies, B, N)
    ns = sorted({2 ** k for k in range(1, 20) if 2 ** k <= args.calib_samples // 8} | {args.num_samples})
    per_n = {n: calibrate(log_w, n, L) for n in ns}
    return {name: dict(prefixes=len(offsets), reference_samples=args.calib_samples,
                       **{k: per_n[args.num_samples][k][i] for k in ('bias_lower', 'bias_upper', 'bracketed', 'reference_width')},
                       by_n={n: {k: c[k][i] for k in ('bias_lower', 'bias_upper', 'bracketed')} for n, c in per_n.items()})
            for i, name in enumerate(names)}


# -----------------------------------------------------------------------------
# per-step PPL (Eq. 5, Fig. 1)

@torch.no_grad()
def per_step(lm, energy, x, P, m, ctx, generator, max_rows=256, ectx=None):
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
        log_w = sample_log_weights(lm, [energy], x[:, :P + k], L - k, m, ctx, generator, max_rows, prefix_len=P, ectx=ectx)[0]
        lo[:, k], hi[:, k] = (t.cpu() for t in logz_bounds(log_w))
    lo[:, L] = hi[:, L] = -score(energy, x, P, ectx or ctx).cpu()
    return lp.double().cpu(), lo, hi


def per_step_report(lm, energy, data, offsets, args, ctx, ectx, device, split):
    """Fig. 1: base and joint PPL at each continuation position, with the exact last step, and
    the last step estimated again from last_step_samples samples. The bounds bracket log Z in
    expectation (for n large enough, Theorem 2), not in every draw: the estimate must lie within
    a few Monte-Carlo SE (mc_se) of the exact value, and its range contains it only when the
    draw's noise is smaller than the range's width."""
    P, L = args.prefix_len, args.gen_len
    x = window_tokens(data, offsets[:args.step_prefixes], P + L).to(device)
    g = rng(args.seed, 'per_step', split, 0, device)
    lp, lo, hi = per_step(lm, energy, x, P, args.step_samples, ctx, g, args.max_rows, ectx)
    step_low = lp + lo[:, 1:] - hi[:, :-1]  # log P(x_t|x_<t): low numerator, high denominator
    step_high = lp + hi[:, 1:] - lo[:, :-1]
    exact_last = lp[:, -1] + lo[:, -1] - last_step_logz(lm, energy, x, P, ctx, ectx).cpu()
    log_w = sample_log_weights(lm, [energy], x[:, :-1], 1, args.last_step_samples, ctx, g, args.max_rows, P, ectx)[0]
    z_lo, z_hi = (t.cpu() for t in logz_bounds(log_w))
    last = lambda z: math.exp(-(lp[:, -1] + lo[:, -1] - z).mean().item())
    return dict(num_prefixes=x.size(0), step_samples=args.step_samples, last_step_samples=args.last_step_samples,
                last_step_ppl_low=last(z_lo), last_step_ppl_high=last(z_hi),
                last_step_mc_se=mc_se(log_w).pow(2).sum().sqrt().item() / x.size(0),  # nats/token, of the mean
                position=list(range(1, L + 1)),
                base_ppl=torch.exp(-lp.mean(0)).tolist(),
                joint_ppl_low=torch.exp(-step_high.mean(0)).tolist(),
                joint_ppl_high=torch.exp(-step_low.mean(0)).tolist(),
                last_step_exact_ppl=math.exp(-exact_last.mean().item()),
                last_step_base_ppl=math.exp(-lp[:, -1].mean().item()))


# -----------------------------------------------------------------------------

def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/ckpt.pt', help='the base LM')
    a('--energy', nargs='*', default=[], metavar='NAME=CKPT', help='energies of the joint models, e.g. BIT=out/bit/ckpt.pt')
    a('--extra_lm', nargs='*', default=[], metavar='NAME=CKPT', help='more LMs to report as rows (BALM, RALM)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--splits', default='test', help='comma-separated: val,test')
    a('--prefix_len', type=int, default=128)
    a('--gen_len', type=int, default=64)
    a('--max_prefixes', type=int, default=256, help='evenly spaced prefixes per split (0: all)')
    a('--num_samples', type=int, default=128, help='n LM samples per prefix for the log Z bounds')
    a('--sweep', default='', help='comma-separated n values for the bounds as n grows (Fig. 2 left)')
    a('--per_step', nargs='?', const='', default=None, metavar='NAME',
      help='per-step PPL (Eq. 5, Fig. 1) on the last split, of energy NAME (default: the first)')
    a('--step_prefixes', type=int, default=8)
    a('--step_samples', type=int, default=16, help='m LM samples per position for Eq. 5')
    a('--last_step_samples', type=int, default=1024, help='LM samples for the last step estimated again, beside the exact value')
    a('--calib_prefixes', type=int, default=16, help='prefixes of the last split on which the n-sample bounds are calibrated (0: off)')
    a('--calib_samples', type=int, default=2048, help='LM samples per prefix of the calibration reference (n_ref)')
    a('--chunk', type=int, default=16, help='prefixes per batch')
    a('--max_rows', type=int, default=256, help='sequences per forward (bounds memory)')
    a('--out', default='out/ppl.json', help='JSON results (figures.py draws Fig. 1 and Fig. 2 left from them)')
    a('--device', default='auto')
    a('--dtype', default='auto', choices=DTYPES, help='autocast dtype of sampling and of scoring (auto: each measured)')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true')
    args = p.parse_args(argv)
    try:
        args.sweep = [int(n) for n in args.sweep.split(',') if n]
    except ValueError:
        raise ValueError(f"--sweep {args.sweep}: must be comma-separated integers, e.g. 2,4,16") from None
    args.splits = [s for s in args.splits.split(',') if s]
    if not args.splits or any(s not in SPLITS for s in args.splits):
        raise ValueError(f"--splits {','.join(args.splits)}: must be comma-separated names of {', '.join(SPLITS)}")
    at_least(args, 1, 'prefix_len', 'gen_len', 'step_prefixes', 'chunk', 'max_rows')
    check(args, 'max_prefixes', lambda v: v == 0 or v >= 2, '0 (all) or at least 2 (the gain has a standard error)')
    at_least(args, 2, 'step_samples')  # per-step bounds need leave-one-out too
    if args.per_step is not None and not args.energy:
        raise ValueError("--per_step needs an energy: pass --energy NAME=CKPT")
    for spec in args.energy + args.extra_lm:
        if not all(spec.partition('=')):
            raise ValueError(f"'{spec}' must be NAME=CHECKPOINT, e.g. BIT=out/bit/ckpt.pt")
    names = ['BASE LM'] + [s.split('=', 1)[0] for s in args.energy + args.extra_lm]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct (and not 'BASE LM'): {names[1:]}")
    if min([args.num_samples] + args.sweep) < 2:
        raise ValueError("--num_samples and --sweep values must be at least 2 (the upper bound needs leave-one-out)")
    check_writable(args.out, '--out', folder=False)
    return args


def load_models(args, device):
    """The base LM, its data, the energies and the extra LMs named on the command line, checked
    to belong together and to fit prefix_len + gen_len."""
    lm, lm_ckpt = load_lm(args.lm, device)
    data_dir = args.data_dir or lm_ckpt['meta']['data_dir']
    meta = load_meta(data_dir)
    check_vocab(lm_ckpt, meta, args.lm)
    energies = {name: load_energy(path, args.lm, device)[0] for name, path in (s.split('=', 1) for s in args.energy)}
    extra = {name: load_lm(path, device, meta=meta)[0] for name, path in (s.split('=', 1) for s in args.extra_lm)}
    if args.per_step and args.per_step not in energies:
        raise ValueError(f"--per_step {args.per_step} names no energy (have: {', '.join(energies)})")
    for model in [lm] + list(energies.values()) + list(extra.values()):
        if args.prefix_len + args.gen_len > model.config.block_size:
            raise ValueError(f"prefix_len + gen_len = {args.prefix_len + args.gen_len} exceeds a model's "
                             f"block_size {model.config.block_size}")
    return lm, meta, data_dir, (list(energies), list(energies.values())), (list(extra), list(extra.values()))


def format_table(rows, splits):
    """Table 1 as text: PPL per split (a range for joint models), then, on the last split, the
    gain over the base LM in nats per token (conservative end, +- SE) and the PPL reduction."""
    last = splits[-1]
    head = f"{'model':<12} {'params':>8} " + ' '.join(f"{s + ' PPL':>13}" for s in splits)
    lines = [head + f" {last + ' gain nats/tok (SE)':>26} {last + ' PPL reduction':>19}"]
    base = next(r['ppl'] for r in rows if r['model'] == 'BASE LM' and r['split'] == last)
    for name in dict.fromkeys(r['model'] for r in rows):
        cells = {r['split']: r for r in rows if r['model'] == name}
        fmt = lambda r: f"{r['ppl']:.3f}" if 'ppl' in r else f"{r['ppl_low']:.3f}-{r['ppl_high']:.3f}"
        line = f"{name:<12} {next(iter(cells.values()))['params'] / 1e6:>7.2f}M " + \
            ' '.join(f"{fmt(cells[s]) if s in cells else '':>13}" for s in splits)
        r = cells.get(last, {})
        if 'gain_se' in r:
            z = r['gain_nats_per_token'] / r['gain_se'] if r['gain_se'] > 0 else float('nan')
            line += f" {r['gain_nats_per_token']:>+11.5f} ({r['gain_se']:.5f}, {z:>4.1f} SE)"
            line += f" {100 * (1 - r.get('ppl', r.get('ppl_high', base)) / base):>18.2f}%"
        lines.append(line)
    return '\n'.join(lines)


def format_calibration(calib, num_samples, gains):
    """One line per energy: the bias of each bound at the default n, against the reference."""
    lines = []
    for name, c in calib.items():
        se = gains.get(name)
        lines.append(f"calibration {name}: n = {num_samples} vs n_ref = {c['reference_samples']} on {c['prefixes']} prefixes: "
                     f"bias of the lower bound {c['bias_lower']:+.5f}, upper {c['bias_upper']:+.5f} nats/token"
                     + (f" (gain SE {se:.5f})" if se else '') + f"; range contains log Z for {100 * c['bracketed']:.0f}% "
                     f"(reference width {c['reference_width']:.4f} nats)")
    return '\n'.join(lines)


def format_last_step(ps):
    """The per-step check in one line: the last step's estimate against its exact value."""
    if not ps:
        return ''
    gap = math.log(math.sqrt(ps['last_step_ppl_low'] * ps['last_step_ppl_high']) / ps['last_step_exact_ppl'])
    se = ps['last_step_mc_se']  # 0 when every weight is equal (E constant): the estimate is exact
    return (f"\nlast step ({ps['energy']}, {ps['num_prefixes']} prefixes): exact PPL {ps['last_step_exact_ppl']:.4f}, "
            f"estimated {ps['last_step_ppl_low']:.4f}-{ps['last_step_ppl_high']:.4f} from {ps['last_step_samples']} samples: "
            f"off by {gap:+.5f} nats/token" + (f", {abs(gap) / se:.1f} Monte-Carlo SE ({se:.5f})" if se > 0 else ''))


def main(argv=None):
    args = get_args(argv)
    rank, world_size, device = setup(args.device)
    lm, meta, data_dir, (names, energies), (extra_names, extra_lms) = load_models(args, device)
    P, L = args.prefix_len, args.gen_len
    dtype, ctx = precision(device, args.dtype, 'sample', sampling_probe(lm, device), rank == 0)
    edtype, ectx = precision(device, args.dtype, 'score', scoring_probe(energies[0], device, P + L), rank == 0) \
        if energies else (dtype, ctx)
    params = dict(zip(['BASE LM'] + extra_names + [f'JOINT {n}' for n in names],
                      [lm.num_params()] + [m.num_params() for m in extra_lms] + [lm.num_params() + e.num_params() for e in energies]))
    tok = load_tokenizer(meta)

    hashes = {'BASE LM': file_hash(args.lm)}
    hashes.update({s.split('=', 1)[0]: file_hash(s.split('=', 1)[1]) for s in args.energy + args.extra_lm})
    out = dict(hashes=hashes, dtype=dict(sample=dtype, score=edtype), splits={}, rows=[])
    for split in args.splits:
        data = load_split(data_dir, split, meta)
        offsets = windows(data, P, L, max_windows=args.max_prefixes or None)
        if len(offsets) < 2:
            raise ValueError(f"the {split} split has fewer than 2 windows of {P + L} tokens: lower --prefix_len/--gen_len")
        recs = evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, ctx, ectx, device, rank, world_size, split)
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
        if rank == 0 and energies and split == args.splits[-1]:  # one split is enough
            if args.per_step is not None:
                k = names.index(args.per_step) if args.per_step else 0
                out['splits'][split]['per_step'] = dict(per_step_report(lm, energies[k], data, offsets, args, ctx, ectx,
                                                                        device, split), energy=names[k])
            if args.calib_prefixes:
                out['splits'][split]['calibration'] = calibration_report(lm, energies, names, data, offsets, args,
                                                                         ctx, ectx, device, split)
    if rank == 0:
        last = out['splits'][args.splits[-1]]
        gains = {r['model'][6:]: r['gain_se'] for r in last['rows'] if r['model'].startswith('JOINT ')}
        text = format_table(out['rows'], args.splits) + '\n' + \
            f"joint PPL as a range from {args.num_samples} LM samples per prefix (Eq. 4)\n" + \
            format_calibration(last.get('calibration', {}), args.num_samples, gains) + format_last_step(last.get('per_step'))
        write_json(out, args.out)
        write_text(text + '\n', os.path.splitext(args.out)[0] + '.txt')
        print(text + f"\n-> {args.out}")
    teardown_distributed()
    return out


if __name__ == '__main__':
    run_main(main)

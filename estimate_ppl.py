"""
Perplexity of the joint model P_LM exp(-E) / Z (Eq. 2), which needs the partition function
log Z(prefix) = log E_{x~P_LM}[exp(-E(x))] (Section 3.2). From n samples of the *untruncated* LM
(the expectation is under P_LM itself; top-k samples would estimate another quantity):

    lower  T_n = log (1/n) sum_i exp(-E(x_i))                        (Eq. 4, left)
    upper  (2n-1) T_n - 2(n-1) mean_i T_{n-1}^{(-i)}                 (Eq. 4, right; leave-one-out)

Both are biased, in opposite directions, and tighten as n grows (Theorem 2), so the joint PPL is a
range: its low end uses the lower bound of log Z, its high end the upper bound. They are bounds in
expectation only, and only once n is large enough: where the energy is sharp (a few continuations
carry Z, and the samples rarely hold them) both ends fall far below log Z. So each prefix's range
comes with energy.logz_diagnostics (Kish's effective sample size; flagged when it is too small or
when the range lies below a sure lower bound of log Z), and beside it the joint PPL from
energy.logz_enumerate: every distinct continuation seen (the real one, the LM's --beam most likely
ones, the samples) scored exactly, the rest estimated without bias. Its sure part makes every
joint probability of the real continuation at most 1.

Also: per-step perplexity (Eq. 5, Fig. 1) with --per_step, exact at the last position by
enumerating the vocabulary; and the bounds as n grows (Fig. 2 left) with --ns.

    python estimate_ppl.py --lm out/lm/best.pt --energy out/bit/best.pt --split val,test
    torchrun --standalone --nproc_per_node 2 estimate_ppl.py ...      # prefixes sharded over ranks
"""

import math
import os
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from data import SPLITS, check_fits, load_lm_and_data, load_split, window_tokens, windows
from energy import (kl_to_lm, load_any_energy, logz_bounds, logz_diagnostics, logz_enumerate,
                    sample_log_weights, score, score_continuations, share_energies)
from model import load_lm
from data.tokenizer import load_tokenizer
from plumbing import (ArgumentParser, Precision, comma_ints, common_flags, file_hash, guards, precision,
                      progress, rng, run_main, setup, teardown_distributed, write_json, write_text)


def mc_se(log_w):
    """Monte-Carlo standard error of T_n (..., n) by the delta method, sd(w) / (sqrt(n) mean(w)):
    the spread of one draw of the estimate, which the bounds' range (their expected gap) omits."""
    lw = log_w.double()
    w = torch.exp(lw - lw.amax(-1, keepdim=True))
    return w.std(-1) / (w.mean(-1) * math.sqrt(log_w.size(-1)))


# -----------------------------------------------------------------------------
# Z exactly, at the last step

@torch.no_grad()
def last_step_logz(lm, energy, x, prefix_len, amp):
    """Exact log Z(x_<T) = log sum_v P_LM(v | x_<T) exp(-E(x_<T, v)): the denominator of Eq. 5
    at the last position, by enumerating the vocabulary (batched energy calls). x: (B, T), its
    first prefix_len tokens the prefix that E(x) was defined with; amp: the Precision of each model."""
    V = lm.config.vocab_size
    with amp.lm:
        logp = torch.log_softmax(lm.logits(x[:, :-1], from_pos=x.size(1) - 2)[:, -1].double(), -1)  # (B, V)
    vocab = torch.arange(V, device=x.device).expand(x.size(0), V)[..., None]  # every v after each x_<T
    return torch.logsumexp(logp - score_continuations(energy, x[:, :-1], vocab, prefix_len, amp.energy), -1)


# -----------------------------------------------------------------------------
# sequence-level joint PPL (Table 1): per prefix (evaluate_prefixes), per model (summarize), per
# split (table_1), each below its helpers

def enumerated(lm, energies, x, P, lm_logp, e_real, samples, samples_logp, log_w, args, amp):
    """Per energy, log Z of each prefix of x (B, P+L) by logz_enumerate (the real continuation and the
    LM's --beam most likely ones known, the first --num_samples samples) and the diagnostics of Eq. 4's
    range from the same samples: {name: {estimate, sure, mass, ess, max_share, flagged}}, each (B,)."""
    if not energies:
        return {}
    n, L = args.num_samples, x.size(1) - P
    known, known_logp = x[:, None, P:], lm_logp[:, None]  # (B, 1, L), (B, 1)
    known_w = {name: -e[:, None] for name, e in e_real.items()}
    if getattr(args, 'beam', 0):
        with amp.lm:
            beam, beam_logp = lm.beam_search(x[:, :P], L, args.beam)
        known, known_logp = torch.cat([known, beam], 1), torch.cat([known_logp, beam_logp], 1)
        for name, e in energies.items():
            e_beam = score_continuations(e, x[:, :P], beam, P, amp.energy)
            known_w[name] = torch.cat([known_w[name], -e_beam], 1)
    out = {}
    for k, name in enumerate(energies):
        z = logz_enumerate(torch.cat([known, samples[:, :n]], 1),
                           torch.cat([known_logp, samples_logp[:, :n]], 1),
                           torch.cat([known_w[name], log_w[k, :, :n]], 1), known=known.size(1))
        d = logz_diagnostics(log_w[k, :, :n], z['sure'])
        out[name] = {key: v.double().cpu() for key, v in dict(z, **d).items()}
    return out


def beside_logz(lm, energies, extra_lms, x, P, lm_logp, e_real, samples, samples_logp, log_w, args, amp):
    """What a chunk of prefixes x (B, P+L) reports beside Table 1's columns: the extra LMs' log-probs
    of the real continuation, and per energy KL(P_joint || P_LM) (kl_to_lm) and log Z by
    logz_enumerate with Eq. 4's diagnostics (enumerated)."""
    with amp.lm:
        extra = {name: m.sequence_logprob(x, P).double() for name, m in extra_lms.items()}
    kl = kl_to_lm(log_w[..., :args.num_samples]).cpu()  # (energies, B)
    return dict(extra_logp={k: v.cpu() for k, v in extra.items()},
                kl={k: kl[i] for i, k in enumerate(energies)},
                enum=enumerated(lm, energies, x, P, lm_logp, e_real, samples, samples_logp, log_w, args, amp))


def gathered(recs, world_size):
    """Every rank's chunk records (all_gather_object under DDP), in the order of their prefixes."""
    if world_size > 1:
        parts = [None] * world_size
        dist.all_gather_object(parts, recs)
        recs = [r for part in parts for r in part]
    return sorted(recs, key=lambda r: r['index'])


def columns(chunks):
    """The chunks' records joined into one float64 array per quantity, one entry per prefix."""
    cat = lambda get: np.concatenate([get(c).numpy() for c in chunks]).astype(np.float64)
    first = chunks[0]
    return dict(lm_logp=cat(lambda c: c['lm_logp']),
                extra_logp={k: cat(lambda c: c['extra_logp'][k]) for k in first['extra_logp']},
                energy={k: cat(lambda c: c['energy'][k]) for k in first['energy']},
                kl={k: cat(lambda c: c['kl'][k]) for k in first['kl']},
                enum={k: {q: cat(lambda c: c['enum'][k][q]) for q in first['enum'][k]}
                      for k in first['enum']},
                logz={k: {n: {end: cat(lambda c: c['logz'][k][n][end]) for end in ('low', 'high')}
                          for n in first['logz'][k]} for k in first['logz']})


@torch.no_grad()
def evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, amp, device, rank, world_size, split):
    """Table 1's per-prefix columns: log P_LM of the real continuation, each energy's E of the real
    sequence and its log Z bounds (Eq. 4) from n LM samples, for every n of the sweep; and
    beside_logz's. Each rank takes every world_size-th chunk of prefixes; each chunk has its own seed."""
    P, L = args.prefix_len, args.gen_len
    sweep = sorted(set(args.sweep + [args.num_samples]))
    recs = []
    mine = list(range(0, len(offsets), args.chunk))[rank::world_size]
    for s in progress(mine, quiet=args.quiet or rank != 0, desc=f'log Z ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P + L).to(device)  # (B, P+L)
        with amp.lm:
            lm_logp = lm.sequence_logprob(x, P).double()  # (B,)
        e_real = {name: score(e, x, P, amp.energy) for name, e in energies.items()}
        log_w, samples, samples_logp = (  # log_w (energies, B, n): -E of n LM samples of each prefix
            sample_log_weights(lm, list(energies.values()), x[:, :P], L, max(sweep), amp,
                               rng(args.seed, 'log_z', split, s, device), args.max_rows, return_samples=True)
            if energies else (torch.zeros(0, x.size(0), max(sweep)), None, None))
        bounds = {n: logz_bounds(log_w[..., :n]) for n in sweep}  # n -> (low, high), each (energies, B)
        logz = {name: {n: dict(low=lo[k].cpu(), high=hi[k].cpu()) for n, (lo, hi) in bounds.items()}
                for k, name in enumerate(energies)}
        recs.append(dict(index=s, lm_logp=lm_logp.cpu(), energy={k: v.cpu() for k, v in e_real.items()},
                         logz=logz, **beside_logz(lm, energies, extra_lms, x, P, lm_logp, e_real, samples,
                                                  samples_logp, log_w, args, amp)))
    return columns(gathered(recs, world_size))


def ppl(logp, count):
    """Perplexity exp(-sum(logp) / count) of count tokens (or characters) whose log-probs sum to logp's."""
    return float(np.exp(-logp.sum() / count))


def gain_over(logp, lp, L):
    """The gain of log-probs logp (per prefix) over the base LM's lp in nats per token: mean and SE."""
    gain = (logp - lp) / L
    return dict(gain_nats_per_token=float(gain.mean()), gain_se=float(gain.std(ddof=1) / math.sqrt(len(lp))))


def beside_joint(cols, name, joint_low, joint_high, L, num_tokens, num_chars, enumerated):
    """What joint model `name`'s row reports beside its range: with `enumerated`, its PPL and gain with
    log Z from logz_enumerate's estimate and the share of prefixes whose Eq. 4 range is flagged; the
    gain KL(P_joint || P_LM) predicts, per token (what a moment-matched energy gains); PPL per char."""
    out, lp, e, enum = {}, cols['lm_logp'], cols['energy'][name], cols.get('enum', {}).get(name)
    if enum is not None and enumerated:
        joint = lp - e - enum['estimate']
        g = gain_over(joint, lp, L)
        out.update(ppl_enumerated=ppl(joint, num_tokens), gain_enumerated=g['gain_nats_per_token'],
                   gain_enumerated_se=g['gain_se'], eq4_flagged=float(enum['flagged'].mean()),
                   eq4_ess=float(enum['ess'].mean()), scored_mass=float(enum['mass'].mean()))
    if name in cols.get('kl', {}):
        kl, se = cols['kl'][name] / L, lambda d: float(d.std(ddof=1) / math.sqrt(len(d)))
        out.update(predicted_gain=float(kl.mean()), predicted_gain_se=se(kl),
                   gain_minus_predicted_se=se((joint_low - lp) / L - kl))
    if num_chars:
        out.update(ppl_char_low=ppl(joint_high, num_chars), ppl_char_high=ppl(joint_low, num_chars))
    return out


def summarize(cols, num_tokens, n, num_chars=None, enumerated=True):
    """Table 1's rows from the per-prefix columns: the PPL of the base LM, of the extra LMs and of
    each joint model, log P_LM - E - log Z (Eq. 2), a range from log Z's bounds at n samples (Eq. 4);
    for every model but the base, its gain over it (a joint model's at its high-PPL end); and
    beside_joint's. With logz_enumerate's columns, log Z's low end is the lower of T_n and the
    enumerated estimate, and neither end is below its sure lower bound: no P above 1. (max(T_n, sure)
    alone is biased up where the sure part holds nearly all of Z: it lifts T_n's low draws only.)"""
    lp, L = cols['lm_logp'], num_tokens / len(cols['lm_logp'])
    rows = [dict(model='BASE LM', ppl=ppl(lp, num_tokens))]
    for name, logp in cols['extra_logp'].items():
        rows.append(dict(model=name, ppl=ppl(logp, num_tokens), **gain_over(logp, lp, L)))
    for name, e in cols['energy'].items():
        logz, enum = cols['logz'][name][n], cols.get('enum', {}).get(name)
        sure, estimate = (-np.inf, np.inf) if enum is None else (enum['sure'], enum['estimate'])
        joint_high = lp - e - np.maximum(np.minimum(logz['low'], estimate), sure)  # low log Z: high log P
        joint_low = lp - e - np.maximum(logz['high'], sure)
        rows.append(dict(model=f'JOINT {name}', energy=name, ppl_low=ppl(joint_high, num_tokens),
                         ppl_high=ppl(joint_low, num_tokens), **gain_over(joint_low, lp, L),
                         **beside_joint(cols, name, joint_low, joint_high, L, num_tokens, num_chars,
                                        enumerated)))
    if num_chars:
        rows[0]['ppl_char'] = ppl(lp, num_chars)
    return rows


def count_chars(data, offsets, args, meta):
    """The characters of the real continuations, where tokens are BPE (PPL per character too); else None."""
    if meta['tokenizer'] == 'char':
        return None
    P, L, tok = args.prefix_len, args.gen_len, load_tokenizer(meta)
    return sum(len(tok.decode(data[o + P:o + P + L].tolist())) for o in offsets)


def to_json(cols):
    """The per-prefix columns as lists (what claims.py reads back)."""
    if isinstance(cols, dict):
        return {str(k): to_json(v) for k, v in cols.items()}
    return cols.tolist()


def split_results(cols, rows, args, split, num_prefixes):
    """One split's results: its Table-1 rows, its bounds as n grows (Fig. 2 left) and the per-prefix
    columns."""
    L, num_tokens = args.gen_len, num_prefixes * args.gen_len
    res = dict(split=split, num_samples=args.num_samples, num_prefixes=num_prefixes, num_tokens=num_tokens,
               prefix_len=args.prefix_len, gen_len=L, base_ppl=rows[0]['ppl'], rows=rows,
               per_prefix=to_json(cols))
    joint = [r for r in rows if 'energy' in r]
    if joint:  # the first joint model's range, in one place
        res.update(joint_ppl_low=joint[0]['ppl_low'], joint_ppl_high=joint[0]['ppl_high'])
    if args.sweep:
        res['sweep'] = {n: [r for r in summarize(cols, num_tokens, n, enumerated=False) if 'energy' in r]
                        for n in sorted(set(args.sweep))}
    return res


def table_1(lm, energies, extra_lms, datas, prefixes, params, args, amp, device, rank, world_size, meta):
    """Table 1 on each split of args.splits: per prefix, log P_LM of its real continuation, E and log
    Z's bounds (evaluate_prefixes, Eq. 4); per model, the PPL of the base LM, of the extra LMs and of
    each joint model P_LM exp(-E) / Z (summarize, Eq. 2). Returns ({split: split_results}, the rows,
    each with its split and its model's parameter count), which format_table writes as text."""
    splits, rows = {}, []
    for split in args.splits:
        data, offsets = datas[split], prefixes[split]
        cols = evaluate_prefixes(lm, energies, extra_lms, data, offsets, args, amp, device, rank, world_size,
                                 split)
        split_rows = summarize(cols, len(offsets) * args.gen_len, args.num_samples,
                               count_chars(data, offsets, args, meta))
        splits[split] = split_results(cols, split_rows, args, split, len(offsets))
        rows += [dict(r, split=split, params=params[r['model']]) for r in split_rows]
    return splits, rows


# -----------------------------------------------------------------------------
# calibration: how far the n-sample bounds are from log Z

def calibrate(log_w, log_w_ref, n, L):
    """Bias of the n-sample bounds of Eq. 4, against a reference log Z independent of them: the
    groups' samples log_w (..., B, N) are cut into N // n disjoint groups of n, and the mean of a
    bound over groups estimates its expectation; the reference is Eq. 4's range from the n_ref
    samples log_w_ref (..., B, n_ref) drawn apart (from the groups' own samples the reference
    would be >= every group's lower bound by Jensen, and the lower side could not come out
    negative). Each side against the reference end that is hard to pass: bias_lower = E[lower] -
    ref_lower, bias_upper = E[upper] - ref_upper (ref_lower <= log Z in expectation, ref_upper >= it
    for n_ref large: Theorem 2), per token (/ L), per prefix and averaged over the B prefixes.
    Theorem 2 makes the lower bias negative and, for n large enough, the upper one positive; at small
    n with heavy-tailed weights both are negative. Also: the share of (prefix, group) ranges that
    contain the reference's midpoint, and the reference's own width (it should be << the biases)."""
    N = log_w.size(-1)
    if N // n < 1:
        raise ValueError(f"calibrating n = {n} needs at least {n} samples per prefix, got {N}")
    ref_lo, ref_hi = logz_bounds(log_w_ref)
    ref = (ref_lo + ref_hi) / 2
    lo, hi = logz_bounds(log_w[..., :N // n * n].unflatten(-1, (N // n, n)))  # (..., B, groups)
    covered = (lo <= ref[..., None]) & (ref[..., None] <= hi)
    lower, upper = (lo.mean(-1) - ref_lo) / L, (hi.mean(-1) - ref_hi) / L  # (..., B): per prefix
    return dict(n=n, reference_samples=log_w_ref.size(-1), group_samples=N // n * n,
                bias_lower=lower.mean(-1).tolist(), bias_upper=upper.mean(-1).tolist(),
                bias_lower_per_prefix=lower.tolist(), bias_upper_per_prefix=upper.tolist(),
                bracketed=covered.double().mean((-2, -1)).tolist(),
                reference_width=(ref_hi - ref_lo).abs().mean(-1).tolist())


def calibration_report(lm, energies, data, offsets, args, amp, device, split):
    """calibrate() on an evenly spaced subset of the split's prefixes, for every energy and for
    every power-of-two n up to N / 8 (the default n included), in nats per token: N = calib_samples
    samples per prefix for the groups and as many more, drawn from another stream, for the reference."""
    P, L, B = args.prefix_len, args.gen_len, args.calib_prefixes
    offsets = offsets[np.linspace(0, len(offsets) - 1, min(B, len(offsets))).round().astype(int)]
    log_w = dict(groups=[], reference=[])
    for s in progress(range(0, len(offsets), args.chunk), quiet=args.quiet, desc=f'calibration ({split})'):
        x = window_tokens(data, offsets[s:s + args.chunk], P).to(device)
        for part, stream in (('groups', 'calibration'), ('reference', 'calibration reference')):
            log_w[part].append(sample_log_weights(lm, list(energies.values()), x, L, args.calib_samples, amp,
                                                  rng(args.seed, stream, split, s, device), args.max_rows))
    groups, ref = (torch.cat(log_w[part], dim=1) for part in ('groups', 'reference'))  # (energies, B, N)
    ns = sorted({2 ** k for k in range(1, 20) if 2 ** k <= args.calib_samples // 8} | {args.num_samples})
    per_n = {n: calibrate(groups, ref, n, L) for n in ns}
    return {name: dict(prefixes=len(offsets), reference_samples=args.calib_samples,
                       independent_reference=True,
                       **{k: per_n[args.num_samples][k][i]
                          for k in ('bias_lower', 'bias_upper', 'bracketed', 'reference_width',
                                    'bias_lower_per_prefix', 'bias_upper_per_prefix')},
                       by_n={n: {k: c[k][i] for k in ('bias_lower', 'bias_upper', 'bracketed')}
                             for n, c in per_n.items()})
            for i, name in enumerate(energies)}


# -----------------------------------------------------------------------------
# per-step PPL (Eq. 5, Fig. 1)

class Steps(NamedTuple):
    """per_step's result, for B prefixes and the grid ks of k real continuation tokens fixed."""
    lp: torch.Tensor  # (B, L) log P_LM(x_t | x_<t) of each continuation token
    ks: list  # 0, every, 2 every, ..., L-1, L
    logz_low: torch.Tensor  # (B, len(ks)) Eq. 4's two ends of log Z(x_<=P+k)
    logz_high: torch.Tensor
    seg_lp: torch.Tensor  # (B, segments) log P_LM of each segment, from ks[i] to ks[i+1]
    step_low: torch.Tensor  # (B, segments) Eq. 5's log P_joint of each segment, at its low end
    step_high: torch.Tensor
    diagnostics: dict  # logz_diagnostics' ess and flagged (B, len(ks) - 1) of each sampled log Z


@torch.no_grad()
def per_step(lm, energy, x, P, m, amp, generator, max_rows=256, every=1):
    """Eq. 5 for every row of x (B, P+L): the joint model's log P of each segment of the
    continuation between grid points k1 < k2 (every = 1: of each token),
    log P_LM(segment | x_<=P+k1) + log Z(x_<=P+k2) - log Z(x_<=P+k1), where Z(x_<=P+k) has the
    rest marginalised with m LM samples (Eq. 4's bounds; with all L fixed, Z = exp(-E(x)) exactly)
    for k on the grid 0, every, 2 every, ..., L-1, L. Each Z is computed once: the numerator of a
    step is the denominator of the next. The low end pairs the low numerator with the high
    denominator. A sampled Z's sure lower bound (its diagnostics'): the real rest's own term."""
    B, T = x.shape
    L = T - P
    ks = sorted(set(range(0, L, every)) | {L - 1, L})
    with amp.lm:
        _, lp = lm.sequence_logprob(x, P, per_token=True)  # (B, L)
    lo, hi = torch.empty(B, len(ks), dtype=torch.float64), torch.empty(B, len(ks), dtype=torch.float64)
    neg_e = -score(energy, x, P, amp.energy).cpu()
    diag = []
    for j, k in enumerate(ks[:-1]):
        log_w = sample_log_weights(lm, [energy], x[:, :P + k], L - k, m, amp, generator, max_rows,
                                   prefix_len=P)[0].cpu()  # (B, m)
        lo[:, j], hi[:, j] = logz_bounds(log_w)
        diag.append(logz_diagnostics(log_w, lp[:, k:].double().sum(1).cpu() + neg_e))
    lo[:, -1] = hi[:, -1] = neg_e
    lp = lp.double().cpu()
    seg_lp = torch.stack([lp[:, k1:k2].sum(1) for k1, k2 in zip(ks, ks[1:])], 1)  # (B, segments)
    return Steps(lp, ks, lo, hi, seg_lp, step_low=seg_lp + lo[:, 1:] - hi[:, :-1],
                 step_high=seg_lp + hi[:, 1:] - lo[:, :-1],
                 diagnostics={q: torch.stack([d[q] for d in diag], 1) for q in ('ess', 'flagged')})


def per_step_report(lm, energy, data, offsets, args, amp, device, split):
    """Fig. 1 from per_step (Eq. 5): base and joint PPL per segment of the continuation (between
    consecutive grid points; every = 1: per position), the joint's conservative range and its
    per-prefix gain over the LM (log Z(x_<=t2) - log Z(x_<=t1) at the bounds' midpoint,
    nats/token) with SE over prefixes, and per prefix its range (low: low numerator over high
    denominator; claims.py's C4); the last step exact (the vocabulary enumerated), and estimated
    again from last_step_samples samples. The bounds bracket log Z in expectation (Theorem 2), not
    in every draw: the estimate must lie within a few Monte-Carlo SE (mc_se) of the exact value."""
    P, L = args.prefix_len, args.gen_len
    idx = np.linspace(0, len(offsets) - 1, min(args.step_prefixes, len(offsets))).round().astype(int)
    x = window_tokens(data, offsets[idx], P + L).to(device)  # (B, P+L), evenly spaced prefixes
    g = rng(args.seed, 'per_step', split, 0, device)
    every = getattr(args, 'step_every', 1)
    steps = per_step(lm, energy, x, P, args.step_samples, amp, g, args.max_rows, every)
    lp, ks, lo, hi, seg_lp, step_low, step_high, diag = steps
    width = torch.tensor(np.diff(ks), dtype=torch.float64)  # tokens per segment
    mid = (lo + hi) / 2
    seg_gain = (mid[:, 1:] - mid[:, :-1]) / width  # (B, segments) nats/token over the LM
    gain_low, gain_high = (lo[:, 1:] - hi[:, :-1]) / width, (hi[:, 1:] - lo[:, :-1]) / width  # its range
    exact_logz = last_step_logz(lm, energy, x, P, amp).cpu()
    exact_last = lp[:, -1] + lo[:, -1] - exact_logz
    log_w = sample_log_weights(lm, [energy], x[:, :-1], 1, args.last_step_samples, amp, g, args.max_rows,
                               P)[0]
    z_lo, z_hi = (t.cpu() for t in logz_bounds(log_w))
    last = lambda z: math.exp(-(lp[:, -1] + lo[:, -1] - z).mean().item())
    per_token_ppl = lambda logp: torch.exp(-(logp / width).mean(0)).tolist()
    return dict(num_prefixes=x.size(0), step_samples=args.step_samples,
                last_step_samples=args.last_step_samples,
                last_step_ppl_low=last(z_lo), last_step_ppl_high=last(z_hi),
                # nats/token, of the mean
                last_step_mc_se=mc_se(log_w).pow(2).sum().sqrt().item() / x.size(0),
                position=ks[1:],  # the segment ends (k tokens of the continuation fixed)
                base_ppl=per_token_ppl(seg_lp), joint_ppl_low=per_token_ppl(step_high),
                joint_ppl_high=per_token_ppl(step_low),
                gain=seg_gain.mean(0).tolist(), gain_se=(seg_gain.std(0) / math.sqrt(x.size(0))).tolist(),
                per_prefix_gain=seg_gain.tolist(), per_prefix_gain_low=gain_low.tolist(),
                per_prefix_gain_high=gain_high.tolist(),
                per_prefix_last_step_gain_exact=(lo[:, -1] - exact_logz).tolist(),
                last_step_exact_ppl=math.exp(-exact_last.mean().item()),
                last_step_base_ppl=math.exp(-lp[:, -1].mean().item()),
                # Eq. 4's diagnostics of each sampled log Z (position k: k tokens fixed), over the prefixes
                eq4_flagged=diag['flagged'].double().mean(0).tolist(), eq4_ess=diag['ess'].mean(0).tolist(),
                last_step_eq4_flagged=logz_diagnostics(log_w.cpu(), lp[:, -1].double() + lo[:, -1])['flagged']
                .double().mean().item())


# -----------------------------------------------------------------------------

def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/best.pt', help='the base LM')
    a('--energy', nargs='*', default=[], metavar='NAME=CKPT',
      help='energies of the joint models, e.g. BIT=out/bit/best.pt')
    a('--extra_lm', nargs='*', default=[], metavar='NAME=CKPT',
      help='more LMs to report as rows (BALM, RALM)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--split', dest='splits', default='test', help='the split, or comma-separated splits: val,test')
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='tokens of each prefix')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='tokens of each continuation')
    a('--num_prefixes', dest='max_prefixes', type=int, default=256, at_least=0, at_most='count',
      help='evenly spaced prefixes per split (0: all; else at least 2)')
    a('--num_samples', type=int, default=128, at_least=2, at_most='samples',
      help='n LM samples per prefix for the log Z bounds')
    a('--ns', dest='sweep', type=comma_ints, default='', at_least=2, at_most='samples',
      help='comma-separated n values for the bounds as n grows (Fig. 2 left; default: none)')
    a('--per_step', nargs='?', const='', default=None, metavar='NAME',
      help='per-step PPL (Eq. 5, Fig. 1) on the last split, of energy NAME (default: the first)')
    a('--step_prefixes', type=int, default=8, at_least=1, at_most='count',
      help='prefixes of Fig. 1 (evenly spaced over the split)')
    a('--step_every', type=int, default=1, at_least=1, at_most='tokens',
      help='Fig. 1: log Z every this many positions (and at the last two)')
    a('--step_samples', type=int, default=16, at_least=2, at_most='samples',
      help='m LM samples per position for Eq. 5 (the bounds need leave-one-out: at least 2)')
    a('--last_step_samples', type=int, default=1024, at_least=1, at_most='samples',
      help='LM samples for the last step estimated again, beside the exact value (--per_step: at least 2)')
    a('--calib_prefixes', type=int, default=16, at_least=0, at_most='count',
      help='prefixes of the last split on which the n-sample bounds are calibrated (0: off)')
    a('--calib_samples', type=int, default=2048, at_least=2, at_most='samples',
      help='LM samples per prefix of the calibration reference (n_ref), and as many more for its groups')
    a('--chunk', type=int, default=16, at_least=1, at_most='count', help='prefixes per batch')
    a('--max_rows', type=int, default=512, at_least=1, at_most='count',
      help='sequences per forward (bounds memory)')
    a('--beam', type=int, default=0, at_least=0, at_most='beam',
      help="the LM's most likely continuations (beam search of this width) scored exactly in log Z "
           "(energy.logz_enumerate), beside the real one; worth it where the LM is peaked (addition)")
    a('--out', default='out/ppl.json',
      help='JSON results (figures.py draws Fig. 1 and Fig. 2 left from them)')
    common_flags(p, 'force', 'device', 'deterministic', 'dtype', 'seed', 'quiet', help=dict(
        force='replace --out (and the .txt beside it) if it exists',
        dtype='autocast dtype of sampling and of scoring (auto: from the hardware and the widths)'))
    return p.parse_args(argv)


def load_models(args, device):
    """The base LM, its data, the energies and the extra LMs named on the command line, checked
    to belong together and to fit prefix_len + gen_len."""
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    energies = {name: load_any_energy(path, args.lm, device)[0] for name, path in map(name_path, args.energy)}
    share_energies(energies)
    extra = {name: load_lm(path, device, meta=meta)[0] for name, path in map(name_path, args.extra_lm)}
    guards.check_per_step_name(args.per_step, energies)
    check_fits(args.prefix_len + args.gen_len, {'LM': lm, **{f'energy {n}': m for n, m in energies.items()},
                                                **{f'LM {n}': m for n, m in extra.items()}})
    return lm, meta, data_dir, energies, extra


def name_path(spec):
    """'BIT=out/bit/best.pt' -> ('BIT', 'out/bit/best.pt')"""
    return tuple(spec.split('=', 1))


def format_table(rows, splits):
    """Table 1 as text: PPL per split (a range for joint models), then, on the last split, the
    gain over the base LM in nats per token (conservative end, +- SE) and the PPL reduction."""
    last = splits[-1]
    head = f"{'model':<17} {'params':>8} " + ' '.join(f"{s + ' PPL':>13}" for s in splits)
    lines = [head + f" {last + ' gain nats/tok (SE)':>26} {last + ' PPL reduction':>19}"]
    base = next(r['ppl'] for r in rows if r['model'] == 'BASE LM' and r['split'] == last)
    for name in dict.fromkeys(r['model'] for r in rows):
        cells = {r['split']: r for r in rows if r['model'] == name}
        fmt = lambda r: f"{r['ppl']:.3f}" if 'ppl' in r else f"{r['ppl_low']:.3f}-{r['ppl_high']:.3f}"
        line = f"{name:<17} {next(iter(cells.values()))['params'] / 1e6:>7.2f}M " + \
            ' '.join(f"{fmt(cells[s]) if s in cells else '':>13}" for s in splits)
        r = cells.get(last, {})
        if 'gain_se' in r:
            z = r['gain_nats_per_token'] / r['gain_se'] if r['gain_se'] > 0 else float('nan')
            line += f" {r['gain_nats_per_token']:>+11.5f} ({r['gain_se']:.5f}, {z:>4.1f} SE)"
            line += f" {100 * (1 - r.get('ppl', r.get('ppl_high', base)) / base):>18.2f}%"
        lines.append(line)
    return '\n'.join(lines)


def format_enumerated(rows):
    """One line per joint model and split: its PPL with log Z from logz_enumerate (an estimate, beside
    Eq. 4's range) and how often that range is flagged; a flagged range is not a pair of bounds."""
    return ''.join(f"\n{r['model']} ({r['split']}): PPL {r['ppl_enumerated']:.4f} with log Z enumerated "
                   f"(an estimate: every distinct continuation seen scored exactly, "
                   f"{100 * r['scored_mass']:.1f}% of the LM's mass; gain {r['gain_enumerated']:+.5f} "
                   f"({r['gain_enumerated_se']:.5f})); Eq. 4's range flagged on "
                   f"{100 * r['eq4_flagged']:.1f}% of prefixes (mean ESS {r['eq4_ess']:.1f})"
                   + (': not bounds there' if r['eq4_flagged'] > 0 else '')
                   for r in rows if 'ppl_enumerated' in r)


def format_calibration(calib, num_samples, gains):
    """One line per energy: the bias of each bound at the default n, against the reference."""
    lines = []
    for name, c in calib.items():
        se = gains.get(name)
        lines.append(f"calibration {name}: n = {num_samples} vs an independent n_ref = "
                     f"{c['reference_samples']} "
                     f"on {c['prefixes']} prefixes: bias of the lower bound {c['bias_lower']:+.5f}, "
                     f"upper {c['bias_upper']:+.5f} nats/token"
                     + (f" (gain SE {se:.5f})" if se else '')
                     + f"; range contains log Z for {100 * c['bracketed']:.0f}% "
                     f"(reference width {c['reference_width']:.4f} nats)")
    return '\n'.join(lines)


def format_predicted(rows):
    """Each joint model's measured gain beside KL(P_joint || P_LM), which equals it (the
    Pythagorean identity) when the energy matches real text's moments (metrics.py)."""
    return ''.join(f"\n{r['model']}: gain {r['gain_nats_per_token']:+.5f} nats/token, KL(joint || LM) "
                   f"{r['predicted_gain']:.5f} (SE {r['predicted_gain_se']:.5f}): difference "
                   f"{r['gain_nats_per_token'] - r['predicted_gain']:+.5f} "
                   f"(SE {r['gain_minus_predicted_se']:.5f})"
                   for r in rows if 'predicted_gain' in r)


def format_last_step(ps):
    """The per-step check in one line: the last step's estimate against its exact value."""
    if not ps:
        return ''
    gap = math.log(math.sqrt(ps['last_step_ppl_low'] * ps['last_step_ppl_high']) / ps['last_step_exact_ppl'])
    se = ps['last_step_mc_se']  # 0 when every weight is equal (E constant): the estimate is exact
    return (f"\nlast step ({ps['energy']}, {ps['num_prefixes']} prefixes): "
            f"exact PPL {ps['last_step_exact_ppl']:.4f}, "
            f"estimated {ps['last_step_ppl_low']:.4f}-{ps['last_step_ppl_high']:.4f} "
            f"from {ps['last_step_samples']} samples: off by {gap:+.5f} nats/token"
            + (f", {abs(gap) / se:.1f} Monte-Carlo SE ({se:.5f})" if se > 0 else '')
            + f"; Eq. 4 flagged on {100 * np.mean(ps['eq4_flagged']):.1f}% of the per-step log Z's")


def main(argv=None):
    args = guards.check_ppl_flags(get_args(argv), SPLITS)  # every flag, and the memory its sizes need
    rank, world_size, device = setup(args.device, args.deterministic)
    lm, meta, data_dir, energies, extra_lms = load_models(args, device)
    P, L = args.prefix_len, args.gen_len
    dtype, on_lm = precision(device, args.dtype, 'sample', rank == 0, lm.config.n_embd)
    width = max([e.config.n_embd for e in energies.values()], default=None)
    edtype, on_energy = (precision(device, args.dtype, 'score', rank == 0, width) if energies
                         else (dtype, on_lm))
    amp = Precision(lm=on_lm, energy=on_energy)
    params = {'BASE LM': lm.num_params(), **{name: m.num_params() for name, m in extra_lms.items()},
              **{f'JOINT {name}': lm.num_params() + e.num_params() for name, e in energies.items()}}
    hashes = {'BASE LM': file_hash(args.lm),
              **{name: file_hash(path) for name, path in map(name_path, args.energy + args.extra_lm)}}
    out = dict(hashes=hashes, dtype=dict(sample=dtype, score=edtype), splits={}, rows=[])
    datas = {split: load_split(data_dir, split, meta) for split in args.splits}
    prefixes = {split: windows(datas[split], P, L, max_windows=args.max_prefixes or None)
                for split in args.splits}
    guards.check_ppl_prefixes(prefixes, P + L, args.out, len(params))  # 2 windows each, and the disk
    out['splits'], out['rows'] = table_1(lm, energies, extra_lms, datas, prefixes, params, args, amp, device,
                                         rank, world_size, meta)
    last = args.splits[-1]
    data, offsets, res = datas[last], prefixes[last], out['splits'][last]
    if rank == 0 and energies:  # one split is enough
        if args.per_step is not None:
            name = args.per_step or next(iter(energies))
            report = per_step_report(lm, energies[name], data, offsets, args, amp, device, last)
            res['per_step'] = dict(report, energy=name)
        if args.calib_prefixes:
            res['calibration'] = calibration_report(lm, energies, data, offsets, args, amp, device, last)
    if rank == 0:
        write_results(out, args)
    teardown_distributed()
    return out


def write_results(out, args):
    """ppl.json, and the table with its calibration and last-step lines as ppl.txt (printed too)."""
    last = out['splits'][args.splits[-1]]
    gain_se = {r['energy']: r['gain_se'] for r in last['rows'] if 'energy' in r}
    text = (format_table(out['rows'], args.splits) + '\n'
            + f"joint PPL as a range from {args.num_samples} LM samples per prefix (Eq. 4)"
            + format_enumerated(out['rows']) + '\n'
            + format_calibration(last.get('calibration', {}), args.num_samples, gain_se)
            + format_last_step(last.get('per_step')) + format_predicted(last['rows']))
    write_json(out, args.out)
    write_text(text + '\n', os.path.splitext(args.out)[0] + '.txt')
    print(text + f"\n-> {args.out}")


if __name__ == '__main__':
    run_main(main)

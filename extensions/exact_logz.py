"""
Exact Z on a task small enough to enumerate: addition with N = 2 digits
(data/addition/prepare.py --digits 2), where a continuation is the 3 sum digits and the end of
text, L = 4 tokens over a 13-token vocabulary: all V^L = 28,561 continuations of a prompt are
scored (N = 3, a sharp energy: 13^5 = 371,293). That is every continuation the LM can emit:
sampling draws L untruncated tokens. Both models walk the trie of continuations with their KV
cache (trie_states): each prefix runs once.

Per prompt (evenly spaced problems of --split, and of --select_split for the threshold):
- exact log P_LM of every continuation (the sum of its tokens' log-probs, each next-token
  distribution normalised in float64: they sum to 1, checked within 1e-6), its energy E (float32
  forward, --dtype), hence the exact log Z = log sum_x P_LM(x) exp(-E(x)) (Eq. 2 of Deng et al.),
  the exact joint log-likelihood of the real continuation, log P_LM - E - log Z, and the exact
  joint probability of the correct sum (the real continuation: the sum, then the end of text);
- for each n of --ns, --reps replicates of n exact LM samples, drawn by index from the enumerated
  categorical P_LM (no model calls): Eq. 4's range (T_n, upper: energy.logz_bounds) and
  energy.logz_enumerate with known = {real continuation} + the LM's beam (--beam), both against
  the exact log Z: bias, spread (the sd over replicates, averaged over prompts), mean |error|,
  the share of (prompt, replicate) within --tol nats, and Eq. 4's coverage (T_n <= log Z <= upper);
- the job's estimator (logz_enumerate at --job_n samples) at each beam width of --widths, and the
  width chosen for the job on --select_split: the narrowest within --tol on --beam_target;
- MIN_ESS: for each candidate threshold, the coverage of the Eq. 4 ranges that logz_diagnostics
  (logz_sure = logz_enumerate's sure lower bound) leaves unflagged. The rule, on --select_split:
  the smallest candidate at which, at every n, the unflagged ranges contain the exact log Z at
  >= --target (an n where every range is flagged meets it: nothing unflagged is called bounds);
  where no candidate does, the one whose worst n is best. Reported on --split.

logz_enumerate over 200 prompts x 200 replicates x 1,024 samples is too slow for its (m x m)
comparison, so the replicates use estimate_fast: the same formula on enumeration indices (sorted
runs instead of pairwise ids), checked equal to logz_enumerate on the first replicates of every n.

    python -m extensions.exact_logz --lm /work/out-enum/lm/best.pt --energy /work/out-enum/unit/best.pt \\
        --out assets/exact_logz.json --plot assets/figures/fig_exact_logz.png
"""

import math
import os
import sys
import time
from contextlib import nullcontext

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.exact_logz")
import numpy as np
import torch

from data import load_lm_and_data, load_split, problem_windows, window_tokens, windows
from energy import (kish_ess, load_any_energy, logz_bounds, logz_diagnostics, logz_enumerate,
                    score_continuations)
from model import GPT, KVCache
from plumbing import (ArgumentParser, atomic_write, check_new, check_writable, comma_ints, common_flags,
                      file_hash, rng, run_main, setup, write_json)

# The models it was run on (docs/exact_logz.md): ADDITION's recipe (job/configs.py) on N = 2 with budgets
# scaled to 1,700 training problems (each stage ~100x less data than N = 6): the LM's shape and lrs,
# evaluated every 100 steps instead of 500 (one epoch is 8 LM steps), capped at 2,000; the UNIT from the
# LM's weights by ranking NCE over 16 LM samples, best.pt by the held-out gain on all 200 selection
# problems (64 samples each), capped at 1,500 steps; no MLM/BIT (a BIT shares no prefix: enumeration
# would cost 6x more).
RECIPE = [
    'python -m data.addition.prepare --digits 2 --train 1700 --select 200 --val 200 --test 400 '
    '--out_dir {o}/data',
    'python train_lm.py --data_dir {o}/data --out_dir {o}/lm --objective lm --n_layer 3 --n_head 3 '
    '--n_embd 96 --block_size 66 --batch_size 32 --max_iters 2000 --lr 3e-3 --min_lr 3e-4 --warmup_iters 40 '
    "--eval_interval 100 --patience 2 --min_rel_delta 0.001 --snapshots ''",
    'python negatives.py --lm {o}/lm/best.pt --split train --out_dir {o}/neg_train --num_samples 16 '
    '--prefix_len 6 --gen_len 4',
    'python negatives.py --lm {o}/lm/best.pt --split select --out_dir {o}/neg_select --num_prefixes 200 '
    '--num_samples 64 --prefix_len 6 --gen_len 4',
    'python nce_train.py --lm {o}/lm/best.pt --negatives {o}/neg_train --held_out_negatives {o}/neg_select '
    '--body unit --init_from {o}/lm/best.pt --out_dir {o}/unit --batch_size 32 --max_iters 1500 --lr 2e-4 '
    '--min_lr 2e-5 --warmup_iters 50 --eval_interval 100 --eval_prefixes 200 --patience 4',
]  # each with --seed 0 --device cpu --dtype bfloat16 (the job's); then this script with OMP_NUM_THREADS=1

# A sharp energy (docs/exact_logz.md, "A sharp energy: N = 3"): 13^5 = 371,293 continuations per prompt.
# The LM stopped at step 1,000 of a 2,000-step run (its snapshot: P_LM(correct) 0.40 on the selection
# split, where best.pt has 0.89), so that most of its samples are wrong and the energy, trained longer and
# at a higher lr than on N = 2, has much to correct: the 6-digit job's regime (P_LM 0.63, joint ~0.99)
RECIPE_SHARP = [
    'python -m data.addition.prepare --digits 3 --train_problems 50000 --select_problems 500 '
    '--val_problems 500 --test_problems 1000 --out_dir {o}/data',
    'python train_lm.py --data_dir {o}/data --out_dir {o}/lm --objective lm --n_layer 3 --n_head 3 '
    '--n_embd 96 --block_size 65 --batch_size 32 --max_iters 2000 --lr 3e-3 --min_lr 3e-4 --warmup_iters 40 '
    "--eval_interval 250 --patience 0 --min_rel_delta 0.01 --select_on continuation "
    "--snapshots '500,1000,1500'",
    'mkdir -p {o}/lm1000 && cp {o}/lm/iter_1000.pt {o}/lm1000/best.pt',
    'python negatives.py --lm {o}/lm1000/best.pt --split train --out_dir {o}/neg1000_train --num_samples 16 '
    '--prefix_len 8 --gen_len 5',
    'python negatives.py --lm {o}/lm1000/best.pt --split select --out_dir {o}/neg1000_select '
    '--num_prefixes 500 --num_samples 64 --prefix_len 8 --gen_len 5',
    'python nce_train.py --lm {o}/lm1000/best.pt --negatives {o}/neg1000_train --held_out_negatives '
    '{o}/neg1000_select --body unit --init_from {o}/lm1000/best.pt --out_dir {o}/unit1000 --batch_size 32 '
    '--max_iters 6000 --lr 5e-4 --min_lr 5e-5 --warmup_iters 50 --eval_interval 500 --eval_prefixes 500 '
    '--patience 4',
]  # each with --seed 0 --device cpu --dtype bfloat16; then this script (docs/exact_logz.md has its flags)

MAX_CONTINUATIONS = 2 ** 20  # V^L above this is not enumerated (N = 2 addition: 28,561)
THRESHOLDS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def all_continuations(V, L):
    """Every continuation (V^L, L) int64, row-major: row i is i written in base V, most significant
    token first (itertools.product's order), so row s * V + v extends row s of all_continuations(V, L-1)."""
    i = torch.arange(V ** L)
    return torch.stack([(i // V ** (L - 1 - t)) % V for t in range(L)], 1)


def index_of(x, V):
    """Continuations x (..., L) -> their rows in all_continuations (...), int64."""
    L = x.size(-1)
    return (x.long() * (V ** torch.arange(L - 1, -1, -1, device=x.device))).sum(-1)


def expand(cache, V):
    """Each row's (k, v) of every layer copied to V consecutive rows: its V children's caches."""
    return [(k.repeat_interleave(V, 0), v.repeat_interleave(V, 0)) for k, v in cache]


@torch.no_grad()
def trie_states(body, prompt, L, V, rows=4096):
    """The final hidden states of a causal GPT body on every continuation of one prompt (P,), walked
    as a trie, level by level: yields (0, the prompt's states (P, C)), then (t, h) for t = 1..L, h
    (V^t, C) the states at the t-th continuation token, row i the continuation i of
    all_continuations(V, t). Each prefix runs once, its K/V cached and copied to its V children:
    about V^(L-1) V / (V - 1) one-token steps, where whole sequences cost V^(L-1) (P + L - 1)
    tokens (N = 3 addition: 11x fewer). The last level, `rows` parents at a time, attends to its
    parents' caches shared, not copied (KVCache's prompt sharing, groups of V rows)."""
    P, S = prompt.numel(), prompt.numel() + L - 1
    cache = body.new_cache(1, S)
    yield 0, body.hidden(prompt[None], cache)[0]
    if L == 0:
        return
    children = lambda n: torch.arange(V, device=prompt.device).repeat(n)[:, None]  # row r V + v
    n = 1
    for t in range(1, L):
        cache = expand(cache, V)
        yield t, body.hidden(children(n), cache, pos=P + t - 1)[:, -1]
        n *= V
    last = []
    for c in range(0, n, rows):
        parents = [(k[c:c + rows], v[c:c + rows]) for k, v in cache]
        m = parents[0][0].size(0)
        kv = [KVCache(k, v, *p) for (k, v), p in zip(body.new_cache(m * V, 1), parents)]
        last.append(body.hidden(children(m), kv, pos=S)[:, -1])
    yield L, torch.cat(last)


@torch.no_grad()
def lm_logprobs(lm, prompts, L, V, rows=4096):
    """log P_LM (B, V^L) in float64 of every continuation of each prompt (B, P), from the trie's
    states (trie_states: each prefix run once), each next-token distribution normalised in float64
    (so the V^L probabilities sum to 1 up to float64 rounding)."""
    if type(lm) is not GPT:
        raise ValueError(f"--lm: the enumeration walks a plain GPT's cache, not a {type(lm).__name__}")
    out = []
    for p in prompts:
        log_p = torch.zeros(1, dtype=torch.float64, device=p.device)
        for t, h in trie_states(lm, p, L - 1, V, rows):
            logits = lm.lm_head(h[-1:] if t == 0 else h)  # (V^t, V): the next token's
            log_p = (log_p[:, None] + torch.log_softmax(logits.double(), -1)).reshape(-1)  # row r V + v
        out.append(log_p)
    return torch.stack(out)


@torch.no_grad()
def energies(energy, prompts, P, L, V, ctx, rows=4096):
    """E (B, V^L) in float64 of every continuation of each prompt (B, P), for a causal energy (UNIT):
    the trie's states (trie_states), summed along each path, then pooled and projected as
    Energy.forward pools them (its mean over the pooled positions)."""
    if not getattr(energy, 'config', None) or not energy.config.causal or energy.context_cut(P):
        raise ValueError("--energy: enumeration walks the continuations' prefixes, which needs a causal "
                         "energy that sees the whole prompt (a UNIT, nce_train.py --body unit)")
    pooled_from = P if energy.pool == 'continuation' else 0
    out = []
    for p in prompts:
        with ctx:
            for t, h in trie_states(energy.body, p, L, V, rows):
                h = h.float()
                total = h[pooled_from:].sum(0, keepdim=True) if t == 0 else total.repeat_interleave(V, 0) + h
        out.append(energy.project(total / (P - pooled_from + L)).double())
    return torch.stack(out)


def exact_values(log_p, E, real):
    """Exact per-prompt values from log P_LM and E (B, C) of all C continuations and the real one's
    row (B,): log Z (Eq. 2's normaliser), the LM's and the joint model's log-likelihood of the
    real continuation, and whether each model's mode is the real continuation."""
    lpw = log_p - E
    log_z = lpw.logsumexp(-1)
    pick = lambda t: t.gather(1, real[:, None]).squeeze(1)
    return dict(log_z=log_z, lm_logp=pick(log_p), energy=pick(E), joint_ll=pick(lpw) - log_z,
                lm_mode_correct=log_p.argmax(-1) == real, joint_mode_correct=lpw.argmax(-1) == real,
                lm_mass_error=log_p.logsumexp(-1).exp() - 1)


def sample_indices(probs_cdf, count, generator):
    """count exact draws (B, count) from the categorical with cumulative probabilities (B, C),
    float64, by inverse CDF: index i with cdf[i-1] <= u < cdf[i]."""
    B, C = probs_cdf.shape
    u = torch.rand(B, count, dtype=torch.float64, generator=generator) * probs_cdf[:, -1:]
    return torch.searchsorted(probs_cdf, u, right=True).clamp(max=C - 1)


def estimate_fast(idx, lpw, lw, log1m_p, known):
    """logz_enumerate's (sure, estimate) for samples given as rows idx (B, R, n) of the enumeration:
    lpw = log P_LM - E, lw = -E, log1m_p = log(1 - P_LM) (B, C) per row, known (B, C) bool, the known
    set. A = sum over the distinct rows of known and samples of P_LM w; Z_hat = A + (1/n) sum over
    samples drawn once and not known of w (1 - P_LM). Returns float64 (B, R) each."""
    B, R, n = idx.shape
    s = idx.sort(-1).values
    new = s[..., 1:] != s[..., :-1]
    ones = torch.ones(B, R, 1, dtype=torch.bool)
    first, last = torch.cat([ones, new], -1), torch.cat([new, ones], -1)
    take = lambda t: t.gather(1, s.view(B, -1)).view(B, R, n)
    out_known = ~take(known)
    ninf = torch.tensor(float('-inf'), dtype=torch.float64)
    log_known = torch.where(known, lpw, ninf).logsumexp(-1)[:, None]  # (B, 1)
    log_a = torch.logaddexp(log_known, torch.where(first & out_known, take(lpw), ninf).logsumexp(-1))
    rest = torch.where(first & last & out_known, take(lw) + take(log1m_p), ninf).logsumexp(-1) - math.log(n)
    return log_a, torch.logaddexp(log_a, rest)


def check_fast(idx, cont, log_p, E, known_rows):
    """estimate_fast against energy.logz_enumerate on replicates idx (B, r, n): the largest
    difference of (sure, estimate), which must be float64 rounding."""
    B, r, n = idx.shape
    k = known_rows.size(1)
    rows = torch.cat([known_rows[:, None].expand(-1, r, -1), idx], -1).reshape(B * r, k + n)
    lp, lw = log_p.repeat_interleave(r, 0), (-E).repeat_interleave(r, 0)
    x, lp, lw = cont[rows], lp.gather(1, rows), lw.gather(1, rows)
    ref = logz_enumerate(x, lp, lw, known=k)
    known = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, known_rows, True)
    sure, est = estimate_fast(idx, log_p - E, -E, torch.log1p(-log_p.exp().clamp(max=1.0)), known)
    diff = lambda a, b: (a.view(B, r) - b).abs().max().item()
    return max(diff(ref['sure'], sure), diff(ref['estimate'], est))


def replicate_errors(log_p, E, log_z, known_rows, cont, ns, reps, seed, split, slack=0.01, chunk=2 ** 22,
                     check=16):
    """For each n: per (prompt, replicate) Eq. 4's T_n and upper end, logz_enumerate's sure bound
    and estimate (minus the exact log Z), Kish's ESS and logz_diagnostics' sure-bound flag (the range's
    upper end below logz_enumerate's sure bound). cont: all_continuations; estimate_fast is checked
    against logz_enumerate on 2 more replicates of the first `check` prompts.
    Returns {n: {name: (B, R) float64 or bool}}."""
    B, C = log_p.shape
    cdf = log_p.exp().cumsum(-1)
    lpw, lw, log1m_p = log_p - E, -E, torch.log1p(-log_p.exp().clamp(max=1.0))
    known = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, known_rows, True)
    out = {}
    for n in ns:
        g = rng(seed, 'exact logz replicates', split, n)
        parts = []
        step = max(1, chunk // (B * n))
        for r0 in range(0, reps, step):
            r = min(step, reps - r0)
            idx = sample_indices(cdf, r * n, g).view(B, r, n)
            w = lw.gather(1, idx.view(B, -1)).view(B, r, n)
            T_n, upper = logz_bounds(w)
            sure, est = estimate_fast(idx, lpw, lw, log1m_p, known)
            diag = logz_diagnostics(w, sure, min_ess=0.0)  # min_ess 0: only the sure-bound test flags
            parts.append(dict(T_n=T_n, upper=upper, sure=sure, estimate=est, ess=kish_ess(w),
                              sure_flag=diag['flagged']))
        res = {k: torch.cat([p[k] for p in parts], 1) for k in parts[0]}
        for k in ('T_n', 'upper', 'sure', 'estimate'):
            res[k] = res[k] - log_z[:, None]  # errors against the exact log Z
        res['covered'] = (res['T_n'] <= 0) & (res['upper'] >= 0)
        res['near'] = (res['T_n'] <= slack) & (res['upper'] >= -slack)  # within slack nats of the range
        c = slice(0, check)
        res['fast_vs_logz_enumerate'] = check_fast(sample_indices(cdf[c], 2 * n, g).view(-1, 2, n), cont,
                                                   log_p[c], E[c], known_rows[c])
        out[n] = res
    return out


def error_table(reps, tol):
    """Per n, per estimator: bias (mean error over prompts and replicates), spread (sd over
    replicates, averaged over prompts), mean |error|, RMSE and the share within tol nats; Eq. 4's
    coverage; the sure bound's mean gap."""
    rows = []
    for n, r in reps.items():
        row = dict(n=n, eq4_coverage=r['covered'].double().mean().item(),
                   eq4_coverage_slack=r['near'].double().mean().item())
        for k in ('T_n', 'upper', 'estimate', 'sure'):
            e = r[k]
            row[k] = dict(bias=e.mean().item(), spread=e.std(1).mean().item(), mean_abs=e.abs().mean().item(),
                          rmse=e.pow(2).mean().sqrt().item(),
                          within_tol=(e.abs() <= tol).double().mean().item(),
                          prompts_within_tol_median=(e.abs().median(1).values <= tol).double().mean().item())
        row['ess_median'] = r['ess'].median().item()
        row['sure_flag_share'] = r['sure_flag'].double().mean().item()
        row['fast_vs_logz_enumerate'] = r['fast_vs_logz_enumerate']
        rows.append(row)
    return rows


def threshold_curve(reps, thresholds):
    """For each candidate MIN_ESS and n: the share of Eq. 4's ranges that logz_diagnostics flags
    (ESS < threshold, or the upper end below the sure bound) and the coverage of the unflagged."""
    curve = []
    for t in thresholds:
        per_n = []
        for n, r in reps.items():
            flagged = (r['ess'] < t) | r['sure_flag']
            kept = ~flagged
            cov = lambda c: c[kept].double().mean().item() if kept.any() else None
            per_n.append(dict(n=n, flagged=flagged.double().mean().item(), unflagged=int(kept.sum()),
                              coverage_unflagged=cov(r['covered']), coverage_slack_unflagged=cov(r['near'])))
        curve.append(dict(min_ess=t, per_n=per_n))
    return curve


def choose_threshold(curve, target, key='coverage_slack_unflagged'):
    """The rule: the smallest threshold whose unflagged ranges contain the exact log Z (within the
    slack, by default) at >= target at every n (an n with none unflagged meets it); else the one
    whose worst n is best. Returns (threshold, met)."""
    worst = lambda c: min((p[key] for p in c['per_n'] if p[key] is not None), default=1.0)
    for c in curve:
        if worst(c) >= target:
            return c['min_ess'], True
    return max(curve, key=worst)['min_ess'], False


def beam_curve(lm, prompts, real, log_p, E, log_z, cont, widths, n, reps, seed, split, tol):
    """The job's estimator (logz_enumerate: the real continuation and the LM's beam known, n samples) at
    each beam width: the share of (prompt, replicate) within tol nats of the exact log Z, the share of
    prompts whose median replicate is, and the biases of its estimate and of its sure part."""
    L, V = cont.size(1), int(cont.max()) + 1
    rows = []
    for w in widths:
        known = torch.cat([real[:, None], index_of(lm.beam_search(prompts, L, w)[0], V)], 1)
        r = replicate_errors(log_p, E, log_z, known, cont, [n], reps, seed, split)[n]
        e = r['estimate']
        rows.append(dict(beam=w, n=n, within_tol=(e.abs() <= tol).double().mean().item(),
                         prompts_within_tol_median=(e.abs().median(1).values <= tol).double().mean().item(),
                         estimate_bias=e.mean().item(), sure_bias=r['sure'].mean().item(),
                         worst_prompt_median_error=e.abs().median(1).values.max().item()))
    return rows


def choose_beam(rows, target):
    """The narrowest width whose estimates are within tol on >= target of (prompt, replicate); else
    the one that comes closest. Returns (width, met)."""
    for r in sorted(rows, key=lambda r: r['beam']):
        if r['within_tol'] >= target:
            return r['beam'], True
    return max(rows, key=lambda r: r['within_tol'])['beam'], False


def beam_choice(res, args):
    """choose_beam on --select_split's beam_curve, with its rule and the chosen width's row on --split."""
    width, met = choose_beam(res[args.select_split]['beam_curve'], args.beam_target)
    rule = (f"the narrowest of {args.widths} whose logz_enumerate estimate (n = {args.job_n}) is within "
            f"{args.tol:g} nats of the exact log Z on >= {args.beam_target:g} of {args.select_split}'s "
            f"replicates" + ('' if met else ' (none met it: the closest)'))
    return dict(chosen=width, rule_met=met, n=args.job_n, rule=rule,
                on_split=next(r for r in res[args.split]['beam_curve'] if r['beam'] == width))


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', required=True, help='the base LM (train_lm.py best.pt)')
    a('--energy', required=True, help="the joint model's energy (nce_train.py best.pt)")
    a('--data_dir', default=None, help='default: the data the LM was trained on')
    a('--split', default='test', help='the split reported')
    a('--select_split', default='select', help='the split that chooses MIN_ESS')
    a('--num_prefixes', dest='prompts', type=int, default=200, at_least=1, at_most='count',
      help='problems of --split (evenly spaced)')
    a('--select_prefixes', dest='select_prompts', type=int, default=200, at_least=1, at_most='count',
      help='problems of --select_split')
    a('--ns', type=comma_ints, default='8,16,32,64,128,256,512,1024', at_least=2, at_most='samples',
      help='comma-separated LM samples per log Z estimate (Eq. 4 needs at least 2)')
    a('--reps', type=int, default=200, at_least=1, at_most='samples',
      help='replicates of n samples per prompt')
    a('--beam', type=int, default=32, at_least=1, at_most='beam',
      help="the LM's beam width: logz_enumerate's known set beside the real one (32: the narrowest of 8, "
           "32, 128 within 0.01 nats on 95%% of the selection split's replicates at n = 64)")
    a('--widths', type=comma_ints, default='8,32,128', at_least=1, at_most='beam',
      help="beam widths tried for the job's estimator at --job_n samples, the narrowest within --tol on "
           "--beam_target of --select_split's replicates chosen")
    a('--job_n', type=int, default=64, at_least=1, at_most='samples',
      help="the job's LM samples per log Z (extensions/addition_eval: max of its --ns)")
    a('--beam_target', type=float, default=0.95, at_least=0, at_most=1,
      help='the share of replicates within --tol that a beam width must reach, in [0, 1]')
    a('--tol', type=float, default=0.01, at_least=0, at_most=None,
      help='nats: an estimate within this of the exact log Z')
    a('--target', type=float, default=0.9, at_least=0, at_most=1,
      help="MIN_ESS's rule: the unflagged ranges' coverage, in [0, 1]")
    a('--slack', type=float, default=0.01, at_least=0, at_most=None,
      help="MIN_ESS's rule: a range 'contains' log Z within this many nats of either end")
    a('--energy_scale', type=float, default=1.0, at_least=0, at_most=None,
      help="the energy studied is this times --energy's (a sharper one above 1: more of Z where the LM "
           "puts little; the enumeration's cache is the same)")
    a('--dtype', default='float32', choices=('float32', 'bfloat16'), help="the energy's forward")
    a('--cache', default=None, path=True,
      help='a folder for the enumerated log P_LM and E (saved every 20 problems): a rerun resumes')
    a('--out', required=True, help='JSON results')
    a('--plot', default=None, help='a PNG: error and coverage against n (needs matplotlib)')
    common_flags(p, 'force', 'device', 'seed', 'quiet',
                 help=dict(force='replace --out and --plot', quiet='no progress and no table'))
    args = p.parse_args(argv)
    if not args.ns:  # each within the declared bounds
        raise ValueError("--ns '': give comma-separated integers, e.g. 8,64,1024")
    for f, path in (('--out', args.out), ('--plot', args.plot)):
        if path is not None:
            check_writable(path, f, folder=False)
            check_new(path, f, args.force)
    if args.cache:  # created at its first save (cached), once the models have loaded
        check_writable(args.cache, '--cache')
    return args


def enumerate_split(lm, energy, data, P, L, V, count, ctx, beam, log, cache=None, key='', chunk=20):
    """Exact log P_LM and E (B, V^L) of every continuation of `count` evenly spaced problems, the
    problems' rows, the real continuation's row and the known set's rows (real + the LM's beam).
    With a cache folder, each `chunk` of problems is saved there once enumerated, and reused by a
    rerun whose key (models' hashes, split, count, dtype) is the same; the LM's beam is saved apart,
    by its width, so that another --beam reuses the scored continuations."""
    x = window_tokens(data, windows(data, P, L, max_windows=count), P + L)
    prompts, real = x[:, :P], index_of(x[:, P:], V)
    cont = all_continuations(V, L)
    parts, times = [], dict(lm_s=0.0, energy_s=0.0)
    for c0 in range(0, len(x), chunk):
        pr = prompts[c0:c0 + chunk]
        part = cached(cache and os.path.join(cache, f'{key}_{c0}.pt'),
                      lambda: scored(lm, energy, pr, P, L, V, ctx),
                      lambda o: scored_shape(o, len(pr), V ** L))
        part['beam'] = cached(cache and os.path.join(cache, f'{key}_beam{beam}_{c0}.pt'),
                              lambda: index_of(lm.beam_search(pr, L, beam)[0], V),
                              lambda o: rows_shape(o, len(pr), beam, V ** L))
        parts.append(part)
        times['lm_s'] += part['lm_s']
        times['energy_s'] += part['energy_s']
        log(f"  {c0 + len(part['E'])} of {len(x)} prompts enumerated")
    log_p, E = torch.cat([p['log_p'] for p in parts]), torch.cat([p['E'] for p in parts])
    known_rows = torch.cat([real[:, None], torch.cat([p['beam'] for p in parts])], 1)
    # the shared-prefix energies against whole sequences scored apart, on the known rows
    direct = score_continuations(energy, prompts, cont[known_rows], P, ctx)
    times['energy_vs_direct'] = (E.gather(1, known_rows) - direct).abs().max().item()
    log(f"  {len(prompts)} prompts x {V ** L:,} continuations: LM {times['lm_s']:.0f} s, "
        f"energy {times['energy_s']:.0f} s (against whole sequences: {times['energy_vs_direct']:.2g})")
    return x, log_p, E, real, known_rows, cont, times


def scored(lm, energy, prompts, P, L, V, ctx):
    """log P_LM and E of every continuation of `prompts`, with the seconds each took."""
    t0 = time.time()
    part = dict(log_p=lm_logprobs(lm, prompts, L, V))
    t1 = time.time()
    part['E'] = energies(energy, prompts, P, L, V, ctx)
    return dict(part, lm_s=t1 - t0, energy_s=time.time() - t1)


def scored_shape(o, B, C):
    """What is wrong with a cached chunk of scored() for B problems of C continuations (None: nothing)."""
    if not isinstance(o, dict) or not {'log_p', 'E', 'lm_s', 'energy_s'} <= o.keys():
        return "not a chunk of scores"
    for k in ('log_p', 'E'):
        t = o[k]
        if not isinstance(t, torch.Tensor) or t.shape != (B, C) or not t.is_floating_point():
            return f"its {k} is not a ({B}, {C}) float tensor"
    if torch.isnan(o['log_p']).any() or torch.isnan(o['E']).any():
        return "it holds NaN"
    if not all(isinstance(o[k], float) for k in ('lm_s', 'energy_s')):
        return "its seconds are not numbers"
    return None


def rows_shape(o, B, beam, C):
    """What is wrong with a cached beam of B problems (None: nothing): (B, beam) row indices below C."""
    if not isinstance(o, torch.Tensor) or o.shape != (B, beam) or o.dtype != torch.int64:
        return f"not a ({B}, {beam}) tensor of continuation indices"
    if len(o) and not (0 <= int(o.min()) and int(o.max()) < C):
        return f"an index beyond the {C} continuations"
    return None


def cached(path, make, wrong=lambda o: None):
    """What path holds (read weights only: tensors, no code) where it exists and `wrong` finds
    nothing amiss with it, else make(), saved there atomically (no path: make()). A damaged file
    (truncated, overwritten, another shape) is made again, with one line on stderr saying so."""
    if path and os.path.exists(path):
        try:
            obj = torch.load(path, weights_only=True)
            why = wrong(obj)
        except Exception as e:  # torch.load's errors on a damaged file are of many types
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else 'unreadable'}"
        if why is None:
            return obj
        print(f"the cache file {path} is damaged ({why}): computing it again", file=sys.stderr, flush=True)
    obj = make()
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(obj, tmp))
    return obj


def run_split(args, lm, energy, data, meta, P, L, count, split, ctx, log):
    V = meta['vocab_size']
    key = f"{split}_{count}_{args.dtype}_{file_hash(args.lm)}_{file_hash(args.energy)}"
    x, log_p, E, real, known_rows, cont, times = enumerate_split(lm, energy, data, P, L, V, count, ctx,
                                                                 args.beam, log, args.cache, key)
    E = E * args.energy_scale
    mass_err = (log_p.logsumexp(-1).exp() - 1).abs().max().item()
    if mass_err > 1e-6:
        raise ValueError(f"the LM's probabilities of all continuations sum to 1 +- {mass_err:.2g}, "
                         f"not within 1e-6")
    ex = exact_values(log_p, E, real)
    t0 = time.time()
    reps = replicate_errors(log_p, E, ex['log_z'], known_rows, cont, args.ns, args.reps, args.seed, split,
                            args.slack)
    times['replicates_s'] = time.time() - t0
    beams = beam_curve(lm, x[:, :P], real, log_p, E, ex['log_z'], cont, args.widths, args.job_n, args.reps,
                       args.seed, split, args.tol)
    log(f"  replicates: {times['replicates_s']:.0f} s; the job's estimator (n = {args.job_n}) within "
        f"{args.tol:g} by beam width: " + ', '.join(f"{r['beam']}: {r['within_tol']:.3f}" for r in beams))
    chars = meta['chars']
    text = lambda row: ''.join('<eot>' if t == meta['eot_id'] else chars[t - 1] for t in row.tolist())
    per_prompt = [dict(problem=text(x[i]), log_z=ex['log_z'][i].item(), lm_logp_real=ex['lm_logp'][i].item(),
                       energy_real=ex['energy'][i].item(), joint_ll_real=ex['joint_ll'][i].item(),
                       p_joint_correct=math.exp(ex['joint_ll'][i].item()),
                       p_lm_correct=math.exp(ex['lm_logp'][i].item()),
                       lm_mode_correct=bool(ex['lm_mode_correct'][i]),
                       joint_mode_correct=bool(ex['joint_mode_correct'][i]),
                       real_in_beam=bool((known_rows[i, 1:] == real[i]).any()),
                       estimate_abs_error_median={n: r['estimate'][i].abs().median().item()
                                                  for n, r in reps.items()},
                       eq4_coverage={n: r['covered'][i].double().mean().item() for n, r in reps.items()})
                  for i in range(len(x))]
    summary = dict(prompts=len(x), lm_mass_max_error=mass_err,
                   p_lm_correct=ex['lm_logp'].exp().mean().item(),
                   p_joint_correct=ex['joint_ll'].exp().mean().item(),
                   joint_ll_real=ex['joint_ll'].mean().item(), lm_logp_real=ex['lm_logp'].mean().item(),
                   lm_mode_exact=ex['lm_mode_correct'].double().mean().item(),
                   joint_mode_exact=ex['joint_mode_correct'].double().mean().item(),
                   log_z_mean=ex['log_z'].mean().item())
    return reps, summary, per_prompt, times, beams


def format_table(rows, tol):
    head = (f"{'n':>5} | {'T_n bias':>9} {'sd':>7} {'|err|':>7} | {'upper bias':>10} | {'Eq.4 cover':>10} | "
            f"{'enum bias':>10} {'sd':>8} {'|err|':>8} {f'<={tol:g}':>7}")
    lines = [head, '-' * len(head)]
    for r in rows:
        t, u, e = r['T_n'], r['upper'], r['estimate']
        lines.append(f"{r['n']:>5} | {t['bias']:>9.3f} {t['spread']:>7.3f} {t['mean_abs']:>7.3f} | "
                     f"{u['bias']:>10.3f} | {r['eq4_coverage']:>10.3f} | "
                     f"{e['bias']:>10.5f} {e['spread']:>8.5f} "
                     f"{e['mean_abs']:>8.5f} {e['within_tol']:>7.3f}")
    return '\n'.join(lines)


def main(argv=None):
    args = get_args(argv)
    device = setup(args.device)[2]
    if device != 'cpu':
        raise ValueError("--device: the replicates run on the CPU (float64); pass --device cpu")
    # progress: stderr (diagnostics), the tables: stdout (results)
    log = (lambda *a: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    energy = load_any_energy(args.energy, args.lm, device)[0]
    layout = problem_windows(meta)
    if layout is None:
        raise ValueError(f"{data_dir} holds no addition problems "
                         f"(python -m data.addition.prepare --digits 2)")
    P, L = layout
    V = meta['vocab_size']
    if V ** L > MAX_CONTINUATIONS:
        raise ValueError(f"{V}^{L} = {V ** L:,} continuations per prompt are too many to enumerate "
                         f"(at most {MAX_CONTINUATIONS:,}): prepare fewer --digits")
    ctx = nullcontext() if args.dtype == 'float32' else torch.autocast('cpu', dtype=torch.bfloat16)
    res = dict(lm=args.lm, energy=args.energy, data_dir=data_dir, prefix_len=P, gen_len=L, vocab_size=V,
               energy_scale=args.energy_scale, continuations_per_prompt=V ** L, ns=args.ns, reps=args.reps,
               beam=args.beam, tol=args.tol,
               dtype=args.dtype, seed=args.seed, torch=torch.__version__, thresholds=list(THRESHOLDS),
               target=args.target, slack=args.slack)
    splits = {}
    for split, count in ((args.select_split, args.select_prompts), (args.split, args.prompts)):
        log(f"{split}:")
        data = load_split(data_dir, split, meta)
        reps, summary, per_prompt, times, beams = run_split(args, lm, energy, data, meta, P, L, count, split,
                                                            ctx, log)
        splits[split] = reps
        res[split] = dict(exact=summary, table=error_table(reps, args.tol),
                          threshold_curve=threshold_curve(reps, THRESHOLDS), per_prompt=per_prompt,
                          times=times, beam_curve=beams)
    res['beam_choice'] = beam_choice(res, args)
    chosen, met = choose_threshold(res[args.select_split]['threshold_curve'], args.target)
    rule = (f"the smallest ESS threshold of {list(THRESHOLDS)} at which, on {args.select_split}, the "
            f"Eq. 4 ranges that logz_diagnostics leaves unflagged contain the exact log Z (within "
            f"{args.slack:g} nats of an end) at >= {args.target:g} at every n of {args.ns} (an n with "
            f"every range flagged meets it)")
    res['min_ess'] = dict(chosen=chosen, rule_met=met, rule=rule if met else rule + ' (none met it: '
                          'the threshold whose worst n is best)',
                          on_split=next(c for c in res[args.split]['threshold_curve']
                                        if c['min_ess'] == chosen))
    write_json(res, args.out)
    if not args.quiet:
        print(f"\n{args.split}: {res[args.split]['exact']}")
        print(format_table(res[args.split]['table'], args.tol))
        b = res['beam_choice']
        print(f"the job's beam: {b['chosen']} ({'rule met' if b['rule_met'] else 'rule not met'}); on "
              f"{args.split} within {args.tol:g}: {b['on_split']['within_tol']:.3f}")
        print(f"MIN_ESS {chosen} ({'rule met' if met else 'rule not met'}); on {args.split}: "
              + ', '.join(f"n={p['n']}: flagged {p['flagged']:.2f}, covered {p['coverage_slack_unflagged']}"
                          for p in res['min_ess']['on_split']['per_n']))
    if args.plot:
        plot(res, args.split, args.select_split, chosen, args.plot)


def plot(res, split, select_split, chosen, path):
    """Left: mean |error| against the exact log Z over n for T_n, Eq. 4's upper end and
    logz_enumerate's estimate; right: Eq. 4's coverage, with and without the MIN_ESS flag, and the
    share of logz_enumerate's estimates within tol."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows = res[split]['table']
    ns = [r['n'] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for k, label, style in (('T_n', 'Eq. 4: T_n', 'o-'), ('upper', 'Eq. 4: upper end', 's--'),
                            ('estimate', f"logz_enumerate (known: real + beam {res['beam']})", 'D-')):
        a1.plot(ns, [max(r[k]['mean_abs'], 1e-7) for r in rows], style, label=label)
    a1.axhline(res['tol'], color='gray', lw=0.8, ls=':', label=f"{res['tol']:g} nats")
    a1.set(xscale='log', yscale='log', xlabel='LM samples n',
           ylabel=f'mean |error| vs exact log Z (nats, {split})')
    a1.legend(fontsize=7)
    curve = next(c for c in res[split]['threshold_curve'] if c['min_ess'] == chosen)['per_n']
    a2.plot(ns, [r['eq4_coverage'] for r in rows], 'o-', label='Eq. 4 range contains log Z')
    nan = lambda v: float('nan') if v is None else v
    a2.plot(ns, [nan(p['coverage_slack_unflagged']) for p in curve], 's--',
            label=f"... within {res['slack']:g}, unflagged (MIN_ESS {chosen:g}, from {select_split})")
    a2.plot(ns, [1 - p['flagged'] for p in curve], 'x:', label='share unflagged')
    a2.plot(ns, [r['estimate']['within_tol'] for r in rows], 'D-',
            label=f"logz_enumerate within {res['tol']:g}")
    a2.set(xscale='log', ylim=(-0.02, 1.02), xlabel='LM samples n', ylabel='share of (prompt, replicate)')
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == '__main__':
    run_main(main)

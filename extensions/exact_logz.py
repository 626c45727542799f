"""
Exact Z on a task small enough to enumerate: addition with N = 2 digits
(data/addition/prepare.py --digits 2), where a continuation is the 3 sum digits and the end of
text, L = 4 tokens over a 13-token vocabulary: all V^L = 28,561 continuations of a prompt are
scored (N = 3, a sharp energy: 13^5 = 371,293). That is every continuation the LM can emit:
sampling draws L untruncated tokens. The enumeration (the LM and a UNIT walk the trie of
continuations with their KV cache, each prefix once; a BIT reads whole sequences: at N = 3, 22-24 s
a prompt on two threads) is extensions/enumeration.py.

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
import sys
import time
from contextlib import nullcontext

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.exact_logz")
import torch

from data import load_lm_and_data, load_split, problem_windows
from energy import kish_ess, load_any_energy, logz_bounds, logz_diagnostics, logz_enumerate
from extensions.enumeration import MAX_CONTINUATIONS, enumerate_split, index_of, one_token_edits
from plumbing import (ArgumentParser, atomic_write, check_new, check_writable, comma_ints, common_flags,
                      file_hash, rng, run_main, setup, write_json)

# The models it was run on (docs/exact_logz.md): ADDITION's recipe (job/configs.py) on N = 2 with budgets
# scaled to 1,700 training problems (each stage ~100x less data than N = 6): the LM's shape and lrs,
# evaluated every 100 steps instead of 500 (one epoch is 8 LM steps), capped at 2,000; the UNIT from the
# LM's weights by ranking NCE over 16 LM samples, best.pt by the held-out gain on all 200 selection
# problems (64 samples each), capped at 1,500 steps; no MLM/BIT (a BIT shares no prefix: enumeration
# would cost 6x more).
RECIPE = [
    'python -m data.addition.prepare --digits 2 --train_problems 1700 --select_problems 200 '
    '--val_problems 200 --test_problems 400 --out_dir {o}/data',
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

# Sharper (docs/exact_logz.md, "A verifier"): 4x the training problems, the LM's step-1,500 snapshot
# (P_LM(correct) ~0.7) and a BIT (MLM-pretrained as ADDITION's) trained 3x longer than RECIPE_SHARP's UNIT;
# a UNIT from the same LM, same negatives, levelled off at a held-out gain of 0.065 (8,000 or 24,000 steps)
RECIPE_SHARPER = [
    'python -m data.addition.prepare --digits 3 --train_problems 200000 --select_problems 500 '
    '--val_problems 500 --test_problems 1000 --out_dir {o}/data',
    RECIPE_SHARP[1],  # the LM, as above
    'mkdir -p {o}/lm1500 && cp {o}/lm/iter_1500.pt {o}/lm1500/best.pt',
    'python negatives.py --lm {o}/lm1500/best.pt --split train --out_dir {o}/neg1500_train --num_samples 16 '
    '--prefix_len 8 --gen_len 5',
    'python negatives.py --lm {o}/lm1500/best.pt --split select --out_dir {o}/neg1500_select '
    '--num_prefixes 500 --num_samples 64 --prefix_len 8 --gen_len 5',
    'python train_lm.py --data_dir {o}/data --out_dir {o}/mlm --objective mlm --n_layer 3 --n_head 3 '
    '--n_embd 96 --block_size 65 --batch_size 32 --max_iters 2000 --lr_decay_iters 2000 --lr 1e-3 '
    "--min_lr 1e-4 --warmup_iters 40 --eval_interval 500 --alibi --patience 0 --min_rel_delta 0 "
    "--select_on window --final_eval 0 --snapshots ''",
    'python nce_train.py --lm {o}/lm1500/best.pt --negatives {o}/neg1500_train --held_out_negatives '
    '{o}/neg1500_select --body bit --init_from {o}/mlm/best.pt --out_dir {o}/bitlong --batch_size 32 '
    '--max_iters 24000 --lr 3e-4 --min_lr 3e-5 --warmup_iters 50 --eval_interval 1000 --eval_prefixes 500 '
    '--patience 6',
]  # each with --seed 0 --device cpu --dtype bfloat16; then this script (docs/exact_logz.md has its flags)

THRESHOLDS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


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


def beam_curve(lm, prompts, real, log_p, E, log_z, cont, widths, n, reps, seed, split, tol, edits=0):
    """The job's estimator (logz_enumerate: the real continuation and the LM's beam known, with every
    one-token edit of the beam's first `edits` (addition_eval --edits), n samples) at each beam width:
    the share of (prompt, replicate) within tol nats of the exact log Z, the share of prompts whose
    median replicate is, and the biases of its estimate and of its sure part."""
    L, V = cont.size(1), int(cont.max()) + 1
    rows = []
    for w in widths:
        beam = lm.beam_search(prompts, L, w)[0]
        edited = index_of(one_token_edits(beam[:, :edits], V), V)
        known = torch.cat([real[:, None], index_of(beam, V), edited], 1)
        r = replicate_errors(log_p, E, log_z, known, cont, [n], reps, seed, split)[n]
        e = r['estimate']
        rows.append(dict(beam=w, edits=min(edits, w), n=n, within_tol=(e.abs() <= tol).double().mean().item(),
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
    a('--edits', type=int, default=0, at_least=0, at_most='beam',
      help="the job's known set also holds every one-token edit of the beam's first EDITS continuations "
           "(addition_eval.py --edits)")
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
    common_flags(p, 'force', 'device', 'deterministic', 'seed', 'quiet',
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
                       args.seed, split, args.tol, args.edits)
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
    device = setup(args.device, args.deterministic)[2]
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
               beam=args.beam, edits=args.edits, tol=args.tol,
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
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    plt.close(fig)


if __name__ == '__main__':
    run_main(main)

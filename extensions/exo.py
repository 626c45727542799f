"""
EXO: the residual energy folded back into an LM (Haozhe Ji's talk; Ji et al., "Towards Efficient
Exact Optimization of Language Model Alignment", ICML 2024). The joint model of Deng et al.
(ICLR 2020, Eq. 2), pi*(y|x) ∝ P_LM(y|x) exp(-E(x, y)), is EXO's target
pi*_{beta_r}(y|x) ∝ pi_sft(y|x) exp(r(x, y) / beta_r) with pi_sft = P_LM, r = -E and beta_r = 1.
A copy pi_theta of the LM is fine-tuned towards it on K samples y_1..y_K ~ pi_sft(.|x) per
training prefix x, by the reverse KL between two distributions over the K (the talk's L_exo):

    p_f(i) = softmax_i(beta_pi log(pi_theta(y_i|x) / pi_sft(y_i|x)))      the policy's
    p_r(i) = softmax_i(r(x, y_i) / beta_r)                                 the reward's
    L_exo = E_x E_{y_1..K} KL(p_f || p_r);   L_dpo-rw = E_x E_{y_1..K} [-sum_i p_r(i) log p_f(i)]

As K grows, the gradient of L_exo tends to that of KL(pi_theta^{beta_pi} || pi*_{beta_r}) (the
talk's "unbiased gradient", pi_theta^{beta_pi} ∝ pi_sft (pi_theta / pi_sft)^{beta_pi}), and that
of L_dpo-rw (--loss dpo, the talk's comparison) to the forward KL's; with beta_pi = beta_r = 1
the minimiser over a free policy is the joint model itself (both tested by exact enumeration in
tests/test_exo.py). --on_policy draws the K from pi_theta instead, weighted by pi_sft / pi_theta:
the same limits, from samples that also go where pi_theta has gone. --beam W takes the limit on a
set instead (set_step_loss): the distinct continuations among P_LM's beam of W and the K samples,
each once, weighted by pi_sft, so that L_exo is exactly the reverse KL renormalised on that set; the
beam offers the continuations pi* favours where the policy's own samples all repeat one mistake, and
a peaked policy's repeats cost nothing. The result samples at LM speed
and has an exact perplexity: best.pt is an LM checkpoint that every script loads (estimate_ppl.py
--extra_lm EXO=.../best.pt).

Estimates (kl_estimates), per sequence and averaged over prefixes, on the selection split and on
val and test, with pi_theta's forward in eval mode (dropout off, as in training: at step 0 pi_theta
= pi_sft exactly and p_f is uniform):

    reverse KL(pi_theta || pi*) = E_{y~pi_theta}[log pi_theta - log P_LM + E] + log Z
    forward KL(pi* || pi_theta) = E_{y~pi*}[log P_LM - E - log pi_theta] - log Z
    KL(pi_theta || P_LM)        = E_{y~pi_theta}[log pi_theta - log P_LM]

log Z(x) once per prefix, before training, from --logz_samples (1,024) LM samples drawn apart from
pi_theta (logz_table): Eq. 4's T_n (biased low) and its upper end, so each KL is a range (`_low`,
`_high`). E_{pi*} by self-normalised importance sampling over the first --forward_samples of those
LM samples (weights exp(-E)). best.pt: the lowest KL that the loss minimises (reverse for exo,
forward for dpo; log Z fixed per prefix, either end chooses the same), the other reported beside it;
or with --select greedy_exact the most selection prefixes whose greedy continuation is the real one
(greedy_exact, reported at every evaluation: on addition a lower reverse KL is not a better greedy).

The training step runs under autocast in the run's precision (--dtype, decided once from the hardware
as the trainers do: bf16 on a CPU with bf16 units, 1.6x fp32's step at the addition job's flags); the
evaluations stay in float32, so that best.pt's choice reads the same estimates in any precision.
ckpt.pt (the policy, AdamW's and fp16's scaler's state, the curve, saved at each evaluation) lets
--resume continue a stopped run exactly: batches and samples are a function of (seed, iteration).

    python -m extensions.exo --lm out-addition/lm/best.pt --energy out-addition/bit/best.pt \\
        --prefix_len 14 --gen_len 8 --out_dir out-addition/exo
"""

import copy
import dataclasses
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.exo")
import plumbing
import numpy as np
import torch
import torch.nn.functional as F

from data import check_fits, check_problem_windows, load_lm_and_data, load_split, window_tokens, windows
from energy import (distinct_ids, first_occurrences, load_any_energy, logz_bounds, logz_diagnostics, score,
                    score_continuations)
import extensions.metrics  # noqa: F401  registers the metric energy's loader (--energy)
from model import get_lr, load_lm
from model import load_checkpoint
from plumbing import (ArgumentParser, check_new, check_resumed_flags, check_resumed_iters,
                      check_training_memory, check_writable, common_flags, file_hash, given_flags,
                      lock_folder, missing_checkpoint, new_folder, one_job, precision, rerun_command, rng,
                      run_main, save_checkpoint, setup, write_json)


def exo_loss(logp_theta, logp_sft, reward, beta_pi=1.0, beta_r=1.0, loss='exo', log_w=None):
    """L_exo (the talk's reverse KL(p_f || p_r)) or L_dpo-rw (the cross-entropy of p_f under
    p_r: the forward KL up to a constant) for each row of (B, K) log-probs of K continuations
    under pi_theta and pi_sft and their rewards r = -E. log_w (B, K): log-weights of the K
    continuations in both softmaxes, e.g. log pi_sft(y) over an enumeration of every y: then
    L_exo is exactly KL(pi_theta^{beta_pi} || pi*_{beta_r}), the K -> infinity limit. Returns (B,)."""
    f = beta_pi * (logp_theta - logp_sft)
    g = reward / beta_r
    if log_w is not None:
        f, g = f + log_w, g + log_w
    log_pf, log_pr = F.log_softmax(f, -1), F.log_softmax(g, -1)
    if loss == 'exo':
        return (log_pf.exp() * (log_pf - log_pr)).sum(-1)
    if loss == 'dpo':
        return -(log_pr.exp() * log_pf).sum(-1)
    raise ValueError(f"unknown loss '{loss}': use exo or dpo")


def continuation_logprob(lm, prefix, y):
    """log pi(y_k | x) (B, K) of continuations y (B, K, L) of prefix (B, P): sequence_logprob."""
    (B, K, _), P = y.shape, prefix.size(1)
    x = torch.cat([prefix[:, None].expand(-1, K, -1), y], 2).flatten(0, 1)
    return lm.sequence_logprob(x, P).view(B, K)


@contextmanager
def eval_mode(model):
    """model in eval mode (dropout off) inside, its mode restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def exo_step_loss(policy, sft, energy, prefix, K, gen_len, args, g):
    """The loss of one batch of prefixes (B, P): K untruncated samples each, their rewards -E, then
    exo_loss (mean over the batch). The samples are pi_sft's, or with --on_policy pi_theta's own
    (no gradient through the draw), both softmaxes then weighted by pi_sft / pi_theta (exo_loss's
    log_w, pi_theta's log-probs held fixed there): the same K -> infinity limit, but mass pi_theta
    moves onto sequences the LM rarely writes is drawn, and charged. pi_theta's forward in eval
    mode: with dropout on, pi_theta != pi_sft at step 0 and p_f would not start uniform."""
    with torch.no_grad(), eval_mode(policy if args.on_policy else sft) as proposal:
        y = proposal.generate(prefix, gen_len, num_samples=K, generator=g)[0]  # (B, K, L)
        logp_sft = continuation_logprob(sft, prefix, y)
        reward = -score_continuations(energy, prefix, y, prefix.size(1), nullcontext()).float()
    with eval_mode(policy):
        logp_theta = continuation_logprob(policy, prefix, y)
    log_w = logp_sft - logp_theta.detach() if args.on_policy else None
    return exo_loss(logp_theta, logp_sft, reward, args.beta_pi, args.beta_r, args.loss, log_w).mean()


NOT_IN_SET = -1e4  # a log-weight whose exp is exactly 0 in float32: a repeat of a continuation, left out


def set_step_loss(policy, sft, energy, prefix, K, gen_len, args, g):
    """--beam W: the loss over the set S of distinct continuations among P_LM's beam of W (the known
    set of log Z, energy.logz_enumerate) and the K samples, each once, weighted by pi_sft (exo_loss's
    log_w): L_exo is then exactly KL(pi_theta^{beta_pi} || pi*_{beta_r}) with both renormalised on S,
    the K -> infinity limit taken on the set, with no importance weights. The beam holds where pi*
    puts its mass, the samples (pi_theta's with --on_policy) where the policy has put it; where the
    policy is sure of a wrong continuation, all K samples may repeat it, and the beam still offers the
    others. Each distinct continuation goes through the models once: a peaked LM's samples repeat.
    The KL renormalised on S is blind to pi_theta(S): --beam_mass lambda adds lambda (-log pi_theta(B))
    for the beam B, the term the full reverse KL charges for mass outside B, lambda (1 - pi_theta(B))
    with lambda = log 1 / pi*(outside B), when pi* keeps nearly all of its mass on the beam."""
    P = prefix.size(1)
    with torch.no_grad(), eval_mode(policy if args.on_policy else sft) as proposal:
        y = torch.cat([sft.beam_search(prefix, gen_len, args.beam)[0],
                       proposal.generate(prefix, gen_len, num_samples=K, generator=g)[0]], 1)  # (B, m, L)
        (B, m, _), first = y.shape, first_occurrences(distinct_ids(y))
        x = torch.cat([prefix.repeat_interleave(m, 0)[first], y.flatten(0, 1)[first]], 1)
        logp_sft = sft.sequence_logprob(x, P)
        reward = -score(energy, x, P, nullcontext()).float()
    with eval_mode(policy):
        logp_theta = policy.sequence_logprob(x, P)
    on_set = lambda v, fill: torch.full((B * m,), fill, device=v.device).index_copy(0, first, v).view(B, m)
    loss = exo_loss(on_set(logp_theta, 0.0), on_set(logp_sft, 0.0), on_set(reward, 0.0), args.beta_pi,
                    args.beta_r, args.loss, on_set(logp_sft, NOT_IN_SET))
    log_pi_beam = on_set(logp_theta, NOT_IN_SET)[:, :args.beam].logsumexp(1)  # log pi_theta(B), repeats once
    return (loss - args.beam_mass * log_pi_beam).mean()


@torch.no_grad()
def logz_table(sft, energy, prefixes, gen_len, n, m, g, batch=16):
    """What the KL estimates need of the LM, once per prefix of prefixes (N, P), independent of
    pi_theta: Eq. 4's range of log Z(x) from n untruncated LM samples (low: T_n, high: the
    leave-one-out upper end) with its diagnostics (energy.logz_diagnostics: Kish's ESS, flagged below
    MIN_ESS), and the first m of them (tokens, log P_LM, -E) for the forward KL."""
    parts = []
    for pre in prefixes.split(batch):
        y = sft.generate(pre, gen_len, num_samples=n, generator=g)[0]  # (b, n, L)
        neg_e = -score_continuations(energy, pre, y, pre.size(1), nullcontext()).double()
        low, high = logz_bounds(neg_e)
        diag = logz_diagnostics(neg_e)
        parts.append(dict(low=low, high=high, ess=diag['ess'], flagged=diag['flagged'].double(),
                          y=y[:, :m], neg_e=neg_e[:, :m],
                          logp_sft=continuation_logprob(sft, pre, y[:, :m]).double()))
    return dict(prefixes=prefixes, logz_samples=n, **{k: torch.cat([p[k] for p in parts]) for k in parts[0]})


@torch.no_grad()
def kl_estimates(policy, sft, energy, table, gen_len, m, g, batch=64):
    """Means over the prefixes of logz_table `table` of KL(pi_theta || P_LM) and of the reverse and
    forward KL between pi_theta and the joint model pi*, each a range from log Z's range (reverse:
    + log Z; forward: - log Z); m samples of pi_theta per prefix, pi_theta in eval mode. Where the
    table holds the real continuations (eval_table's gold), greedy_exact too: the share of prefixes
    whose greedy continuation under pi_theta is the real one, token for token."""
    base, rev, fwd, exact = [], [], [], []
    with eval_mode(policy):
        for i in range(0, len(table['prefixes']), batch):
            pre, cut = table['prefixes'][i:i + batch], slice(i, i + batch)
            y = policy.generate(pre, gen_len, num_samples=m, generator=g)[0]
            ratio = (continuation_logprob(policy, pre, y) - continuation_logprob(sft, pre, y)).double()
            e = score_continuations(energy, pre, y, pre.size(1), nullcontext()).double()
            base.append(ratio.mean(1))
            rev.append((ratio + e).mean(1))
            neg_e, yf = table['neg_e'][cut], table['y'][cut]  # E_{pi*} by weights exp(-E) over LM samples
            log_joint = table['logp_sft'][cut] + neg_e  # log pi* + log Z
            log_pi = continuation_logprob(policy, pre, yf).double()
            fwd.append((torch.softmax(neg_e, 1) * (log_joint - log_pi)).sum(1))
            if 'gold' in table:
                greedy = policy.generate(pre, gen_len, temperature=0)[0][:, 0]
                exact.append((greedy == table['gold'][cut]).all(1).double())
    base, rev, fwd = torch.cat(base), torch.cat(rev), torch.cat(fwd)
    mean = lambda v: v.mean().item()
    return dict(kl_to_base=mean(base), kl_reverse_low=mean(rev + table['low']),
                kl_reverse_high=mean(rev + table['high']), kl_forward_low=mean(fwd - table['high']),
                kl_forward_high=mean(fwd - table['low']), logz_ess=mean(table['ess']),
                logz_flagged=mean(table['flagged']),  # the KL ranges rest on log Z's: its diagnostics
                **(dict(greedy_exact=mean(torch.cat(exact))) if exact else {}))


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', required=True, help='the base LM pi_sft = P_LM (train_lm.py best.pt); pi_theta starts as it')
    a('--energy', required=True,
      help='E, the reward r = -E (nce_train.py best.pt or metric_ebm.py energy.pt)')
    a('--init_from', default=None,
      help="pi_theta's start (default: --lm itself): an LM of the same data, e.g. BALM's best.pt")
    a('--data_dir', default=None, help='default: the data the LM was trained on')
    common_flags(p, 'out_dir', help=dict(out_dir='best.pt (an LM checkpoint), results.json, log'))
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='x: tokens of the prefix')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='y: tokens of the continuation')
    a('--loss', default='exo', choices=['exo', 'dpo'],
      help='exo: L_exo (reverse KL); dpo: L_dpo-rw (forward KL)')
    a('--num_samples', dest='K', type=int, default=8, at_least=2, at_most='samples',
      help='K, LM samples per training prefix')
    a('--on_policy', action='store_true', help='draw the K samples from pi_theta (importance-weighted)')
    a('--beam', type=int, default=0, at_least=0, at_most='beam',
      help="W: the loss over the distinct continuations among P_LM's beam of W and the K samples, each "
           "once (the KL restricted to that set, exactly: set_step_loss); 0: L_exo over the K samples")
    a('--beam_mass', type=float, default=0.0, at_least=0, at_most=None,
      help="lambda: with --beam, add lambda (-log pi_theta(beam)), the mass the set's KL does not see")
    a('--beta_pi', type=float, default=1.0, above=0, at_most=None,
      help="the policy's scale, positive (1: the joint model's)")
    a('--beta_r', type=float, default=1.0, above=0, at_most=None,
      help="the reward's temperature, positive (1: the joint model's)")
    a('--batch_size', type=int, default=16, at_least=1, at_most='count', help='prefixes per step')
    a('--lr', type=float, default=1e-4, above=0, at_most=None, help='learning rate')
    a('--min_lr', type=float, default=None, above=0, at_most=None,
      help='the cosine decay of --lr ends here, at --lr_decay_iters (default: --lr, a constant rate)')
    a('--lr_decay_iters', type=int, default=None, at_least=1, at_most='count',
      help="where --lr's cosine decay reaches --min_lr (default: --max_iters of the run's start)")
    a('--max_iters', type=int, default=300, at_least=1, at_most='count', help='iterations of the run')
    a('--eval_interval', type=int, default=50, at_least=1, at_most='count',
      help='evaluate on the selection split, and checkpoint, every this many iterations')
    a('--patience', type=int, default=0, at_least=0, at_most='count',
      help='stop after this many evaluations without a better best.pt (0: off)')
    a('--eval_prefixes', type=int, default=256, at_least=1, at_most='count',
      help='selection prefixes that choose best.pt')
    a('--select', default='kl', choices=['kl', 'greedy_exact'],
      help="what chooses best.pt on those prefixes: kl, the KL the loss minimises (reverse for exo, forward "
           "for dpo); greedy_exact, the share whose greedy continuation is the real one (ties: the lower KL)")
    a('--eval_samples', type=int, default=16, at_least=2, at_most='samples',
      help="pi_theta's samples per eval prefix (reverse KL)")
    a('--logz_samples', type=int, default=1024, at_least=2, at_most='samples',
      help="LM samples per eval prefix for log Z (Eq. 4's range), drawn once before training")
    a('--forward_samples', type=int, default=128, at_least=1, at_most='samples',
      help='of those, how many estimate the forward KL (importance weights exp(-E))')
    a('--resume', action='store_true',
      help="continue --out_dir's ckpt.pt (saved at each evaluation) exactly, as the trainers do")
    common_flags(p, 'force', 'device', 'deterministic', 'dtype', 'seed', 'quiet',
                 help=dict(force="start over, replacing --out_dir's ckpt.pt, best.pt and results.json",
                           dtype="autocast dtype of the training step ('auto': from the hardware, as the "
                                 "trainers; fp16 with a GradScaler); the evaluations stay in float32"))
    args = p.parse_args(argv)
    check_flags(args)
    return args


def check_flags(args):
    """The flags that depend on each other consistent, --out_dir writable, and --resume / --force
    consistent with what it holds."""
    if args.forward_samples > args.logz_samples:
        raise ValueError(f"--forward_samples {args.forward_samples} must be at most --logz_samples "
                         f"{args.logz_samples}: the forward KL reuses log Z's LM samples")
    if args.beam_mass and not args.beam:
        raise ValueError(f"--beam_mass {args.beam_mass} needs a beam: give --beam W too (e.g. --beam 4)")
    check_writable(args.out_dir, '--out_dir')
    ckpt = os.path.join(args.out_dir, 'ckpt.pt')
    if args.resume and args.force:
        raise ValueError("--resume and --force contradict each other: --resume continues ckpt.pt, "
                         "--force starts over")
    if args.resume and not os.path.exists(ckpt):
        raise missing_checkpoint(args.out_dir)
    if not args.resume and os.path.exists(ckpt) and not args.force:
        raise ValueError(f"{ckpt} exists: pass --resume to continue it, --force to start over, or choose "
                         f"another --out_dir")
    if not args.resume:
        check_new(os.path.join(args.out_dir, 'results.json'), '--out_dir', args.force,
                  also=(os.path.join(args.out_dir, 'best.pt'),))


# what a --resume takes from ckpt.pt (a contradicting flag is refused): every flag that changes the
# numbers; free: --max_iters (upwards), --device, --quiet
FIXED = ('lm', 'energy', 'init_from', 'data_dir', 'prefix_len', 'gen_len', 'loss', 'K', 'on_policy', 'beam',
         'beam_mass', 'beta_pi', 'beta_r', 'batch_size', 'lr', 'min_lr', 'lr_decay_iters', 'eval_interval',
         'patience', 'eval_prefixes', 'select', 'eval_samples', 'logz_samples', 'forward_samples', 'seed')


def fix_schedule(args, saved):
    """--min_lr and --lr_decay_iters left out: a constant --lr (a run saved before them had one), the
    decay ending at the first run's --max_iters, so that a --resume that raises it keeps the schedule."""
    if args.min_lr is None:
        args.min_lr = args.lr
    if args.lr_decay_iters is None:
        args.lr_decay_iters = saved['exo']['max_iters'] if saved else args.max_iters


def resumed(args, argv):
    """ckpt.pt of a --resume (None for a new run), its flags taken for those left out and checked
    against those given (FIXED), and its LM the same file (by hash) as the one it trained from."""
    if not args.resume:
        return None
    path = os.path.join(args.out_dir, 'ckpt.pt')
    ckpt = load_checkpoint(path)
    check_exo_checkpoint(ckpt, path)
    ckpt['exo'].setdefault('dtype', 'float32')  # a run from before --dtype trained in float32
    check_resumed_flags(args, argv, ckpt['exo'], FIXED, path, 'EXO run')
    if 'max_iters' not in given_flags(argv):
        args.max_iters = ckpt['exo']['max_iters']
    check_resumed_iters(args.max_iters, ckpt['iter_num'], path)
    for flag, what in (('lm', 'LM'), ('energy', 'energy')):  # energy_hash: not in ckpt.pt from before it
        if ckpt['exo'].get(f'{flag}_hash', file_hash(getattr(args, flag))) != file_hash(getattr(args, flag)):
            raise ValueError(f"--{flag} {getattr(args, flag)} is not the {what} {path} trained from (its "
                             f"file changed): --resume continues that run; start a new one in another "
                             f"--out_dir")
    best = os.path.join(args.out_dir, 'best.pt')
    if 'best_hash' in ckpt and (not os.path.isfile(best) or file_hash(best) != ckpt['best_hash']):
        raise ValueError(f"{best} is not the best policy of the run {path} holds (missing, or from another "
                         f"run: its hash differs): start over with --force, or restore that run's best.pt")
    return ckpt


RESUMABLE = ('exo', 'model', 'optimizer', 'iter_num', 'curve', 'best_iter')  # what ckpt.pt holds


def check_exo_checkpoint(ckpt, path):
    """ckpt.pt is an EXO run's (evaluate saves it): not an LM's, nor an EXO best.pt (no optimizer)."""
    missing = [k for k in RESUMABLE if k not in ckpt]
    if not missing and isinstance(ckpt['exo'], dict) and 'lm_hash' in ckpt['exo']:
        return
    what = ('an EXO best.pt (the policy alone)' if isinstance(ckpt.get('exo'), dict)
            else 'not an EXO checkpoint (a train_lm.py or nce_train.py one?)')
    raise ValueError(f"{path} is {what}: it lacks {', '.join(missing) or 'exo.lm_hash'}, so --resume cannot "
                     f"continue it; start over with --force, or resume the folder of an EXO run")


def resume_hint(argv):
    """Stopped: what out_dir holds, and the command that resumes (or reruns) it."""
    p = ArgumentParser(add_help=False)
    common_flags(p, 'out_dir')
    p.add_argument('--max_iters', type=int, default=None, at_least=1, at_most=None, help='as get_args')
    args = p.parse_known_args(argv)[0]
    ckpt, best = (os.path.join(args.out_dir, f) for f in ('ckpt.pt', 'best.pt'))
    if not os.path.exists(ckpt) and os.path.exists(best):
        return (f"{best} holds the best policy so far, but there is no {ckpt} to resume; start over with "
                f"{rerun_command(argv, add=('--force',))}")
    if not os.path.exists(ckpt):
        return f"nothing was saved (the first evaluation saves); rerun: {rerun_command(argv)}"
    saved = torch.load(ckpt, map_location='cpu', weights_only=True, mmap=True)
    argv = [a for a in argv if a != '--force']
    return (f"{ckpt} holds iteration {saved.get('iter_num')} of "
            f"{args.max_iters or saved.get('exo', {}).get('max_iters')} "
            f"({best}: the best policy so far); resume with: {rerun_command(argv, add=('--resume',))}")


def load_models(args, device):
    """(pi_sft frozen, pi_theta trainable: a copy of it, or of --init_from, in eval mode, dropout off
    (exo_step_loss), the energy, pi_theta's checkpoint, data_dir, meta)."""
    sft, ckpt, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    check_problem_windows(meta, args.prefix_len, args.gen_len)
    check_plain_lm(ckpt, 'lm', args.lm)
    if args.init_from:
        policy, ckpt = load_lm_and_data(args.init_from, data_dir, device)[:2]
        check_plain_lm(ckpt, 'init_from', args.init_from)
    else:
        policy = copy.deepcopy(sft)
    energy = load_any_energy(args.energy, args.lm, device)[0]
    policy.eval()
    for p in list(sft.parameters()) + list(energy.parameters()):
        p.requires_grad_(False)
    check_fits(args.prefix_len + args.gen_len, dict(LM=sft, policy=policy))
    config = dataclasses.replace(policy.config, block_size=args.prefix_len + args.gen_len)
    beam = f" + --beam {args.beam}" if args.beam else ""
    check_training_memory(config, args.batch_size * (args.K + args.beam), device,
                          f"a step of --batch_size {args.batch_size} x --num_samples {args.K} samples{beam}",
                          f"lower --batch_size or --num_samples{beam and ' or --beam'}")
    return sft, policy, energy, ckpt, data_dir, meta


def check_plain_lm(ckpt, flag, path):
    if ckpt.get('residual_of'):
        raise ValueError(f"--{flag} {path} is a RALM: EXO fine-tunes a plain GPT LM "
                         "(train_lm.py without --residual_of)")


def prefixes_of(data_dir, meta, split, args, count=None, device='cpu'):
    """Token windows' prefixes (N, P) of a split, evenly spaced (count of them), and all offsets."""
    data = load_split(data_dir, split, meta)
    offsets = windows(data, args.prefix_len, args.gen_len, max_windows=count)
    if len(offsets) == 0:
        raise ValueError(f"the {split} split is shorter than --prefix_len + --gen_len")
    return data, offsets, window_tokens(data, offsets, args.prefix_len).to(device)


@one_job
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = get_args(argv)
    device = setup(args.device, args.deterministic)[2]
    saved = resumed(args, argv)
    # autocast's precision from the hardware, decided once and saved with the flags (a --resume keeps it)
    args.dtype, ctx = precision(device, args.dtype)
    fix_schedule(args, saved)
    torch.manual_seed(plumbing.rng_seed(args.seed, 'exo init'))
    # sizes checked: nothing written yet
    sft, policy, energy, ckpt, data_dir, meta = load_models(args, device)
    new_folder(args.out_dir, keep=('ckpt.pt', 'best.pt', 'results.json'))
    lock_folder(args.out_dir)
    train, train_offsets, _ = prefixes_of(data_dir, meta, 'train', args)
    sel = eval_table(sft, energy, data_dir, meta, 'select', args, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler(device.split(':')[0], enabled=args.dtype == 'float16')  # fp16 only
    state = dict(ckpt, objective=f'exo ({args.loss})',
                 exo=dict(vars(args), lm_hash=file_hash(args.lm), energy_hash=file_hash(args.energy)))
    # an LM checkpoint of EXO's own: the start LM's training record (its args, best) left out
    state = {k: v for k, v in state.items() if k not in ('optimizer', 'scaler', 'rng_state', 'args', 'best')}
    curve, best, start, t0 = [], None, 0, time.time()
    if saved:  # the run as it stood after its evaluation at saved['iter_num'], before that step
        policy.load_state_dict(saved['model'])
        opt.load_state_dict(saved['optimizer'])
        scaler.load_state_dict(saved.get('scaler', {}))  # absent: a float32 run from before --dtype
        curve, start = saved['curve'], saved['iter_num']
        best = next(c for c in curve if c['iter'] == saved['best_iter'])
    for it in range(start, args.max_iters + 1):
        if it % args.eval_interval == 0 or it == args.max_iters:
            if not (saved and it == start):
                best = evaluate(policy, sft, energy, sel, (opt, scaler), state, curve, best, it, args, device)
            stale = args.patience and it - best['iter'] >= args.patience * args.eval_interval
            if it == args.max_iters or stale:
                break
        g = rng(args.seed, 'exo batch', 'train', it, device)
        pick = torch.randint(len(train_offsets), (args.batch_size,), generator=g, device=g.device)
        pick = pick.cpu().numpy()  # drawn on g's device (a CUDA generator refuses a CPU tensor)
        prefix = window_tokens(train, train_offsets[np.sort(pick)], args.prefix_len).to(device)
        step_loss = set_step_loss if args.beam else exo_step_loss
        with ctx:
            loss = step_loss(policy, sft, energy, prefix, args.K, args.gen_len, args, g)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # clip the true gradients, not fp16's scaled ones
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0).item()
        # fp16: the scaler skips a step whose gradient is not finite
        check_finite(loss.item() + (0.0 if scaler.is_enabled() else norm),
                     it, f'its loss {loss.item():.4g}, gradient norm {norm:.4g}', best, args)
        for group in opt.param_groups:
            group['lr'] = get_lr(it, args.lr, args.min_lr, 0, args.lr_decay_iters)
        scaler.step(opt)
        scaler.update()
    report(args, sft, energy, data_dir, meta, curve, best, time.time() - t0, device)


def evaluate(policy, sft, energy, sel, optimizer, state, curve, best, it, args, device):
    """The evaluation at iteration it on the selection split (in float32), appended to curve; best.pt
    if it is the best yet, then ckpt.pt (what a --resume continues, with the optimizer and fp16's
    scaler, written after best.pt so that it never points past it). Returns the best so far."""
    opt, scaler = optimizer
    kl = kl_estimates(policy, sft, energy, sel, args.gen_len, args.eval_samples,
                      rng(args.seed, 'exo eval', 'select', 0, device))
    check_finite(min(kl.values()) + max(kl.values()), it, 'its KL estimates', best, args)
    curve.append(dict(iter=it, **{f'select_{k}': v for k, v in kl.items()}))
    if best is None or rank(kl, args) < rank(best, args, 'select_'):
        best = curve[-1]
        save_checkpoint(dict(state, model=policy.state_dict(), iter_num=it),
                        os.path.join(args.out_dir, 'best.pt'))
    save_checkpoint(dict(state, model=policy.state_dict(), optimizer=opt.state_dict(),
                         scaler=scaler.state_dict(), iter_num=it, curve=curve, best_iter=best['iter'],
                         best_hash=file_hash(os.path.join(args.out_dir, 'best.pt'))),
                    os.path.join(args.out_dir, 'ckpt.pt'))
    if not args.quiet:
        print(f"iter {it}: select {format_kl(kl)}{' (best)' if best is curve[-1] else ''}", flush=True)
    return best


def check_finite(value, it, what, best, args):
    """A diverging policy (--lr too high) stops with one line: what was not finite at iteration it,
    and the best.pt kept, which no non-finite estimate can replace."""
    if not math.isfinite(value):
        kept = os.path.join(args.out_dir, 'best.pt')
        kept = f"{kept} (iteration {best['iter']}) is intact" if best else "nothing was saved"
        raise ValueError(f"the policy diverged at iteration {it} ({what} not finite): lower --lr "
                         f"(now {args.lr:g}) and start over with --force (a --resume keeps --lr); {kept}")


def report(args, sft, energy, data_dir, meta, curve, best, seconds, device):
    """best.pt's KL to the base LM and to the joint model on val and test (reported only), and
    results.json."""
    policy = load_lm(os.path.join(args.out_dir, 'best.pt'), device, meta)[0]
    final = {}
    for split in ('val', 'test'):
        table = eval_table(sft, energy, data_dir, meta, split, args, device)
        final[split] = kl_estimates(policy, sft, energy, table, args.gen_len, args.eval_samples,
                                    rng(args.seed, 'exo eval', split, 0, device))
    write_json(dict(args=vars(args), best_iter=best['iter'], best=best, curve=curve, final=final,
                    selected_by=selected_by(args), logz_samples=args.logz_samples,
                    forward_samples=args.forward_samples, params=policy.num_params(),
                    train_seconds=round(seconds, 1)),
               os.path.join(args.out_dir, 'results.json'))
    print(f"best.pt: iter {best['iter']}, by {selected_by(args)}; "
          + "; ".join(f"{s} {format_kl(v)}" for s, v in final.items()))


SELECT = dict(exo='kl_reverse_high', dpo='kl_forward_high')  # the KL each loss minimises, at its high end


def rank(est, args, prefix=''):
    """best.pt's order on an evaluation's estimates (est[prefix + name]), lower is better: the KL the loss
    minimises, or with --select greedy_exact the greedy exact match first, ties to the lower KL."""
    kl = est[prefix + SELECT[args.loss]]
    return (-est[prefix + 'greedy_exact'], kl) if args.select == 'greedy_exact' else (kl,)


def selected_by(args):
    return 'greedy_exact' if args.select == 'greedy_exact' else SELECT[args.loss]


def format_kl(kl):
    """The KL estimates in one line: to the base LM, then reverse and forward to the joint model as ranges."""
    exact = f", greedy exact {kl['greedy_exact']:.4f}" if 'greedy_exact' in kl else ''
    return (f"KL to base {kl['kl_to_base']:.4f}, reverse KL to joint {kl['kl_reverse_low']:.4f}-"
            f"{kl['kl_reverse_high']:.4f}, forward {kl['kl_forward_low']:.4f}-{kl['kl_forward_high']:.4f}"
            + exact)


def eval_table(sft, energy, data_dir, meta, split, args, device):
    """logz_table of the split's --eval_prefixes prefixes, from the split's own stream of LM samples,
    with their real continuations (gold: what greedy_exact compares with)."""
    data, offsets, pre = prefixes_of(data_dir, meta, split, args, args.eval_prefixes, device)
    table = logz_table(sft, energy, pre, args.gen_len, args.logz_samples, args.forward_samples,
                       rng(args.seed, 'exo log Z', split, 0, device))
    return dict(table, gold=window_tokens(data, offsets + args.prefix_len, args.gen_len).to(device))


if __name__ == '__main__':
    run_main(main, resume_hint)

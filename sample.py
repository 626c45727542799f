"""
Generation from the joint model P_LM exp(-E) (Section 3.3).

- algorithm_1, Algorithm 1 in five lines: draw n continuations from the LM (top-k), score them
  with the energy, resample one with probability ∝ exp(-E), optionally ∝ exp(-E) P_LM / q (the
  untruncated joint model as target, on the support top-k can reach). main runs it on every
  batch of prefixes whose n samples fit in --max_rows, and reports the effective sample size
  (Kish) that says when the weights collapse. Where they do not fit (the paper's n = 10^4), main
  says so in one line and hands over to energy.joint_sample: the same draw in chunks with a
  running Gumbel-max choice, in bounded memory, tested equal to algorithm_1.
- topk_autoregressive (Appendix A.1, Eq. 5 token by token): at each step, the LM's top 128 next
  tokens reweighted by Z(x_<=t) estimated with m LM samples of the rest, the top 10 of them
  renormalised. Expensive by design; also gives the Table-3 view of the next-token distribution
  under the LM and the joint model.

    python sample.py --lm out/lm/best.pt --energy out/bit/best.pt --prompt "ROMEO:" --num_samples 1000
    python sample.py --lm out/lm/best.pt --energy out/bit/best.pt --split test --num_prefixes 4

Prints BASE LM / JOINT / WORST / GOLD continuations per prefix (the paper's Tables 5-6), n-gram
uniqueness (Fig. 2 right) and LM log-likelihoods (Fig. 3) of real, LM and joint text; JSON too.
"""

import math
import sys

import numpy as np
import torch

from data import SPLITS, check_fits, load_split, window_tokens, windows
from energy import (gumbel_keys, joint_sample, load_any_energy, sample_log_weights, score,
                    score_continuations)  # load_any_energy: an NCE energy or an extension's
from data import load_lm_and_data
from plumbing import (TIME_LIMIT_S, ArgumentParser, Precision, common_flags, duration, guards, precision,
                      progress, rng, run_main, setup, write_json)
from data.tokenizer import load_tokenizer


@torch.no_grad()
def algorithm_1(lm, energy, prefix, n, gen_len, top_k=10, generator=None, correct_proposal=False,
                amp=Precision()):
    """Algorithm 1 (Section 3.3) for each row of prefix (B, P), its n samples all in memory: draw
    n continuations x from the top-k LM, score them with the energy, resample one with
    probability softmax(-E) over the n (with correct_proposal softmax(-E + log P_LM - log q)).
    Returns the drawn continuations (B, L), and what they were drawn from: their index i (B,)
    among the samples x (B, n, L), the energies E and log-weights (B, n) of the samples. amp: the
    Precision of the LM's sampling and the energy's scoring."""
    B, P = prefix.shape
    with amp.lm:
        x, logp, logq = lm.generate(prefix, gen_len, num_samples=n, top_k=top_k, return_proposal=True,
                                    generator=generator, max_rows=B * n)  # (B, n, L)
    E = score_continuations(energy, prefix, x, P, amp.energy, B * n)  # (B, n)
    log_w = -E + (logp.sum(-1) - logq.sum(-1)).double() if correct_proposal else -E
    i = gumbel_keys(log_w, generator).argmax(1)  # a draw ∝ exp(log_w), as joint_sample draws it
    return x[torch.arange(B, device=x.device), i], i, x, E, log_w


def draw(lm, energy, pre, args, g, amp):
    """The joint, worst (highest E) and base (first) of the n samples of each prefix of pre (B, P),
    their energies, and the Kish ESS (sum w)^2 / sum w^2 of the weights: by algorithm_1 where the
    B n samples fit in --max_rows, else by its chunked twin energy.joint_sample."""
    top_k = args.top_k or None
    if pre.size(0) * args.n > args.max_rows:
        return joint_sample(lm, energy, pre, args.n, args.gen_len, top_k, args.correct_proposal, g, amp,
                            args.max_rows)
    joint, i, x, E, log_w = algorithm_1(lm, energy, pre, args.n, args.gen_len, top_k, g,
                                        args.correct_proposal, amp)
    rows, worst = torch.arange(pre.size(0), device=x.device), E.argmax(1)
    return dict(joint=joint, joint_energy=E[rows, i], worst=x[rows, worst], worst_energy=E[rows, worst],
                base=x[:, 0], base_energy=E[:, 0],
                ess=torch.exp(2 * log_w.logsumexp(1) - (2 * log_w).logsumexp(1)))


@torch.no_grad()
def next_token_table(lm, energy, prefix, gen_len, candidates, keep, m, amp, generator, max_rows=256,
                     prefix_len=None):
    """The joint model's next-token distribution of Appendix A.1 (Table 3) for each row of prefix
    (B, P): "we further approximate it by only considering the top 128 words predicted by BASE LM,
    where we sample 10,000 completions for each of them to estimate P(x_t|x_<t). Then we take the
    top 10 entries and re-normalize". By Eq. 5, P(v|x) = P_LM(v|x) Z(x, v) / Z(x); Z(x) is common
    to all v and cancels in the renormalisation, so only Z(x, v) = E_r[exp(-E(x, v, r))] of each
    of the LM's top `candidates` tokens v (all V if fewer) is estimated, as the plain Monte Carlo
    mean over m LM completions r of the gen_len - 1 tokens still to come (exactly exp(-E(x, v))
    when v is the last token). The `keep` tokens with the largest P_LM(v|x) Z(x, v) are
    renormalised: p_joint sums to 1 over them by construction.
    Returns (tokens, p_lm, p_joint), each (B, keep), ordered by p_joint; p_lm is P_LM(v|x) itself.
    prefix_len: where the energy's prefix ends (default P: no continuation token fixed yet)."""
    B, P = prefix.shape
    candidates = min(candidates, lm.config.vocab_size)
    if not (1 <= keep <= candidates and m >= 1):
        raise ValueError(f"need 1 <= keep ({keep}) <= candidates ({candidates}, at most the vocabulary) "
                         f"and m ({m}) >= 1")
    prefix_len = P if prefix_len is None else prefix_len
    with amp.lm:
        logp = torch.log_softmax(lm.logits(prefix, from_pos=P - 1)[:, -1].double(), -1)  # (B, V)
    cand_lp, cand_v = logp.topk(candidates, dim=-1)  # (B, C)
    if gen_len == 1:
        log_z = -score_continuations(energy, prefix, cand_v[..., None], prefix_len, amp.energy,
                                     max_rows)  # (B, C)
    else:  # groups small enough that every generate call draws >= min(m, 16) completions per prompt:
        # the prompts' forward, shared by their completions, stays a small part of the work
        x = torch.cat([prefix.repeat_interleave(candidates, 0), cand_v.reshape(-1, 1)], dim=1)  # (B*C, P+1)
        group = max(1, max_rows // min(m, 16))
        log_z = []
        for rows in x.split(group):
            log_w = sample_log_weights(lm, [energy], rows, gen_len - 1, m, amp, generator, max_rows,
                                       prefix_len)[0]  # (rows, m)
            log_z.append(log_w.logsumexp(-1) - math.log(m))  # the Monte Carlo mean, in log space
        log_z = torch.cat(log_z)  # (B*C,)
    top, i = (cand_lp + log_z.view(B, candidates)).topk(keep, dim=-1)
    return cand_v.gather(1, i), cand_lp.gather(1, i).exp(), torch.softmax(top, -1)


@torch.no_grad()
def topk_autoregressive(lm, energy, prefix, gen_len, candidates, keep, m, amp, generator, max_rows=256):
    """Appendix A.1: the joint model factorised token by token (Eq. 5), each token drawn from
    next_token_table's `keep` renormalised entries among the LM's top `candidates`, every Z from
    m LM completions of the rest. Expensive by design: candidates * m completions per token."""
    x = prefix
    for t in range(gen_len):
        v, _, p_joint = next_token_table(lm, energy, x, gen_len - t, candidates, keep, m, amp, generator,
                                         max_rows, prefix.size(1))
        i = torch.multinomial(p_joint.float(), 1, generator=generator)
        x = torch.cat([x, v.gather(1, i)], dim=1)
    return x[:, prefix.size(1):]


# -----------------------------------------------------------------------------
# analyses

def unique_ngrams(texts, n):
    """Percentage of distinct word n-grams among all word n-grams of the texts (Fig. 2 right)."""
    grams = [tuple(w[i:i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return 100.0 * len(set(grams)) / len(grams) if grams else None  # None: no n-gram (JSON has no NaN)


FORCE_HELP = (f'replace --out if it exists; run sampling estimated (crudely, guards.check_sampling_time) to '
              f'take more than {duration(TIME_LIMIT_S)}, which is refused without it')


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/best.pt', help='the base LM (train_lm.py best.pt)')
    a('--energy', default='out/bit/best.pt', help="the joint model's energy (nce_train.py best.pt)")
    a('--prompt', default=None, help='a text prompt (else prefixes of --split)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--split', default='test', choices=SPLITS, help='the split whose prefixes are continued')
    a('--num_prefixes', type=int, default=4, at_least=1, at_most='count',
      help='prefixes of --split (evenly spaced)')
    a('--chunk', type=int, default=8, at_least=1, at_most='count',
      help='prefixes per batch (their samples share each LM/energy call)')
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='tokens of each prefix')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='tokens of each continuation')
    a('--num_samples', dest='n', type=int, default=100, at_least=1, at_most=None,  # in chunks: time-bound
      help='LM samples per prefix to resample from (Algorithm 1; the paper: 10,000)')
    a('--top_k', type=int, default=10, at_least=0, at_most=None,
      help='top-k of the LM proposal (0: untruncated)')
    a('--correct_proposal', action='store_true',
      help='weights exp(-E) P_LM/q: target the untruncated joint model')
    a('--autoregressive', action='store_true',
      help='also top-k auto-regressive joint sampling (Appendix A.1; slow)')
    a('--candidates', type=int, default=128, at_least=1, at_most=None,
      help='A.1: the LM\'s top next tokens whose Z is estimated (the paper: 128)')
    a('--keep', type=int, default=10, at_least=1, at_most=None,
      help='A.1: the top entries kept after reweighting and renormalised (the paper: 10)')
    a('--candidate_samples', dest='m', type=int, default=32, at_least=2, at_most='samples',
      help='A.1: LM completions per candidate\'s Z estimate (a log Z bound: at least 2), for '
           '--autoregressive and the Table-3 view (the paper: 10,000)')
    a('--table_k', type=int, default=5, at_least=0, at_most=None,
      help='Table-3 view: the first of the kept next tokens shown (0: off; the paper: 5)')
    a('--table_prefixes', type=int, default=4, at_least=0, at_most='count',
      help='Table-3 view for the first this many prefixes only (each costs candidates x candidate_samples '
           'LM samples)')
    a('--logz_samples', type=int, default=0, at_least=0, at_most='samples',
      help="untruncated LM samples per prefix for log Z (Eq. 4's lower bound T_n), "
           "which puts the joint model's log-likelihoods (Fig. 3 right) on an absolute scale (0: off)")
    a('--print_prefixes', type=int, default=8, at_least=0, at_most='count',
      help='print the samples of the first this many prefixes')
    a('--max_rows', type=int, default=512, at_least=1, at_most='count',
      help='sequences per forward (bounds memory)')
    a('--out', default='out/samples.json', help='the JSON of the samples')
    common_flags(p, 'force', 'device', 'deterministic', 'dtype', 'seed', 'quiet', help=dict(
        force=FORCE_HELP, dtype='autocast dtype of sampling and of scoring (auto: from the hardware and the '
                                'widths)'))
    return p.parse_args(argv)


def main(argv=None):
    args = guards.check_sample_flags(get_args(argv))  # every flag, and the memory its sizes need
    device = setup(args.device, args.deterministic)[2]
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    energy, _ = load_any_energy(args.energy, args.lm, device)
    dtype, on_lm = precision(device, args.dtype, 'sample', width=lm.config.n_embd)
    edtype, on_energy = precision(device, args.dtype, 'score', width=energy.config.n_embd)
    amp = Precision(lm=on_lm, energy=on_energy)
    tok = load_tokenizer(meta)
    guards.check_sample_vocab(args, lm.config.vocab_size)
    if args.prompt is not None:
        ids = tok.encode(args.prompt)
        guards.check_prompt(ids)
        prefixes, gold = torch.tensor([ids]), None
    else:
        data = load_split(data_dir, args.split, meta)
        offsets = windows(data, args.prefix_len, args.gen_len, max_windows=args.num_prefixes)
        guards.check_prefix_count(args, offsets, len(windows(data, args.prefix_len, args.gen_len)))
        x = window_tokens(data, offsets, args.prefix_len + args.gen_len)
        prefixes, gold = x[:, :args.prefix_len], x[:, args.prefix_len:]
    check_fits(prefixes.size(1) + args.gen_len, {'LM': lm, 'energy': energy})
    guards.check_sampling_time(lm, energy, *prefixes.shape, args, device)  # beyond an hour: --force
    g = rng(args.seed, 'joint_samples', args.split, 0, device)
    prefixes = prefixes.to(device)
    B = min(args.chunk, prefixes.size(0))
    if B * args.n > args.max_rows:
        print(f"n = {args.n} samples x {B} prefixes do not fit in --max_rows {args.max_rows}: "
              "Algorithm 1 in chunks (energy.joint_sample, tested equal to algorithm_1)", file=sys.stderr)
    results = []
    for s in progress(range(0, prefixes.size(0), args.chunk), quiet=args.quiet, desc='joint sampling'):
        results += joint_records(lm, energy, prefixes[s:s + args.chunk],
                                 None if gold is None else gold[s:s + args.chunk], s, args, tok, g, amp)
    report = dict(args=vars(args), dtype=dict(sample=dtype, score=edtype), samples=results,
                  **analyses(results))
    write_json(report, args.out)  # before the screen: `| head` ending the printing loses nothing
    for rec in results[:args.print_prefixes]:
        print_record(rec)
    print("unique n-grams % (n=1..4): "
          + '; '.join(f"{k} " + ' '.join('-' if v is None else f'{v:.1f}' for v in vals)
                      for k, vals in report['unique_ngrams'].items()))
    print("mean LM log-likelihood: " + ', '.join(f'{k} {v:.2f}' for k, v in report['mean_lm_logp'].items()) +
          f"; -> {args.out}")
    return report


def joint_records(lm, energy, pre, gold, first, args, tok, g, amp):
    """The records of a batch of prefixes pre (B, P) (gold: their real continuations (B, L) or None):
    Algorithm 1's joint, base and worst samples and, for Figs. 2-3, each kind of continuation's
    log-likelihood under the LM and log Z by T_n (Eq. 4); the Table-3 view for the first prefixes."""
    out = draw(lm, energy, pre, args, g, amp)
    cont = {name: out[name] for name in ('base', 'joint')}
    if gold is not None:
        cont['gold'] = gold.to(pre.device)
        gold_energy = score(energy, torch.cat([pre, cont['gold']], 1), pre.size(1), amp.energy)
    if args.autoregressive:
        cont['autoregressive'] = topk_autoregressive(lm, energy, pre, args.gen_len, args.candidates,
                                                     args.keep, args.m, amp, g, args.max_rows)
    with amp.lm:  # Fig. 3: log-likelihood under the base LM of each kind of continuation
        lm_logp = {name: lm.sequence_logprob(torch.cat([pre, t], 1), pre.size(1)) for name, t in cont.items()}
    if args.logz_samples:  # Fig. 3 right: log P_joint = log P_LM - E - log Z
        log_w = sample_log_weights(lm, [energy], pre, args.gen_len, args.logz_samples, amp, g,
                                   args.max_rows)[0]
        logz = torch.logsumexp(log_w, 1) - math.log(args.logz_samples)  # T_n, Eq. 4
    recs = []
    for b in range(pre.size(0)):
        rec = dict(prefix=tok.decode(pre[b].tolist()), ess=out['ess'][b].item(), n=args.n,
                   **{name: tok.decode(t[b].tolist()) for name, t in cont.items()},
                   **{f'{name}_energy': out[f'{name}_energy'][b].item()
                      for name in ('base', 'joint', 'worst')},
                   worst=tok.decode(out['worst'][b].tolist()),
                   lm_logp={name: v[b].item() for name, v in lm_logp.items()})
        if gold is not None:
            rec['gold_energy'] = gold_energy[b].item()
        if args.logz_samples:
            rec['logz'] = logz[b].item()
        if args.table_k and first + b < args.table_prefixes:
            v, p_lm, p_joint = next_token_table(lm, energy, pre[b:b + 1], args.gen_len, args.candidates,
                                                args.keep, args.m, amp, g, args.max_rows)
            rec['next_tokens'] = [dict(token=tok.decode([t]), p_lm=a, p_joint=c) for t, a, c in
                                  zip(v[0, :args.table_k].tolist(), p_lm[0, :args.table_k].tolist(),
                                      p_joint[0, :args.table_k].tolist())]
        recs.append(rec)
    return recs


def analyses(results):
    """Fig. 2 right (unique n-grams) and Fig. 3 (LM log-likelihood of each kind of continuation)."""
    kinds = [k for k in ('gold', 'base', 'joint', 'autoregressive') if k in results[0]]
    uniq = {k: [unique_ngrams([r[k] for r in results], n) for n in range(1, 5)] for k in kinds}
    mean_lp = {k: float(np.mean([r['lm_logp'][k] for r in results])) for k in results[0]['lm_logp']}
    diff = {f'{a}-{b}': mean_lp[a] - mean_lp[b] for a, b in (('base', 'gold'), ('joint', 'gold'))
            if a in mean_lp and b in mean_lp}
    return dict(unique_ngrams=uniq, mean_lm_logp=mean_lp, mean_lm_logp_diff=diff)


def print_record(rec):
    print(f"\n=== PREFIX ===\n{rec['prefix']}")
    for name in ('base', 'joint', 'worst', 'gold', 'autoregressive'):
        if name in rec:
            e = rec.get(f'{name}_energy')
            print(f"--- {name.upper()}{'' if e is None else f' (E = {e:.3f})'}:\n{rec[name]}")
    print(f"(ESS {rec['ess']:.1f} of n = {rec['n']})")
    if 'next_tokens' in rec:
        print("next token    P_LM   P_joint")
        for t in rec['next_tokens']:
            print(f"{t['token']!r:<12} {t['p_lm']:.3f}  {t['p_joint']:.3f}")


if __name__ == '__main__':
    run_main(main)

"""
Accuracy with a known answer (data/addition/prepare.py): how often each model writes the correct
sum of a test problem, and how much probability it puts on it.

- BASE LM and every --extra_lm (BALM, an EXO-distilled LM from extensions/exo.py, TaiLr): greedy
  (temperature 0) and one untruncated sample; the exact probability of the correct sum,
  exp log P_LM(c | x); and, at each n of --ns, decoders that choose among the first n of max(ns)
  samples of that LM (untruncated, or its top-k with --top_k): majority vote (the most frequent
  continuation; a tie goes to the one that occurs first among the n), reranking by the LM's
  log-probability (argmax log P_LM, the protocol of verifier papers, Cobbe et al. 2021), and the
  best-of-n oracle (any of the n correct; its best per-digit accuracy).
- JOINT (the LM reweighted by --energy, Eq. 2 of Deng et al., ICLR 2020), among the same first n
  samples of the base LM: Algorithm 1 (Section 3.3), one resampled ∝ exp(-E) (Gumbel-max, as
  sample.algorithm_1 and energy.joint_sample draw it), and the joint model's mode among them,
  argmax log P_LM - E; each row also holds the oracle of those samples. Its probability on the
  correct sum c, P_LM(c|x) exp(-E(x, c)) / Z(x), an estimate: log Z by energy.logz_enumerate, every
  distinct continuation among c, the LM's --beam most likely ones (with --edits, every one-token edit
  of the first ones too) and max(ns) untruncated samples scored exactly, the rest estimated
  (unbiased in Z; never above 1, as c is in the scored set).
  Beside it Eq. 4's range (energy.logz_bounds) with its diagnostics (energy.logz_diagnostics): the
  share of problems where it is flagged (too few effective samples, or provably below log Z), and
  the range's mean only where none is; a sharp energy pushes Eq. 4 past 1, which is never printed.
  The energy scores each distinct continuation of a problem once.

Accuracy: exact match (every digit and the end of text) and per-digit (the N + 1 sum digits),
means over --num_prefixes test problems with their standard errors. Cost: LM samples per answer
(greedy: 1), the x-axis of the figure (--plot). Writes --out (JSON, with every problem's outcome of
every decoder under 'per_problem', so that paired tests can be recomputed: job/claims.py) and a
table beside it (.txt).

    python -m extensions.addition_eval --lm out-addition/lm/best.pt --energy out-addition/bit/best.pt \\
        --extra_lm BALM=out-addition/balm/best.pt EXO=out-addition/exo/best.pt --out out-addition/acc.json
"""

import math
import os
import sys
from contextlib import nullcontext

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.addition_eval")
import torch

from data import SPLITS, check_fits, load_lm_and_data, load_split, window_tokens, windows
from energy import (distinct_ids, first_occurrences, gumbel_keys, load_any_energy, logz_bounds,
                    logz_diagnostics, logz_enumerate, score_continuations)
from extensions.carry import answer_layout, carry_chains, exact_by, lookahead, plot_carry
from extensions.enumeration import one_token_edits
import extensions.metrics  # noqa: F401  registers the metric energy's loader (--energy)
from model import load_lm
from plumbing import (ArgumentParser, atomic_write, check_new, check_writable, comma_ints, common_flags,
                      named_paths, rng, run_main, setup, write_json, write_text)


def scores(pred, gold):
    """pred (B, k, L), gold (B, L) -> exact match (B, k) (every token, end of text included) and
    per-digit accuracy (B, k) over the L - 1 answer digits."""
    hit = pred == gold[:, None]
    return hit.all(-1).double(), hit[..., :-1].double().mean(-1)


def mean_se(x):
    """(mean, standard error) of a 1-d tensor of per-problem values."""
    x = x.double()
    return x.mean().item(), (x.std() / math.sqrt(len(x))).item() if len(x) > 1 else float('nan')


def distinct(x):
    """Samples x (B, m, L) -> ids (B, m), equal exactly where two samples of one problem are the
    same continuation (ids are unique across problems), and first (U,): for each id, the
    flat index (into B * m) of its first sample."""
    ids = distinct_ids(x)
    return ids, first_occurrences(ids)


def majority_vote(ids):
    """ids (B, n) of distinct() -> (B,) the index of a most frequent continuation among the n; a tie
    goes to the continuation that occurs first (argmax returns the first maximum, and the
    first sample with the top count is the first occurrence of the earliest tied continuation)."""
    count = torch.bincount(ids.flatten())[ids]  # (B, n): how often each sample's continuation occurs
    return count.argmax(1)


def lm_decoders(x, logp, gold, ns):
    """Per-problem columns of an LM's decoders among the first n of its samples x (B, m, L) with
    log P_LM logp (B, m), for each n of ns: majority vote, reranking by the LM's log-probability
    (argmax log P_LM, the protocol of verifier papers, Cobbe et al. 2021), the best-of-n oracle
    (any of the n correct; its best per-digit accuracy)."""
    ex, dg = scores(x, gold)
    ids, rows, out = distinct(x)[0], torch.arange(x.size(0), device=x.device), {}
    for n in ns:
        for how, i in (('majority', majority_vote(ids[:, :n])), ('rerank', logp[:, :n].argmax(1))):
            out[f'{how}_{n}_exact'], out[f'{how}_{n}_digit'] = ex[rows, i], dg[rows, i]
        out[f'oracle_{n}_exact'], out[f'oracle_{n}_digit'] = ex[:, :n].amax(1), dg[:, :n].amax(1)
    return out


def joint_decoders(x, logp, E, gold, ns, g):
    """Per-problem columns of the joint model's decoders among the first n of the LM's samples x
    (B, m, L), log P_LM logp (B, m) and energies E (B, m), for each n of ns: Algorithm 1 of Deng et
    al. (2020), one sample resampled ∝ exp(-E) (Gumbel-max, as sample.algorithm_1 and
    energy.joint_sample draw it), and the joint model's mode among the samples, argmax
    log P_LM - E (Eq. 2 up to log Z)."""
    ex, dg = scores(x, gold)
    rows, out = torch.arange(x.size(0), device=x.device), {}
    for n in ns:
        for how, i in (('a1', gumbel_keys(-E[:, :n], g).argmax(1)), ('mode', (logp - E)[:, :n].argmax(1))):
            out[f'{how}_{n}_exact'], out[f'{how}_{n}_digit'] = ex[rows, i], dg[rows, i]
    return out


def beam_mode(bx, blogp, bE, x, logp, E, gold, ns):
    """The joint model's mode over more than the LM's samples: argmax log P_LM - E among the LM's
    beam (bx (B, k, L), from beam search, with its log P_LM and E) and the first n samples x, for
    each n of ns: a decoder that can pick a sum the LM's samples never proposed."""
    cand = torch.cat([bx, x], 1)
    ex, dg = scores(cand, gold)
    rows, k, out = torch.arange(x.size(0), device=x.device), bx.size(1), {}
    score = torch.cat([blogp - bE, logp - E], 1)
    for n in ns:
        i = score[:, :k + n].argmax(1)
        out[f'beam_{n}_exact'], out[f'beam_{n}_digit'] = ex[rows, i], dg[rows, i]
    return out


@torch.no_grad()
def lm_columns(lm, pre, gold, ns, top_k, g):
    """Per-problem columns of one LM: greedy and sampled exact/digit scores, log P(correct sum),
    and lm_decoders over max(ns) samples of it (top-k where top_k); also returns the samples
    and their log P_LM (untruncated), ((B, m, L), (B, m))."""
    L = gold.size(1)
    out = {}
    for how, temp in (('greedy', 0), ('sampled', 1.0)):
        ex, dg = scores(lm.generate(pre, L, temperature=temp, generator=g)[0], gold)
        out[f'{how}_exact'], out[f'{how}_digit'] = ex[:, 0], dg[:, 0]
    out['logp_correct'] = lm.sequence_logprob(torch.cat([pre, gold], 1), pre.size(1)).double()
    x, logp = lm.generate(pre, L, num_samples=max(ns), top_k=top_k or None, generator=g)
    logp = logp.double().sum(-1)
    out.update(lm_decoders(x, logp, gold, ns))
    return out, (x, logp)


def energies(energy, pre, x, P):
    """E (B, m) of the samples x (B, m, L) of the prompts pre (B, P): each distinct continuation of
    a problem scored once (on addition most samples repeat the sum)."""
    B, m, L = x.shape
    ids, first = distinct(x)
    e = score_continuations(energy, pre[first // m], x.reshape(B * m, L)[first, None], P, nullcontext())
    return e[:, 0][ids]


@torch.no_grad()
def joint_columns(lm, energy, pre, gold, samples, ns, top_k, g, beam, edits=0):
    """Per-problem columns of the joint model: joint_decoders over the base LM's samples (x,
    logp) = samples, the best-of-n oracle of those samples, log P_joint(correct sum) (Eq. 2) with
    log Z by logz_enumerate (the correct sum and the LM's `beam` most likely continuations known,
    max(ns) untruncated samples; with `edits`, every one-token edit of the beam's first `edits` too),
    and Eq. 4's range of it with its diagnostics."""
    (P, L), (x, logp) = (pre.size(1), gold.size(1)), samples
    E = energies(energy, pre, x, P)
    out = joint_decoders(x, logp, E, gold, ns, g)
    ex, dg = scores(x, gold)
    for n in ns:
        out[f'oracle_{n}_exact'], out[f'oracle_{n}_digit'] = ex[:, :n].amax(1), dg[:, :n].amax(1)
    proposals = x, logp, E
    if top_k:  # log Z needs samples of P_LM itself
        x, logp = lm.generate(pre, L, num_samples=max(ns), generator=g)
        logp = logp.double().sum(-1)
        E = energies(energy, pre, x, P)
    known = [gold[:, None]]
    if beam:  # the edits: where an energy's favourites off the LM's samples lie (docs/exact_logz.md)
        bx = lm.beam_search(pre, L, beam)[0]
        known += [bx, one_token_edits(bx[:, :edits], lm.config.vocab_size)]
    known = torch.cat(known, 1)  # (B, k, L): fixed before sampling
    rows = torch.cat([pre[:, None].expand(-1, known.size(1), -1), known], 2).flatten(0, 1)
    logp_known = torch.cat([lm.sequence_logprob(r, P) for r in rows.split(4096)]).double()
    logp_known = logp_known.view(known.shape[:2])
    e_known = energies(energy, pre, known, P)
    if beam:  # the beam (the correct sum, known[:, 0], left out) beside the samples
        b = slice(1, 1 + beam)
        out.update(beam_mode(known[:, b], logp_known[:, b], e_known[:, b], *proposals, gold, ns))
    log_a = logp_known[:, 0] - e_known[:, 0]  # the correct sum's term of Z
    z = logz_enumerate(torch.cat([known, x], 1), torch.cat([logp_known, logp], 1),
                       -torch.cat([e_known, E], 1), known=known.size(1))
    z_low, z_high = logz_bounds(-E)
    diag = logz_diagnostics(-E, z['sure'])
    # a probability is at most 1: Eq. 4's low end raised to the sure lower bound of log Z
    out['logp_correct_low'], out['logp_correct_high'] = (log_a - torch.maximum(z_high, z['sure']),
                                                         log_a - torch.maximum(z_low, z['sure']))
    out['logp_correct'] = log_a - z['estimate']
    out['eq4_flagged'], out['eq4_ess'], out['scored_mass'] = diag['flagged'].double(), diag['ess'], z['mass']
    return out


def kept_columns(n):
    """The per-problem columns the JSON keeps (what the paired tests and P(correct) need): exact match of
    greedy, one sample and each decoder at the largest n, and the probabilities of the correct sum."""
    decoders = [f'{how}_{n}_exact' for how in list(LM_DECODERS) + list(JOINT_DECODERS)]
    return {'greedy_exact', 'sampled_exact', *decoders, 'logp_correct', 'logp_correct_low',
            'logp_correct_high', 'eq4_flagged'}


def eq4_summary(cols):
    """Eq. 4's P(correct) range as a result only where it holds on every problem: the share of problems
    whose range logz_diagnostics flags, the mean ESS, and the range's mean where none is flagged (else
    None: the unflagged problems are no random subset, e.g. those whose samples hold c more often than
    P_LM(c)); the LM's mass that logz_enumerate scored exactly."""
    ok = not cols['eq4_flagged'].any()
    mean = lambda k: cols[k].exp().mean().item() if ok else None
    return dict(eq4_flagged=cols['eq4_flagged'].mean().item(), eq4_ess=cols['eq4_ess'].mean().item(),
                p_correct_low=mean('logp_correct_low'), p_correct_high=mean('logp_correct_high'),
                scored_mass=cols['scored_mass'].mean().item())


LM_DECODERS = {'majority': 'majority vote', 'rerank': 'log-prob rerank', 'oracle': 'oracle'}
JOINT_DECODERS = {'a1': 'Algorithm 1', 'mode': 'joint mode', 'beam': 'joint mode, beam + samples'}


def rows_of(name, cols, ns, params, beam=0):
    """The table's rows (dicts) from per-problem columns: an LM's greedy, sampled and each of
    LM_DECODERS at each n; the joint model's JOINT_DECODERS at each n, each row with the
    best-of-n oracle of its samples, P(correct sum) (logp_correct_known) and its range by Eq. 4."""
    def acc(prefix):
        (e, e_se), (d, d_se) = mean_se(cols[f'{prefix}_exact']), mean_se(cols[f'{prefix}_digit'])
        return dict(exact=e, exact_se=e_se, digit=d, digit_se=d_se)

    p, p_se = mean_se(cols['logp_correct'].exp())
    if name == 'JOINT':
        return [dict(model=name, method=f'{method}, n = {n}', n=n, lm_samples=n, params=params,
                     **({'beam': beam} if key == 'beam' else {}), **acc(f'{key}_{n}'),
                     oracle_exact=mean_se(cols[f'oracle_{n}_exact'])[0],
                     oracle_digit=mean_se(cols[f'oracle_{n}_digit'])[0], p_correct=p, p_correct_se=p_se,
                     p_correct_estimator='logz_enumerate', **eq4_summary(cols))
                for key, method in JOINT_DECODERS.items() for n in ns if f'{key}_{n}_exact' in cols]
    return ([dict(model=name, method=how, n=1, lm_samples=1, params=params, **acc(how), p_correct=p,
                  p_correct_se=p_se) for how in ('greedy', 'sampled')] +
            [dict(model=name, method=f'{method}, n = {n}', n=n, lm_samples=n, params=params,
                  **acc(f'{key}_{n}'), p_correct=p, p_correct_se=p_se)
             for key, method in LM_DECODERS.items() for n in ns])


def format_table(rows):
    lines = [f"{'model':<10} {'method':<24} {'LM samples':>10} {'exact (SE)':>16} {'per digit (SE)':>16} "
             f"{'oracle exact':>12} {'P(correct) (SE)':>16} {'Eq. 4 range':>13}"]
    for r in rows:
        p = f"{r['p_correct']:.3f} ({r['p_correct_se']:.3f})"
        if 'eq4_flagged' in r:
            p += (f" {r['p_correct_low']:>6.3f}-{r['p_correct_high']:.3f}" if r['p_correct_low'] is not None
                  else f"  flagged on {100 * r['eq4_flagged']:.0f}% of problems: no range")
        oracle = f"{r['oracle_exact']:.3f}" if 'oracle_exact' in r else ''
        lines.append(f"{r['model']:<10} {r['method']:<24} {r['lm_samples']:>10} "
                     f"{r['exact']:>8.3f} ({r['exact_se']:.3f}) {r['digit']:>8.3f} ({r['digit_se']:.3f}) "
                     f"{oracle:>12} {p}")
    if any('eq4_flagged' in r for r in rows):
        lines.append("JOINT P(correct): an estimate, log Z by energy.logz_enumerate (every distinct "
                     "continuation seen scored exactly, the rest estimated); Eq. 4's range only where "
                     "logz_diagnostics flags it on no problem")
    return '\n'.join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', required=True, help='the base LM (train_lm.py best.pt)')
    a('--energy', default=None,
      help="the joint model's energy (nce_train.py best.pt or metric_ebm.py energy.pt)")
    a('--extra_lm', nargs='*', default=[], metavar='NAME=PATH', help='more LMs: BALM, EXO, ...')
    a('--data_dir', default=None, help="default: the data the LM was trained on")
    a('--split', default='test', choices=SPLITS, help='the split scored (val and test are only reported)')
    a('--num_prefixes', type=int, default=1000, at_least=1, at_most='count',
      help='problems (evenly spaced over the split)')
    a('--ns', type=comma_ints, default='1,4,16,64', at_least=1, at_most='samples',
      help='comma-separated LM samples per answer of the decoders that choose among samples')
    a('--top_k', type=int, default=0, at_least=0, at_most=None,
      help="the LMs' samples (Algorithm 1's proposal): top-k (0: untruncated)")
    a('--beam', type=int, default=32, at_least=0, at_most='beam',
      help="the LM's most likely continuations (beam search) scored exactly in log Z and decoded by the "
           "joint mode beside the samples (0: none; 32: chosen by exact Z, docs/exact_logz.md)")
    a('--edits', type=int, default=0, at_least=0, at_most='beam',
      help="log Z also scores exactly every one-token edit of the beam's first EDITS continuations "
           "(L x vocabulary each): where an energy's favourites off the LM's samples lie "
           "(docs/exact_logz.md, 8 there); not decoded")
    a('--chunk', dest='batch', type=int, default=64, at_least=1, at_most='count', help='problems per batch')
    a('--out', required=True, help='JSON results (and a .txt table beside it)')
    a('--plot', default=None, help='a PNG of accuracy against LM samples per answer, and beside it '
                                   '(<name>_carry.png) exact match by the longest carry chain and by the '
                                   'lookahead (needs matplotlib)')
    common_flags(p, 'force', 'device', 'deterministic', 'seed', 'quiet',
                 help=dict(force='replace --out', quiet='no table printed (it is still written)'))
    args = p.parse_args(argv)
    if not args.ns or (args.energy and args.ns[-1] < 2):  # each within the declared bounds
        raise ValueError(f"--ns {args.ns}: the largest at least 2 (log Z needs 2 samples)")
    clash = {'BASE LM', 'JOINT'} & set(named_paths(args.extra_lm, '--extra_lm'))
    if clash:
        raise ValueError(f"--extra_lm {clash.pop()}=...: that name is the table's own; "
                         "give the model another")
    check_writable(args.out, '--out', folder=False)
    check_new(args.out, '--out', args.force)
    if args.plot is not None:  # refused before --out is written
        check_writable(args.plot, '--plot', folder=False)
        check_new(args.plot, '--plot', args.force)
        check_new(carry_plot(args.plot), '--plot', args.force)
    return args


def main(argv=None):
    args = get_args(argv)
    device = setup(args.device, args.deterministic)[2]
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    lms = {'BASE LM': lm}
    lms.update({name: load_lm(path, device, meta)[0]
                for name, path in named_paths(args.extra_lm, '--extra_lm').items()})
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
            c, samples = lm_columns(model, pre, gold, args.ns, args.top_k,
                                    rng(args.seed, f'addition {name}', args.split, b, device))
            cols[name].append(c)
            if energy and name == 'BASE LM':  # the joint model chooses among the base LM's samples
                cols['JOINT'].append(joint_columns(lm, energy, pre, gold, samples, args.ns, args.top_k,
                                                   rng(args.seed, 'addition joint', args.split, b, device),
                                                   args.beam, args.edits))
    rows, per_problem = [], {}
    for name, parts in cols.items():
        merged = {k: torch.cat([c[k] for c in parts]).cpu() for k in parts[0]}
        params = (lm if name == 'JOINT' else lms[name]).num_params() + (
            sum(p.numel() for p in energy.parameters()) if name == 'JOINT' else 0)
        rows += rows_of(name, merged, args.ns, params, args.beam)
        per_problem[name] = {k: [round(v, 6) for v in c.tolist()] for k, c in merged.items()
                             if k in kept_columns(args.ns[-1])}
    chains, ahead = carry_chains(x[:, :P], meta), lookahead(x[:, :P], meta)
    res = dict(split=args.split, num_prefixes=len(offsets), prefix_len=P, gen_len=L, ns=args.ns,
               top_k=args.top_k, beam=args.beam, edits=args.edits, lm=args.lm, energy=args.energy,
               extra_lm=args.extra_lm, seed=args.seed, rows=rows, carry_chain=chains.tolist(),
               by_carry_chain=exact_by(chains, per_problem), lookahead=ahead.tolist(),
               by_lookahead=exact_by(ahead, per_problem), per_problem=per_problem)
    write_json(res, args.out)
    table = format_table(rows)
    write_text(table + '\n', os.path.splitext(args.out)[0] + '.txt')
    if not args.quiet:
        print(table)
    if args.plot:
        plot(rows, args.plot, args.split)
        plot_carry(res, carry_plot(args.plot))


def plot(rows, path, split='test'):
    """Exact match against LM samples per answer: each LM's greedy and one sample as points, and a
    curve over n for each decoder that chooses among n samples (an LM's majority vote, log-prob
    rerank and best-of-n oracle; the joint model's Algorithm 1 and mode), a color per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    models = list(dict.fromkeys(r['model'] for r in rows))
    color = {m: f'C{i}' for i, m in enumerate(models)}
    style = {'majority vote': 's-', 'log-prob rerank': '^--', 'oracle': '.:', 'Algorithm 1': 'o-',
             'joint mode': 'D-.', 'joint mode, beam + samples': 'P-'}
    curves = {}
    for r in rows:
        method = r['method'].split(', n = ')[0]
        if method in style:
            curves.setdefault((r['model'], method), []).append((r['n'], r['exact']))
        else:
            ax.plot(1, r['exact'], 'v' if method == 'greedy' else 'x', color=color[r['model']],
                    label=f"{r['model']} ({method})")
    for (model, method), pts in curves.items():
        ax.plot(*zip(*pts), style[method], color=color[model], markersize=4, label=f'{model} {method}')
    ax.set_xscale('log')
    ax.set_xlabel('LM samples per answer')
    ax.set_ylabel(f'exact match ({split})')
    ax.legend(fontsize=6, loc='center left', bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    plt.close(fig)


def carry_plot(path):
    return os.path.splitext(path)[0] + '_carry.png'


if __name__ == '__main__':
    run_main(main)

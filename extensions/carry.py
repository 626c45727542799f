"""Carry chains in N-digit addition (data/addition): each problem's longest carry chain, what an LM
must compute ahead to write the sum's leading digits; exact match grouped by it, and its figure.
extensions/addition_eval.py groups one run's decoders by it; job/seeds.py the mean over seeds.
"""

import torch

from plumbing import atomic_write


def carry_chains(pre, meta):
    """The longest carry chain of each problem (B,) of prompts `a+b=` (token ids): the most
    consecutive digit positions whose column carries out, from the least significant (999+1: 3,
    909+1: 1, 1+1: 0): what an LM must compute ahead to write the sum's leading digits."""
    text = [''.join(meta['chars'][i - 1] for i in p.tolist() if i) for p in pre.cpu()]
    out = []
    for t in text:
        a, b = t.rstrip('=').split('+')
        carry, run, best = 0, 0, 0
        for da, db in zip(reversed(a), reversed(b), strict=True):
            carry = int(int(da) + int(db) + carry >= 10)
            run = run + 1 if carry else 0
            best = max(best, run)
        out.append(best)
    return torch.tensor(out)


def by_carry_chain(chains, per_problem):
    """Exact match of every kept decoder by the problem's longest carry chain: {model: {column:
    {chain length: mean}}}, and the count of problems at each length."""
    lengths = sorted(set(chains.tolist()))
    mean = lambda v, c: torch.tensor(v, dtype=torch.float64)[chains == c].mean().item()
    out = {name: {k: {c: mean(v, c) for c in lengths} for k, v in cols.items() if k.endswith('_exact')}
           for name, cols in per_problem.items()}
    return dict(count={c: (chains == c).sum().item() for c in lengths}, exact=out)


CARRY_CURVES = (('BASE LM', 'greedy', 'LM greedy'), ('BASE LM', 'rerank', 'LM log-prob rerank of n'),
                ('BALM', 'greedy', 'BALM greedy'), ('EXO', 'greedy', 'EXO LM greedy'),
                ('BASE LM', 'oracle', 'LM: any of n correct'), ('JOINT', 'a1', 'joint: Algorithm 1 of n'),
                ('JOINT', 'mode', 'joint: mode of n'), ('JOINT', 'beam', 'joint: mode of beam + n'))


def plot_carry(res, path):
    """Exact match by the problem's longest carry chain (res['by_carry_chain'], at the largest n):
    where the LM's decoders fail, and whether the joint model's rescue them."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    by, n = res['by_carry_chain'], max(res['ns'])
    lengths = sorted(by['count'], key=int)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for model, how, label in CARRY_CURVES:
        col = f'{how}_exact' if how == 'greedy' else f'{how}_{n}_exact'
        if col in by['exact'].get(model, {}):
            ax.plot([int(c) for c in lengths], [by['exact'][model][col][c] for c in lengths], 'o-',
                    markersize=3, label=label)
    ax.set_xlabel(f"longest carry chain (problems: {', '.join(str(by['count'][c]) for c in lengths)})")
    ax.set_ylabel(f"exact match ({res['split']}, n = {n})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    plt.close(fig)

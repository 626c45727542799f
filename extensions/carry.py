"""Carry chains and lookahead in N-digit addition (data/addition). A problem's longest carry chain
counts the carries it makes; its lookahead, how far to the right a left-to-right LM must read to
decide a digit of the sum (a run of columns summing to 9 passes a carry on, so the decision waits for
the first column past it): the runs of 9 are what data/addition/prepare.py's --chain makes frequent.
Exact match grouped by either, its table and its figure; extensions/addition_eval.py groups one run's
decoders by them, job/seeds.py takes the mean over seeds, job/lookahead.py regroups committed outcomes.
"""

import torch

from plumbing import atomic_write


def operands(pre, meta):
    """The digit strings (a, b) of each prompt `a+b=` (token ids, (B, P))."""
    text = [''.join(meta['chars'][i - 1] for i in p.tolist() if i) for p in pre.cpu()]
    return [t.rstrip('=').split('+') for t in text]


def answer_layout(data, meta):
    """(prefix_len, gen_len) of a split of fixed-length problems (data/addition/prepare.py): the
    first document up to and including '=' (the problem), and the rest with the end of text."""
    ends = (data[:4096] == meta['eot_id']).nonzero()[0]
    doc = [meta['chars'][t - 1] for t in data[:ends[0]]] if meta.get('chars') and len(ends) > 1 else []
    if '=' not in doc or ends[1] - ends[0] != ends[0] + 1:
        raise ValueError("this split does not hold fixed-length problems `a+b=c` "
                         "(data/addition/prepare.py): give the LM of an addition corpus")
    P = doc.index('=') + 1
    return P, int(ends[0]) + 1 - P


def carry_chains(pre, meta):
    """The longest carry chain of each problem (B,) of prompts `a+b=` (token ids): the most
    consecutive digit positions whose column carries out, from the least significant (999+1: 3,
    909+1: 1, 1+1: 0). It counts carries made, not the lookahead they need (below): 4999+5000
    makes none, yet its first digit waits on the units."""
    out = []
    for a, b in operands(pre, meta):
        carry, run, best = 0, 0, 0
        for da, db in zip(reversed(a), reversed(b), strict=True):
            carry = int(int(da) + int(db) + carry >= 10)
            run = run + 1 if carry else 0
            best = max(best, run)
        out.append(best)
    return torch.tensor(out)


def lookahead(pre, meta):
    """Each problem's lookahead (B,): over the digits of the sum (the leading one included), the most
    columns to its right its carry depends on. The carry into a column is that of the first column to
    its right whose digits do not sum to 9 (at least 10 carries, at most 8 does not); one summing to 9
    passes on what comes in, and nothing comes into the units. So a digit before a run of r columns
    summing to 9 waits on r + 1 columns, or r where the run ends at the units: 4999+5000: 4, 45+54: 2,
    12+34: 1 (the leading digit reads the first column)."""
    out = []
    for a, b in operands(pre, meta):
        nine = [int(da) + int(db) == 9 for da, db in zip(a, b, strict=True)]
        best = 0
        for i in range(len(nine) + 1):  # the digit of column i - 1 (i = 0: the leading digit)
            run = next((k for k, n in enumerate(nine[i:]) if not n), len(nine) - i)
            best = max(best, run + (i + run < len(nine)))
        out.append(best)
    return torch.tensor(out)


def exact_by(groups, per_problem):
    """Exact match of every kept decoder by a per-problem integer (B,), the longest carry chain or
    the lookahead: {model: {column: {value: mean}}}, and the count of problems at each value."""
    values = sorted(set(groups.tolist()))
    mean = lambda v, c: torch.tensor(v, dtype=torch.float64)[groups == c].mean().item()
    out = {name: {k: {c: mean(v, c) for c in values} for k, v in cols.items() if k.endswith('_exact')}
           for name, cols in per_problem.items()}
    return dict(count={c: (groups == c).sum().item() for c in values}, exact=out)


def carry_lines(by, name='longest carry chain'):
    """The lines of a table of exact match by the longest carry chain or the lookahead (columns: its
    values; by: exact_by's form), greedy and the decoders at the largest n (job.seeds, job.lookahead)."""
    if not by:
        return []
    values = sorted(by['count'], key=int)
    lines = [f"exact match by the {name}, mean over seeds (problems: "
             + ', '.join(f"{c}: {by['count'][c]}" for c in values) + ")"]
    for model, cols in by['exact'].items():
        for col, v in cols.items():
            if col.startswith(('greedy', 'a1', 'mode', 'beam', 'oracle')):
                lines.append(f"  {model:8s} {col:18s} " + ' '.join(f"{v[c]:.3f}" for c in values))
    return lines


CARRY_CURVES = (('BASE LM', 'greedy', 'LM greedy'), ('BASE LM', 'rerank', 'LM log-prob rerank of n'),
                ('BALM', 'greedy', 'BALM greedy'), ('EXO', 'greedy', 'EXO LM greedy'),
                ('EXO_SET_MASS', 'greedy', 'EXO over a set greedy'),  # exo_set_addition.json
                ('BASE LM', 'oracle', 'LM: any of n correct'), ('JOINT', 'a1', 'joint: Algorithm 1 of n'),
                ('JOINT', 'mode', 'joint: mode of n'), ('JOINT', 'beam', 'joint: mode of beam + n'))


GROUPINGS = (('by_carry_chain', 'longest carry chain'), ('by_lookahead', 'lookahead'))


def plot_carry(res, path):
    """Exact match by the problem's longest carry chain, and beside it by its lookahead where res has
    it (res['by_carry_chain'], res['by_lookahead'], at the largest n): where the LM's decoders fail,
    and whether the joint model's rescue them."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = [(res[key], name) for key, name in GROUPINGS if res.get(key)]
    n = max(res['ns'])
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.5), squeeze=False, sharey=True)
    for ax, (by, name) in zip(axes[0], panels):
        values = sorted(by['count'], key=int)
        for model, how, label in CARRY_CURVES:
            col = f'{how}_exact' if how == 'greedy' else f'{how}_{n}_exact'
            if col in by['exact'].get(model, {}):
                ax.plot([int(c) for c in values], [by['exact'][model][col][c] for c in values], 'o-',
                        markersize=3, label=label)
        ax.set_xlabel(f"{name} (problems: {', '.join(str(by['count'][c]) for c in values)})")
        ax.set_ylabel(f"exact match ({res['split']}, n = {n})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    plt.close(fig)

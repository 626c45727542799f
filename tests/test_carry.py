"""extensions/carry.py's lookahead against its definition by enumeration, and job.lookahead's regrouping
of committed outcomes by it (docs/addition.md, Where the LMs fail)."""

import gzip
import itertools
import json

import pytest
import torch

from data import load_meta, load_split, window_tokens, windows
from data.addition import prepare as addition_prepare
from extensions.carry import carry_chains, lookahead
from job import lookahead as regroup
from tests.common import assert_clean_error, run_script


def carry_in(a, b, i):
    """The carry into column i (0: the leading digit's, the carry out of the first column) of a + b,
    by integer arithmetic on the columns right of it."""
    n = len(a) - i
    return int(int(a[i:] or 0) + int(b[i:] or 0) >= 10 ** n) if n else 0


def lookahead_by_enumeration(a, b):
    """extensions.carry.lookahead from its definition: for each digit of the sum, the fewest columns
    to its right that fix its carry whatever the columns past them hold (each column tried as 0+0,
    4+5 and 9+9: a column's carry depends on whether it sums to at most 8, 9 or at least 10)."""
    N, best = len(a), 0
    for i in range(N + 1):  # the carry into column i, which the digit of column i - 1 depends on
        for k in range(N - i + 1):
            rest = N - i - k
            fills = itertools.product((('0', '0'), ('4', '5'), ('9', '9')), repeat=rest)
            outcomes = {carry_in(a[:i + k] + ''.join(x for x, _ in f), b[:i + k] + ''.join(y for _, y in f),
                                 i) for f in fills}
            if len(outcomes) == 1:
                best = max(best, k)
                break
    return best


def test_lookahead_against_enumeration():
    """extensions.carry.lookahead against lookahead_by_enumeration on hand cases and 300 random 4-digit
    problems with frequent 9-columns (as data/addition/prepare.py's --chain makes them)."""
    chars = '+0123456789='
    meta = dict(chars=chars)
    encode = lambda t: [chars.index(c) + 1 for c in t]
    hand = {('4999', '5000'): 4, ('0045', '0054'): 2, ('0012', '0034'): 1, ('8765', '1236'): 4,
            ('8765', '1233'): 4, ('0000', '0000'): 1, ('5000', '4000'): 2, ('0500', '0400'): 2}
    rng = torch.Generator().manual_seed(0)
    cases = list(hand)
    for _ in range(300):
        a, b = [], []
        for _ in range(4):
            x = int(torch.randint(10, (1,), generator=rng))
            y = 9 - x if torch.rand(1, generator=rng) < 0.5 else int(torch.randint(10, (1,), generator=rng))
            a.append(str(x))
            b.append(str(y))
        cases.append((''.join(a), ''.join(b)))
    got = lookahead(torch.tensor([encode(f'{a}+{b}=') for a, b in cases]), meta).tolist()
    want = [lookahead_by_enumeration(a, b) for a, b in cases]
    assert got == want
    assert [lookahead_by_enumeration(*c) for c in hand] == list(hand.values())
    assert set(want) == {1, 2, 3, 4}  # the leading digit reads at least the first column


def test_lookahead_regroups_committed_outcomes(tmp_path):
    """job.lookahead: two outcomes files of one split's problems, regrouped by each problem's lookahead
    (lookahead_by_enumeration) and carry chain, mean over the seeds that hold a column; data whose
    problems are not the outcomes' stops it with one line."""
    d = tmp_path
    addition_prepare.main(['--out_dir', str(d / 'data'), '--digits', '3', '--train_problems', '300',
                           '--select_problems', '64', '--val_problems', '64', '--test_problems', '64',
                           '--quiet'])
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'test', meta)
    pre = window_tokens(data, windows(data, 8, 5), 13)[:, :8]
    chars = meta['chars']
    problems = [''.join(chars[i - 1] for i in p).rstrip('=').split('+') for p in pre.tolist()]
    ahead = torch.tensor([lookahead_by_enumeration(a, b) for a, b in problems])
    chain = carry_chains(pre, meta).tolist()
    g = torch.Generator().manual_seed(0)
    draw = lambda: (torch.rand(len(pre), generator=g) < 0.7).double().tolist()
    files = [dict(seeds=[1, 2], split='test', ns=[1, 4], carry_chain=chain,
                  per_problem={s: {'LM': {'greedy_exact': draw(), 'logp_correct': draw()}} for s in '12'}),
             dict(seeds=[3], split='test', per_problem={'3': {'LM': {'greedy_exact': draw()}}})]
    paths = []
    for i, f in enumerate(files):
        paths.append(str(tmp_path / f'o{i}.json.gz'))
        with gzip.open(paths[-1], 'wt') as fh:
            json.dump(f, fh)
    out = tmp_path / 'look.json'
    regroup.main([*paths, '--data_dir', str(d / 'data'), '--out', str(out), '--quiet'])
    res = json.loads(out.read_text())
    hits = torch.tensor([f['per_problem'][s]['LM']['greedy_exact'] for f in files for s in f['per_problem']])
    assert len(set(ahead.tolist())) > 1 and res['seeds']['LM']['greedy_exact'] == ['1', '2', '3']
    for v in set(ahead.tolist()):
        got = res['by_lookahead']['exact']['LM']['greedy_exact'][str(v)]
        assert got == pytest.approx(hits[:, ahead == v].mean().item()), v
        assert res['by_lookahead']['count'][str(v)] == (ahead == v).sum().item()
    assert 'logp_correct' not in res['by_lookahead']['exact']['LM']
    files[0]['carry_chain'] = [c + 1 for c in chain]
    with gzip.open(paths[0], 'wt') as fh:
        json.dump(files[0], fh)
    res = run_script(['-m', 'job.lookahead', *paths, '--data_dir', str(d / 'data'),
                      '--out', str(tmp_path / 'again.json')])
    assert_clean_error(res, "carry chains are not the outcomes'")

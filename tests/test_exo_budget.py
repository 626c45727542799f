"""job.exo_budget: EXO's budget curve (greedy exact match against EXO's steps) from the runs kept in
assets, against numbers by hand, and the committed curve against a rerun of its command."""

import json
import re

import pytest

from job import exo_budget
from tests.common import ROOT


def test_exo_budget_curve_against_hand_computed(tmp_path):
    """job.exo_budget: per step that every run reached, the mean and SD over the runs against numbers by
    hand, the mean's best step, each run's best.pt marked in the table, the figure drawn; a wrong run, a
    curve without step 0 or a missing asset is one line naming it."""
    point = lambda i, g: dict(iter=i, greedy_exact=g, kl_reverse_high=1.0)
    runs = dict(a=dict(flags=dict(seed=1), best_iter=100, dtype='bfloat16', energy='bit',
                       curve=[point(0, 0.5), point(100, 0.75), point(200, 0.7)]),
                b=dict(flags=dict(seed=2), best_iter=0, dtype='float32',
                       curve=[point(0, 0.7), point(100, 0.65)]),
                c=dict(flags=dict(seed=3), best_iter=100, dtype='float32', curve=[point(100, 0.9)]))
    asset, out = tmp_path / 'asset.json', tmp_path / 'curve.json'
    asset.write_text(json.dumps(dict(runs=runs)))
    exo_budget.main([f'{asset}:a', f'{asset}:b', '--out', str(out), '--plot', str(tmp_path / 'c.png'),
                     '--quiet'])
    res = json.loads(out.read_text())
    assert (tmp_path / 'c.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert res['steps'] == [0, 100]
    assert res['mean'] == pytest.approx([0.6, 0.7])
    assert res['sd'] == pytest.approx([0.02 ** 0.5, 0.005 ** 0.5])
    assert (res['best_step'], res['best_mean']) == (100, pytest.approx(0.7))
    assert [(r['seed'], r['energy']) for r in res['runs']] == [(1, 'bit'), (2, 'energy not recorded')]
    lines = (tmp_path / 'curve.txt').read_text().splitlines()
    assert lines[1].split('\t')[:3] == ['0', '0.500', '0.700*'] and lines[2].split('\t')[1] == '0.750*'
    for spec, words in ((f'{asset}:d', "has no run 'd'; it has a, b, c"),
                        (f'{asset}:c', 'no greedy exact match at step 0'),
                        (f'{tmp_path}/none.json:a', 'give ASSET:RUN')):
        with pytest.raises(ValueError, match=re.escape(words)):
            exo_budget.main([spec, '--out', str(tmp_path / 'x.json'), '--quiet'])


def test_the_committed_budget_curve_is_its_runs(tmp_path, monkeypatch):
    """assets/exo_budget_curve.json, which docs/addition.md quotes, is what job.exo_budget makes of the
    runs it names, in the committed assets."""
    monkeypatch.chdir(ROOT)
    with open('assets/exo_budget_curve.json') as f:
        want = json.load(f)
    out = tmp_path / 'curve.json'
    exo_budget.main([f"{r['asset']}:{r['run']}" for r in want['runs']] + ['--out', str(out), '--quiet'])
    assert json.loads(out.read_text()) == want

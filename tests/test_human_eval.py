"""Human evaluation (job/human_eval.py): Table 2's protocol, blinded A/B items, attention checks,
the binomial test against an exact reference.
"""

import contextlib
import csv
import io
import json
import math
import os
from fractions import Fraction

import pytest

from job import human_eval
from tests.common import (HAND_KEY, HE_SAMPLES, dir_snapshot, exported_votes, hand_votes, prefs_bad,
                          prefs_good, prefs_half, run_script, simulate_votes, write_hand_key_and_votes,
                          write_samples)


# =============================================================================
# ==== human evaluation (job/human_eval.py): Table 2's protocol, blinded A/B items, attention
#      checks, the binomial sign test ====

def binom_tail_exact(wins, losses):
    """P(X >= wins), X ~ Binomial(wins + losses, 1/2), as an exact fraction from Pascal's triangle."""
    row = [1]
    for _ in range(wins + losses):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return Fraction(sum(row[wins:]), 2 ** (wins + losses))


def test_binomial_p_value():
    # the paper's Table 2, BASE LM vs BALM: 0.88
    assert 0.88 < human_eval.binomial_p_value(156, 333 - 156) < 0.89
    assert human_eval.binomial_p_value(9, 1) == 11 / 1024
    assert human_eval.binomial_p_value(10, 0) == 1 / 1024 and human_eval.binomial_p_value(0, 10) == 1.0
    assert human_eval.binomial_p_value(0, 0) == 1.0 and human_eval.binomial_p_value(1, 0) == 0.5
    for w, l in [(5, 5), (3, 7), (20, 13), (60, 40), (7, 0), (1, 1)]:
        p = human_eval.binomial_p_value(w, l)
        assert abs(p - float(binom_tail_exact(w, l))) < 1e-15
        # complement: P(X >= w) + P(X >= l + 1) = 1 for X ~ Binomial(w + l, 1/2)
        assert abs(p + human_eval.binomial_p_value(l + 1, w - 1) - 1) < 1e-12


def test_human_eval_roundtrip():
    items, key = human_eval.export(HE_SAMPLES, ['joint', 'base'], 3, seed=0)
    assert len(items) == 11 and [it['item'] for it in items] == list(range(11))
    assert key['systems'] == ['joint', 'base'] and sorted(key['items']) == sorted(str(i) for i in range(11))
    checks = [it for it in items if key['items'][str(it['item'])]['check']]
    assert len(checks) == 3
    for it in items:
        k = key['items'][str(it['item'])]
        i = int(it['prefix'].split()[1])
        assert it['A'] == f"{k['A']} {i}" and it['B'] == f"{k['B']} {i}"  # the key unblinds A/B
        assert {k['A'], k['B']} == ({'joint', 'gold'} if k['check'] else {'joint', 'base'})
    assert {key['items'][str(it['item'])]['A'] for it in items} >= {'joint', 'base'}  # both orders occur
    regular = [it for it in items if not key['items'][str(it['item'])]['check']]
    assert sorted(int(it['prefix'].split()[1]) for it in regular) == list(range(8))
    votes = simulate_votes(items, dict(r1=prefs_good, r2=prefs_bad, r3=prefs_half))
    rep = human_eval.score(key, votes)
    # r2 dropped; per prefix (r1, r3): 0 JJ, 1 JB, 2 JJ, 3 JB, 4 JJ, 5 =B, 6 BJ, 7 BB -> items 3 won,
    # 1 lost, 4 equal (no strict plurality); per vote r1: 5 wins, 1 tie, 2 losses; r3: 4 wins, 4 losses
    assert rep['dropped_raters'] == ['r2'] and rep['unit'] == 'item'
    assert (rep['n'], rep['votes'], rep['wins'], rep['losses'], rep['ties']) == (8, 16, 3, 1, 4)
    assert (rep['preferred'] == 3 / 8 and rep['not_worse'] == 7 / 8
            and rep['p_value'] == 219 / 256)  # P(X >= 3 | 8)
    rep = human_eval.score(key, votes, per_vote=True)
    assert (rep['unit'] == 'vote'
            and (rep['n'], rep['votes'], rep['wins'], rep['losses'], rep['ties']) == (16, 16, 9, 6, 1))
    assert rep['preferred'] == 9 / 16 and rep['not_worse'] == 10 / 16
    assert rep['p_value'] == float(binom_tail_exact(9, 7))  # ties are non-wins
    # tolerated failures keep r2 (always joint): items 0-4 and 6 won, 5 (=BJ) equal, 7 (BBJ) lost
    rep = human_eval.score(key, votes, max_failed_checks=3)
    assert rep['dropped_raters'] == [] and (rep['wins'], rep['losses'], rep['ties']) == (6, 1, 1)
    rep = human_eval.score(key, votes, max_failed_checks=3, per_vote=True)
    assert (rep['wins'], rep['losses'], rep['ties']) == (17, 6, 1)
    rep = human_eval.score(key, votes, max_failed_checks=2)
    assert rep['dropped_raters'] == ['r2']
    # the same items with the systems swapped: wins and losses swap (one rater: items = votes)
    items2, key2 = human_eval.export(HE_SAMPLES, ['base', 'joint'], 0, seed=0)
    rep = human_eval.score(key2, simulate_votes(items2, dict(r1=prefs_good)))
    assert (rep['wins'], rep['losses'], rep['ties'], rep['votes'], rep['n']) == (2, 5, 1, 8, 8)
    assert human_eval.export(HE_SAMPLES, ['joint', 'base'], 3, seed=0) == (items, key)  # seeded


def test_human_eval_cli(he_export, tmp_path):
    out_dir, _ = he_export
    with open(out_dir / 'items.csv', newline='') as f:
        items = list(csv.DictReader(f))
    jsonl, votes = exported_votes(out_dir)
    assert len(items) == len(jsonl) == 11 and [it['A'] for it in items] == [it['A'] for it in jsonl]
    key = json.loads((out_dir / 'key.json').read_text())
    assert 'joint' not in (out_dir / 'items.csv').read_text().split('\n')[0]  # raters do not see system names
    with open(tmp_path / 'votes.csv', 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['rater', 'item', 'choice'])
        w.writerows(votes)
    res = run_script(['-m', 'job.human_eval', 'score', '--key', str(out_dir / 'key.json'),
                      '--votes', str(tmp_path / 'votes.csv')])
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / 'votes_report.json').read_text())
    assert rep == human_eval.score(key, votes) and rep['dropped_raters'] == ['r2'] and rep['wins'] == 3
    assert 'preferred 37.5%' in res.stdout and 'of 8 items' in res.stdout
    # the same votes saved by a spreadsheet with a byte-order mark: the same report
    (tmp_path / 'bom.csv').write_bytes(b'\xef\xbb\xbf' + (tmp_path / 'votes.csv').read_bytes())
    read = lambda name: human_eval.read_votes(str(tmp_path / name), key)
    assert read('bom.csv') == read('votes.csv') and len(read('bom.csv')) == len(votes)


def binom_tail(w, l):
    return sum(math.comb(w + l, k) for k in range(w, w + l + 1)) / 2 ** (w + l)


def test_human_eval_items_by_majority():
    """Per item (r4 dropped), in system terms J (joint), B (base), = (equal):
    0 JJJ W | 1 JJB W | 2 J=J W | 3 JB= equal (no strict plurality) | 4 J== equal ('equal' majority)
    5 === equal | 6 BBJ L | 7 BBB L | 8 JJ W | 9 J= equal (tie with 'equal') | 10 only r4: unvoted | 11 JJB W.
    Items: 5 won, 2 lost, 4 equal of 11. Votes: J 15, B 8, = 8 of 31."""
    votes = hand_votes()
    assert len(votes) == 31 + 3 + 6 + 2  # counted, r4's on items, the checks of r1-r3, r4's checks
    rep = human_eval.score(HAND_KEY, votes)
    assert rep['dropped_raters'] == ['r4'] and rep['unit'] == 'item'
    assert ((rep['n'], rep['votes'], rep['wins'], rep['losses'], rep['ties'], rep['unvoted_items'])
            == (11, 31, 5, 2, 4, 1))
    assert rep['preferred'] == 5 / 11 and rep['not_worse'] == 9 / 11
    assert rep['p_value'] == 1486 / 2048 == binom_tail(5, 6)  # P(X >= 5 | 11): the 4 equal items are non-wins
    per_vote = human_eval.score(HAND_KEY, votes, per_vote=True)
    assert per_vote['unit'] == 'vote'
    assert ((per_vote['n'], per_vote['votes'], per_vote['wins'], per_vote['losses'], per_vote['ties'])
            == (31, 31, 15, 8, 8))
    assert per_vote['preferred'] == 15 / 31 and per_vote['not_worse'] == 23 / 31
    assert per_vote['p_value'] == sum(math.comb(31, k) for k in range(15, 32)) / 2 ** 31
    # counting correlated votes as independent overstates significance
    assert per_vote['p_value'] < rep['p_value']
    # r4 kept: item 8 JJB W, 9 J=B equal, 10 B L
    rep = human_eval.score(HAND_KEY, votes, max_failed_checks=1)
    assert (rep['dropped_raters'] == []
            and (rep['n'], rep['wins'], rep['losses'], rep['ties'], rep['unvoted_items']) == (12, 5, 3, 4, 0))
    assert rep['p_value'] == 3302 / 4096  # P(X >= 5 | 12)
    # without 'equal' votes the rule is the paper's: more votes wins, a 1-1 split (a dropped vote) is a tie
    assert human_eval.plurality({'joint': 2, 'base': 1, 'equal': 0}) == 'joint'
    assert human_eval.plurality({'joint': 1, 'base': 1, 'equal': 0}) == 'equal'
    assert human_eval.plurality({'joint': 0, 'base': 1, 'equal': 0}) == 'base'
    with pytest.raises(ValueError, match='rater r1 voted more than once on item 3'):
        human_eval.score(HAND_KEY, votes + [('r1', '3', 'B')])


def one_rater_score(wins, losses, ties):
    """score() of one rater on wins + losses + ties items, joint always shown as A."""
    outcomes = ['A'] * wins + ['B'] * losses + ['equal'] * ties
    key = dict(systems=['joint', 'base'],
               items={str(i): dict(A='joint', B='base', check=False) for i in range(len(outcomes))})
    return human_eval.score(key, [('r1', str(i), c) for i, c in enumerate(outcomes)])


def test_human_eval_not_worse_sign_test(tmp_path):
    """not_worse_p_value is the sign test P(X >= wins), X ~ Binomial(wins + losses, 1/2), ties set aside."""
    rep = human_eval.score(HAND_KEY, hand_votes())  # items: 5 won, 2 lost, 4 equal
    assert rep['not_worse_p_value'] == Fraction(1 + 7 + 21, 2 ** 7) == 29 / 128
    # neither the not-worse share against 1/2 (P(X >= 9 | 11)) nor the preference test
    assert rep['not_worse_p_value'] not in (67 / 2048, rep['p_value'])
    per_vote = human_eval.score(HAND_KEY, hand_votes(), per_vote=True)  # votes: 15 won, 8 lost, 8 equal
    assert per_vote['not_worse_p_value'] == sum(math.comb(23, k) for k in range(15, 24)) / 2 ** 23
    # a valid test: under no preference (P(win) = P(loss) = 1/4, ties 1/2) it rejects at most 5% of
    # the time; the not-worse share against 1/2 would reject about 39% of the time
    n, alpha, size, naive = 12, 0.05, 0.0, 0.0
    for w in range(n + 1):
        for l in range(n + 1 - w):
            t = n - w - l
            prob = math.comb(n, t) * math.comb(w + l, w) / 2 ** (2 * (w + l) + t)
            size += prob * (one_rater_score(w, l, t)['not_worse_p_value'] <= alpha)
            naive += prob * (sum(math.comb(n, k) for k in range(n - l, n + 1)) / 2 ** n <= alpha)
    assert size <= alpha and naive > 0.3
    key_path, votes_path = write_hand_key_and_votes(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()) as s:
        human_eval.main(['score', '--key', str(key_path), '--votes', str(votes_path),
                         '--out', str(tmp_path / 'r.json')])
    assert json.loads((tmp_path / 'r.json').read_text())['not_worse_p_value'] == 29 / 128
    assert 'not worse 81.8%, one-sided sign test p = 0.227 (won vs lost' in s.getvalue()


@pytest.mark.parametrize('extra,unit', [([], 'item'), (['--per_vote'], 'vote')], ids=['items', 'votes'])
def test_human_eval_cli_units(tmp_path, extra, unit):
    key_path, votes_path = write_hand_key_and_votes(tmp_path)
    out = tmp_path / f'{unit}.json'
    with contextlib.redirect_stdout(io.StringIO()) as s:
        human_eval.main(['score', '--key', str(key_path), '--votes', str(votes_path), '--out', str(out),
                         *extra])
    rep = json.loads(out.read_text())
    assert rep == json.loads(json.dumps(human_eval.score(HAND_KEY, hand_votes(), per_vote=bool(extra))))
    assert rep['unit'] == unit
    assert ('of 11 items' if unit == 'item' else 'of 31 votes (per vote') in s.getvalue()
    assert f"over {unit}s" in s.getvalue()


def test_human_eval_export_force_replaces_the_key(tmp_path):
    """export refuses to replace a key that votes may have been collected against (see the CLI
    section), unless --force: then key and items are new, written atomically."""
    samples = write_samples(tmp_path / 'samples.json')
    out_dir = tmp_path / 'he'
    export = ['-m', 'job.human_eval', 'export', '--samples', samples, '--checks', '2',
              '--out_dir', str(out_dir)]
    assert run_script(export).returncode == 0
    before = dir_snapshot(out_dir)
    res = run_script(export + ['--seed', '7', '--force'])
    assert res.returncode == 0, res.stderr
    after = dir_snapshot(out_dir)
    assert after['key.json'][0] != before['key.json'][0] and after['items.csv'][0] != before['items.csv'][0]
    assert not [f for f in os.listdir(out_dir) if f.endswith('.tmp')]


def test_sample_cli_then_human_eval(sample_run, tmp_path):
    """human_eval.py export on sample.py's output."""
    out, _ = sample_run
    res = run_script(['-m', 'job.human_eval', 'export', '--samples', str(out), '--checks', '1',
                      '--out_dir', str(tmp_path / 'he')])
    assert res.returncode == 0, res.stderr
    assert len(json.loads((tmp_path / 'he' / 'key.json').read_text())['items']) == 4

"""job/seeds.py: the addition table over seeds, from each seed's accuracy.json: rows' mean and spread,
and the decoders compared with the problem as the unit (the seeds share the problems)."""

import gzip
import json
import math
import os
import statistics

import numpy as np
import pytest
import torch

from extensions.carry import exact_by
from job import seeds, stats
from tests.common import ROOT, t_log_density


def fake_run(folder, seed, joint, lm, data='d1', chain=None, energy=None):
    """An out_dir with a provenance.json naming the prepared data and an accuracy.json of 2 rows (and
    the joint model's --energy, where given: its folder's name)."""
    folder.mkdir()
    (folder / 'provenance.json').write_text(json.dumps({'lm': dict(flags=[], inputs={'prepare': {'m': data}},
                                                                   outputs=None)}))
    rows = [dict(model='BASE LM', method='greedy', n=1, exact=float(np.mean(lm)), p_correct=0.5),
            dict(model='JOINT', method='Algorithm 1, n = 4', n=4, exact=float(np.mean(joint)))]
    per = {'JOINT': {'a1_4_exact': joint, 'mode_4_exact': joint},
           'BASE LM': {'greedy_exact': lm, 'majority_4_exact': lm, 'rerank_4_exact': lm}}
    ahead = None if chain is None else [3 - c for c in chain]  # another grouping of the same problems
    by_chain = {} if chain is None else dict(
        carry_chain=chain, by_carry_chain=exact_by(torch.tensor(chain), per),
        lookahead=ahead, by_lookahead=exact_by(torch.tensor(ahead), per))
    (folder / 'accuracy.json').write_text(json.dumps(dict(split='test', num_prefixes=len(lm), ns=[1, 4],
                                                          seed=seed, rows=rows, per_problem=per, **by_chain,
                                                          **({'energy': str(folder / energy / 'best.pt')}
                                                             if energy else {}))))
    return str(folder)


def t_log_tail(t, df):
    """log P(|T| >= t), T ~ Student's t(df), also where it is below the smallest double: the log density
    on [t, t + 200] by the trapezoid rule, summed by log-sum-exp (a reference apart from stats)."""
    x = np.linspace(t, t + 200, 2_000_001)
    w = np.full_like(x, x[1] - x[0])
    w[[0, -1]] /= 2
    return math.log(2) + float(np.logaddexp.reduce(t_log_density(x, df) + np.log(w)))


def test_seeds_against_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    joint = (rng.random((3, 200)) < 0.9).astype(int)
    lm = (rng.random((3, 200)) < 0.8).astype(int)
    chain = rng.integers(0, 4, 200)
    runs = [fake_run(tmp_path / f's{s}', s, joint[i].tolist(), lm[i].tolist(), chain=chain.tolist(), energy=e)
            for i, (s, e) in enumerate(zip((1, 2, 3), ('bit', 'unit', 'bit')))]
    out = tmp_path / 'seeds.json'
    seeds.main([*runs, '--out', str(out), '--plot', str(tmp_path / 'carry.png')])
    res = json.loads(out.read_text())
    assert res['seeds'] == [1, 2, 3] and res['energies'] == ['bit', 'unit', 'bit']
    energies = "the joint model's energy at each seed: 1 bit, 2 unit, 3 bit"
    assert energies in (tmp_path / 'seeds.txt').read_text()
    assert (tmp_path / 'carry.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    exact = res['rows'][1]['exact']
    assert exact['mean'] == pytest.approx(joint.mean())
    assert exact['sd'] == pytest.approx(joint.mean(1).std(ddof=1))
    assert 'p_correct' in res['rows'][0] and 'p_correct' not in res['rows'][1]
    first = res['comparisons'][0]
    assert first['what'] == 'Alg. 1 > LM greedy (n = 4)'
    d = (joint - lm).mean(0)  # per problem, averaged over seeds
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert first['diff'] == pytest.approx(d.mean()) and first['se'] == pytest.approx(se)
    assert first['p'] == pytest.approx(math.exp(t_log_tail(abs(d.mean() / se), len(d) - 1)), rel=1e-4)
    assert first['diff_per_seed'] == pytest.approx((joint - lm).mean(1).tolist())
    assert first['mcnemar_p_per_seed'][0] == stats.mcnemar(joint[0], lm[0])['p']
    p = [c['p'] for c in res['comparisons']]
    assert [c['p_holm'] for c in res['comparisons']] == stats.holm(p)
    by = res['by_carry_chain']  # exact match by carry chain, over seeds and the problems of that length
    for c in range(4):
        assert by['exact']['JOINT']['a1_4_exact'][str(c)] == pytest.approx(joint[:, chain == c].mean())
        assert by['count'][str(c)] == (chain == c).sum()
        ahead = res['by_lookahead']
        want = lm[:, chain == c].mean()
        assert ahead['exact']['BASE LM']['greedy_exact'][str(3 - c)] == pytest.approx(want)
        assert ahead['count'][str(3 - c)] == (chain == c).sum()
    assert 'exact match by the lookahead' in (tmp_path / 'seeds.txt').read_text()
    with gzip.open(tmp_path / 'seeds_outcomes.json.gz', 'rt') as f:
        kept = json.load(f)
    assert kept['lookahead'] == (3 - chain).tolist() and kept['energies'] == ['bit', 'unit', 'bit']
    again = seeds.comparisons(seeds.read_outcomes(tmp_path / 'seeds_outcomes.json.gz'))
    assert again == res['comparisons']  # every seed's outcomes kept: the tests recomputed from them
    assert statistics.fmean(first['diff_per_seed']) == pytest.approx(first['diff'])


def test_exo_is_compared_with_balm_where_it_has_balms_size(tmp_path):
    """The EXO LM's greedy is compared with the base LM's, and with BALM's only where EXO has BALM's
    parameters (distilled from BALM: the job's EXO), in the table over seeds and in the comparisons
    recomputed from the outcomes file (which keeps each model's parameters)."""
    from job import decoder_pairs
    ones = [1, 0, 1, 1]
    per = {'JOINT': {'a1_4_exact': ones}, 'BASE LM': {'greedy_exact': ones},
           'BALM': {'greedy_exact': ones}, 'EXO': {'greedy_exact': ones}}
    rows = lambda exo: [dict(model='BALM', params=760), dict(model='EXO', params=exo)]
    whats = lambda acc: [w for w, *_ in decoder_pairs(acc) if w.startswith('EXO')]
    assert whats(dict(ns=[1, 4], per_problem=per, rows=rows(760))) == ['EXO LM greedy > LM greedy',
                                                                       'EXO LM greedy > BALM greedy']
    assert whats(dict(ns=[1, 4], per_problem=per, rows=rows(340))) == ['EXO LM greedy > LM greedy']
    accs = [dict(split='test', ns=[1, 4], per_problem=per, rows=rows(760))] * 2
    seeds.write_outcomes(accs, [1, 2], tmp_path / 'o.json.gz')
    assert [whats(a) for a in seeds.read_outcomes(tmp_path / 'o.json.gz')] == [whats(accs[0])] * 2


def stand_in_jobs(monkeypatch, body):
    """seeds.seed_command replaced by a Python stand-in for a seed's job: it writes its start time to
    <run>.start first (before any slow import), then runs `body` with seed, run (a Path), json, sys,
    time and the repo on the path."""
    code = ("import json, pathlib, sys, time; seed, run = int(sys.argv[1]), pathlib.Path(sys.argv[2]); "
            f"json.dump(time.time(), open(str(run) + '.start', 'w')); sys.path.insert(0, {ROOT!r}); " + body)
    monkeypatch.setattr(seeds, 'seed_command', lambda args, seed, run: [seeds.sys.executable, '-c', code,
                                                                         str(seed), run])
    monkeypatch.setattr(seeds, 'prepared', lambda args: True)


def test_seeds_trains_each_seed_then_the_table(tmp_path, monkeypatch, capsys):
    """--seeds: each seed's job (job.reproduce's command, here a stand-in that writes a run) into
    <runs_dir>/seedS with its log, --at_once of them at a time, then the table of those runs; a job
    that fails stops the command with one line naming its log (a rerun: a done run is kept)."""
    stand_in_jobs(monkeypatch, "time.sleep(0.5); from tests.test_seeds import fake_run; "
                               "sys.exit('error: boom') if seed == 9 else "
                               "run.exists() or fake_run(run, seed, [1, 1, seed % 2], [1, 0, 0])")
    runs, out = tmp_path / 'runs', tmp_path / 'table.json'
    seeds.main(['--seeds', '3,1,2', '--runs_dir', str(runs), '--at_once', '3', '--out', str(out)])
    res = json.loads(out.read_text())
    assert res['seeds'] == [1, 2, 3] and res['runs'] == [str(runs / f'seed{s}') for s in (1, 2, 3)]
    starts = [json.load(open(runs / f'seed{s}.start')) for s in (1, 2, 3)]
    assert max(starts) - min(starts) < 0.5  # the three at once
    assert '[seed 2] done' in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"seed 9's job failed \\(its log: {runs / 'seed9'}.log\\)"):
        seeds.main(['--seeds', '1,9', '--runs_dir', str(runs), '--out', str(out)])
    assert 'boom' in (runs / 'seed9.log').read_text()
    with pytest.raises(ValueError, match='either --seeds'):
        seeds.main(['--seeds', '1,2', str(runs / 'seed1'), '--out', str(out)])


def test_seeds_start_the_next_as_soon_as_any_ends(tmp_path, monkeypatch):
    """--at_once 2 with the first seed's job the longest: the third starts when the second ends, not
    after the first (a core idle no longer than a poll)."""
    stand_in_jobs(monkeypatch, "time.sleep(6 if seed == 1 else 0.2); "
                               "json.dump(time.time(), open(str(run) + '.end', 'w')); "
                               "from tests.test_seeds import fake_run; "
                               "fake_run(run, seed, [1, 1, 0], [1, 0, 0])")
    monkeypatch.setattr(seeds, 'POLL_S', 0.05)
    runs = tmp_path / 'runs'
    seeds.main(['--seeds', '1,2,3', '--runs_dir', str(runs), '--at_once', '2',
                '--out', str(tmp_path / 't.json')])
    when = lambda s, what: json.load(open(runs / f'seed{s}.{what}'))
    assert when(2, 'end') <= when(3, 'start') < when(1, 'end')


def test_seeds_refuses_mixed_runs(tmp_path):
    a = fake_run(tmp_path / 'a', 1, [1, 0, 1], [0, 0, 1])
    with pytest.raises(ValueError, match='not trained on the same data'):
        seeds.main([a, fake_run(tmp_path / 'b', 2, [1, 1, 1], [0, 0, 1], data='d2'),
                    '--out', str(tmp_path / 'o.json')])
    with pytest.raises(ValueError, match='same --seed'):
        seeds.main([a, fake_run(tmp_path / 'c', 1, [1, 1, 1], [0, 0, 1]), '--out', str(tmp_path / 'o.json')])
    with pytest.raises(ValueError, match='at least 2'):
        seeds.main([a, '--out', str(tmp_path / 'o.json')])
    b = fake_run(tmp_path / 'd', 2, [1, 1, 1], [0, 0, 1])  # no carry chains recorded: no figure of them
    with pytest.raises(ValueError, match='--plot: an accuracy.json without carry chains'):
        seeds.main([a, b, '--out', str(tmp_path / 'o.json'), '--plot', str(tmp_path / 'c.png')])
    assert not os.path.exists(tmp_path / 'o.json')


def test_seeds_keep_p_values_below_the_smallest_double(tmp_path):
    """On 10,000 problems the joint decoder's lead gives a paired t near 40 and p near 1e-340: stored as
    its log (log_p, log_p_holm, McNemar's per seed) and p None, never 0.0, and printed from the log."""
    rng = np.random.default_rng(1)
    joint = (rng.random((2, 10_000)) < 0.999).astype(int)
    lm = (rng.random((2, 10_000)) < 0.88).astype(int)
    runs = [fake_run(tmp_path / f's{s}', s, joint[i].tolist(), lm[i].tolist()) for i, s in enumerate((1, 2))]
    out = tmp_path / 'seeds.json'
    seeds.main([*runs, '--out', str(out)])
    first = json.loads(out.read_text())['comparisons'][0]
    d = (joint - lm).mean(0)
    want = t_log_tail(abs(d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))), len(d) - 1)
    assert want < stats.LOG_TINY - 10 and first['log_p'] == pytest.approx(want, abs=1e-3)
    assert first['p'] is None and first['p_holm'] is None and first['holds'] and first['holds_holm']
    assert first['mcnemar_p_per_seed'] == [None, None]
    assert first['mcnemar_log_p_per_seed'][0] == stats.mcnemar(joint[0], lm[0])['log_p'] < stats.LOG_TINY
    assert first['log_p_holm'] == pytest.approx(math.log(6) + first['log_p'])  # 6 tied comparisons: 6 p
    exponent = math.floor(first['log_p'] / math.log(10))
    assert f"e{exponent} " in (tmp_path / 'seeds.txt').read_text().splitlines()[4]


def test_seed_level_against_closed_forms():
    """The seed as the unit: per-seed differences 0.1, 0.2, 0.3 give t = 0.2 / (0.1 / sqrt 3) on 2
    degrees of freedom, whose two-sided p is 1 - t / sqrt(2 + t^2) in closed form; the sign test of
    3 seeds better and none worse is 2 / 2^3; Holm over two comparisons doubles the smaller p."""
    out = seeds.seed_level([dict(diff_per_seed=[0.1, 0.2, 0.3]), dict(diff_per_seed=[0.1, -0.2, 0.4])])
    a, b = out[0]['seed_level'], out[1]['seed_level']
    t = 0.2 / (0.1 / math.sqrt(3))
    assert a['t_df'] == 2 and a['t_p'] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert a['sign'] == [3, 0] and a['sign_p'] == pytest.approx(0.25)
    assert b['sign'] == [2, 1] and b['sign_p'] == pytest.approx(1.0)
    assert a['t_p_holm'] == pytest.approx(2 * a['t_p']) and a['sign_p_holm'] == pytest.approx(0.5)


@pytest.mark.parametrize('name', ['seeds_addition', 'seeds_addition_lm7000', 'seeds_addition_lm7000_test5000',
                                  'seeds_addition_lm7000_e16000', 'seeds_addition_lm7000_e16000_test10000'])
def test_committed_seed_level_is_the_stored_differences(name):
    """The committed tables over seeds (the job's; its LM at 7,000 steps, on 1,000 and 5,000 test
    problems; that LM with energies of 16,000 steps, on 1,000 and 10,000): their comparisons are those
    of the per-problem outcomes stored beside them (every seed's), and their seed-level tests those of
    their own per-seed differences."""
    stored = json.load(open(os.path.join(ROOT, 'assets', f'{name}.json')))['comparisons']
    outcomes = seeds.read_outcomes(os.path.join(ROOT, 'assets', f'{name}_outcomes.json.gz'))
    assert len(outcomes) >= 3 and seeds.comparisons(outcomes) == stored
    again = seeds.seed_level([dict(diff_per_seed=c['diff_per_seed']) for c in stored])
    assert len(again) == len(stored)
    for c, d in zip(stored, again):
        s, want = c['seed_level'], d['seed_level']
        assert s['sign'] == want['sign'] and s.keys() == want.keys(), c['what']
        assert all(s[k] == pytest.approx(want[k], rel=1e-9) for k in s if k != 'sign'), c['what']


def test_exo_set_tables_are_their_outcomes():
    """assets/exo_set_addition.json's test tables (EXO over a set, without and with --beam_mass) are
    their per-problem outcomes: each seed's greedy exact match and P(correct), and every comparison's
    per-seed McNemar p, seed-level t and sign tests, from the outcomes stored beside it and the
    10,000-problem table's (BALM, the job's EXO and the LM: the same models on the same problems)."""
    read = lambda name: json.load(gzip.open(os.path.join(ROOT, 'assets', name), 'rt'))['per_problem']
    per = read('exo_set_addition_outcomes.json.gz')
    for s, models in read('seeds_addition_lm7000_e16000_test10000_outcomes.json.gz').items():
        if s in per:
            per[s].update({m: models[m] for m in ('BASE LM', 'BALM', 'EXO')})
    asset = json.load(open(os.path.join(ROOT, 'assets', 'exo_set_addition.json')))
    greedy = lambda s, m: per[str(s)][m]['greedy_exact']
    for test in (asset['test'], asset['beam_mass']['test']):
        for m, row in test['table'].items():
            seeds_of = row.get('seeds', test['seeds'])
            assert row['greedy'] == pytest.approx([np.mean(greedy(s, m)) for s in seeds_of], abs=1e-12), m
            assert row['p_correct'] == pytest.approx(
                [np.exp(per[str(s)][m]['logp_correct']).mean() for s in seeds_of], rel=1e-9), m
        for c in test['comparisons']:
            a, b = c['name'].replace(' greedy', '').split(' > ')
            mc = [stats.mcnemar(greedy(s, a), greedy(s, b)) for s in c.get('seeds', test['seeds'])]
            assert c['per_seed_diff'] == pytest.approx([x['diff'] for x in mc], abs=1e-12), c['name']
            log_p = c['per_seed_mcnemar_log_p']
            assert log_p == pytest.approx([x['log_p'] for x in mc], rel=1e-9), c['name']
            assert c['per_seed_mcnemar_p'] == [stats.p_of(x) for x in log_p], c['name']  # None, never 0.0
            assert c['seed_t_p'] == pytest.approx(stats.paired(c['per_seed_diff'])['p'], rel=1e-9), c['name']
            d = c['per_seed_diff']
            assert c['sign'] == [sum(x > 0 for x in d), sum(x < 0 for x in d)], c['name']


def test_lesson_seeds_run_the_lesson():
    """--lesson: each seed's job is the lesson's command (its --seed, the folder, --jobs 1: a chain),
    which job.lesson parses as that seed's run, into out-seeds-lesson/ by default; the addition job's
    recipe flags and --lesson without --seeds are refused with one line."""
    from job import lesson
    args = seeds.get_args(['--seeds', '1,2', '--lesson', '--quick'])
    assert args.runs == [os.path.join('out-seeds-lesson', f'seed{s}') for s in (1, 2)] and args.jobs == 1
    cmd = seeds.seed_command(args, 2, args.runs[1])
    assert cmd[1:3] == ['-m', 'job.lesson']
    parsed = lesson.get_args(cmd[3:])
    assert (parsed.seed, parsed.out_dir, parsed.jobs, parsed.quick) == (2, args.runs[1], 1, True)
    assert parsed.data_seed == lesson.get_args([]).data_seed  # the seeds share the problems
    job = seeds.get_args(['--seeds', '1,2'])
    assert (job.jobs, job.runs_dir) == (2, 'out-seeds')
    for extra, what in ((['--lm_max_iters', '7000'], '--lm_max_iters'),
                        (['--recipe', 'gpu'], '--recipe gpu')):
        with pytest.raises(ValueError, match=f"--lesson: {what} set the addition job's recipe"):
            seeds.get_args(['--seeds', '1,2', '--lesson'] + extra)
    with pytest.raises(ValueError, match="--lesson: it trains the lesson's --seeds"):
        seeds.get_args(['a', 'b', '--lesson'])


def test_lesson_seeds_at_6_digits_run_the_method_alone():
    """--lesson --digits 6: each seed's job is job.lesson --digits 6 (the addition job's recipe and
    problems, data/addition: what prepared() waits for), into out-seeds-lesson6/ and
    out/seeds_lesson6.json by default; --digits without --lesson, and with --quick, refused in one line."""
    from job import lesson
    args = seeds.get_args(['--seeds', '1,2', '--lesson', '--digits', '6'])
    assert args.runs == [os.path.join('out-seeds-lesson6', f'seed{s}') for s in (1, 2)]
    assert args.out == 'out/seeds_lesson6.json' and args.jobs == 1
    parsed = lesson.get_args(seeds.seed_command(args, 2, args.runs[1])[3:])
    assert (parsed.digits, parsed.seed, parsed.out_dir) == (6, 2, args.runs[1])
    assert parsed.data_dir == 'data/addition'
    four = lesson.get_args(seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--lesson']), 1, 'r')[3:])
    assert (four.digits, four.data_dir) == (4, 'data/lesson')
    with pytest.raises(ValueError, match="--digits is the lesson's"):
        seeds.get_args(['--seeds', '1,2', '--digits', '6'])
    with pytest.raises(ValueError, match="--lesson --quick runs tiny 4-digit sizes"):
        seeds.get_args(['--seeds', '1,2', '--lesson', '--digits', '6', '--quick'])


def test_one_job_prepares_the_shared_problems_before_another_starts(tmp_path, monkeypatch):
    """Until the problems are prepared one seed's job runs, whatever --at_once: two jobs never prepare
    the same folder at once. Here the first job 'prepares' them 1 s in, the second starts after that."""
    stand_in_jobs(monkeypatch, "time.sleep(1); open(str(run.parent / 'meta.json'), 'w').close(); "
                               "json.dump(time.time(), open(str(run) + '.prepared', 'w')); "
                               "time.sleep(0.5); from tests.test_seeds import fake_run; "
                               "fake_run(run, seed, [1, 1, 0], [1, 0, 0])")
    runs = tmp_path / 'runs'
    monkeypatch.setattr(seeds, 'prepared', lambda args: (runs / 'meta.json').exists())
    monkeypatch.setattr(seeds, 'POLL_S', 0.05)
    seeds.main(['--seeds', '1,2', '--runs_dir', str(runs), '--at_once', '2',
                '--out', str(tmp_path / 't.json')])
    when = lambda s, what: json.load(open(runs / f'seed{s}.{what}'))
    assert when(1, 'prepared') <= when(2, 'start')
    assert (tmp_path / 't.json').exists()


def test_a_difference_with_no_spread_is_left_out_of_holms_family(tmp_path):
    """A comparison whose two decoders write the same outcome on every problem at every seed has no t
    (SE 0): its p is None and it is left out of Holm's family (the others adjusted over the rest, as
    stats.holm of their p alone); the table says so instead of a traceback."""
    rng = np.random.default_rng(2)
    lm = (rng.random((2, 300)) < 0.7).astype(int)
    joint = np.maximum(lm, (rng.random((2, 300)) < 0.5)).astype(int)
    runs = []
    for i, s in enumerate((1, 2)):
        run = fake_run(tmp_path / f's{s}', s, joint[i].tolist(), lm[i].tolist())
        acc = json.loads(open(os.path.join(run, 'accuracy.json')).read())
        acc['per_problem']['BASE LM']['rerank_4_exact'] = joint[i].tolist()  # mode vs rerank: no spread
        open(os.path.join(run, 'accuracy.json'), 'w').write(json.dumps(acc))
        runs.append(run)
    out = tmp_path / 'seeds.json'
    seeds.main([*runs, '--out', str(out)])
    comps = json.loads(out.read_text())['comparisons']
    none = [c for c in comps if c['log_p'] is None]
    assert [c['what'] for c in none] == ['Alg. 1 > LM log-prob rerank (n = 4)',
                                         'joint mode > LM log-prob rerank (n = 4)']
    assert all(c['p_holm'] is None and c['holds_holm'] is None and c['diff'] == 0 for c in none)
    tested = [c for c in comps if c['log_p'] is not None]
    assert len(tested) == 4
    assert [c['p_holm'] for c in tested] == pytest.approx(stats.holm([c['p'] for c in tested]))
    assert 'p n/a (the same difference on every problem)' in (tmp_path / 'seeds.txt').read_text()


def test_each_job_takes_its_share_of_the_cores(tmp_path, monkeypatch):
    """--at_once K: each seed's job runs on cores // K threads (OMP_NUM_THREADS in its environment, at
    least 1), so K jobs never hold more threads than the cores; --out defaults to the job's own table."""
    stand_in_jobs(monkeypatch, "import os; json.dump(os.environ['OMP_NUM_THREADS'], "
                               "open(str(run) + '.threads', 'w')); from tests.test_seeds import fake_run; "
                               "fake_run(run, seed, [1, 1, 0], [1, 0, 0])")
    monkeypatch.setattr(seeds.torch, 'get_num_threads', lambda: 4)
    for at_once, want in ((1, '4'), (2, '2'), (3, '1'), (8, '1')):
        runs = tmp_path / f'runs{at_once}'
        seeds.main(['--seeds', '1,2', '--runs_dir', str(runs), '--at_once', str(at_once),
                    '--out', str(tmp_path / 't.json')])
        assert [json.load(open(runs / f'seed{s}.threads')) for s in (1, 2)] == [want, want], at_once
    assert seeds.get_args(['--seeds', '1,2']).out == 'out/seeds_addition.json'
    assert seeds.get_args(['--seeds', '1,2', '--lesson']).out == 'out/seeds_lesson.json'


def test_prepared_waits_for_every_shared_folder(tmp_path, monkeypatch):
    """prepared: the lesson's problems for --lesson (the addition job's with --digits 6); the addition
    job's, and with --test_problems above their test split the accuracy table's folder too (both made by
    the first job alone)."""
    from data.addition import prepare
    monkeypatch.setattr(seeds, 'ROOT', str(tmp_path))
    make = lambda folder, test=5: prepare.main(['--out_dir', str(tmp_path / folder), '--train_problems', '20',
                                                '--select_problems', '2', '--val_problems', '2',
                                                '--test_problems', str(test), '--quiet'])
    args = lambda *extra: seeds.get_args(['--seeds', '1,2', *extra])
    six = ('--lesson', '--digits', '6')
    assert not any(seeds.prepared(args(*extra)) for extra in ((), ('--lesson',), six))
    make('data/addition')
    assert all(seeds.prepared(args(*extra)) for extra in ((), ('--test_problems', '5'), six))
    assert not seeds.prepared(args('--test_problems', '1000')) and not seeds.prepared(args('--lesson'))
    make('data/addition_test1000', 1000)
    make('data/lesson')
    assert seeds.prepared(args('--test_problems', '1000')) and seeds.prepared(args('--lesson'))
    assert not seeds.prepared(args('--lesson', '--quick'))

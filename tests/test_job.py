"""The main job end to end (python -m job.reproduce, its --quick forms and --jobs), its scheduler,
figures.py and bench.py. The claims' tests are in test_claims.py, human evaluation's in
test_human_eval.py, the method's in test_all.py and the files named there.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from job import lesson, stats
from job.configs import STAGE_SECONDS
from data import load_meta
from model import load_checkpoint
from plumbing import file_hash
from tests.common import (ROOT, SCRIPTS, TRAIN_FLAGS, fake_main_job_json, run_script)


# =============================================================================
# ==== pipeline: the main job end to end (job/reproduce.py), figures.py, bench.py runs ====

def test_reproduce_quick_end_to_end(tmp_path):
    """The main job with tiny models: the CI smoke test of every stage (the slowest test, ~2 min on
    2 cores: the whole pipeline end to end). Every row is there with ordered bounds, and the
    method works: over the deliberately undertrained quick LM, JOINT BIT's conservative (high) end
    is far below the base LM (11-28 SE over seeds when measured; asserted: 5). Then a rerun skips
    every finished stage, and a stage whose outputs are removed runs again with what depends on it."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--quick', '--quiet', '--out_dir', str(out),
           '--data_dir', str(data), '--skip_lesson']  # the lesson's own test: test_lesson_quick_end_to_end
    env = dict(os.environ, OMP_NUM_THREADS='2')  # fixed: the numbers, so the thresholds, depend on it
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f'Table 1 ({data};' in res.stdout  # the corpus it ran on, not always Shakespeare
    rows = {(r['model'], r['split']): r for r in json.load(open(out / 'results.json'))['rows']}
    assert {m for m, _ in rows} == {'BASE LM', 'RALM', 'BALM', 'TAILR', 'JOINT UNIT', 'JOINT BIT',
                                    'JOINT METRICS', 'JOINT METRICS+BIT'}
    base, bit = rows['BASE LM', 'test'], rows['JOINT BIT', 'test']
    assert bit['ppl_low'] <= bit['ppl_high'] and math.isfinite(bit['gain_se']) and base['ppl'] > 1
    assert bit['ppl_high'] < base['ppl'] and bit['gain_nats_per_token'] > 5 * bit['gain_se'], bit
    assert json.load(open(out / 'results.json'))['held_out_nce_acc']['bit'] > 0.75
    assert (rows['JOINT BIT', 'test']['params']
            == rows['BASE LM', 'test']['params'] + json.load(open(out / 'bit' / 'results.json'))['params'])
    assert (out / 'samples.json').exists() and (out / 'ppl.json').exists()
    results = json.load(open(out / 'results.json'))  # the profile: each stage's time, a trainer's tokens
    profile, lm = {r['stage']: r for r in results['profile']}, json.load(open(out / 'lm' / 'results.json'))
    assert profile.keys() == results['timings_s'].keys() and 'Where the time went' in res.stdout
    assert sum(r['share'] for r in profile.values()) == pytest.approx(1.0)
    assert 0 < results['wall_s'] < sum(results['timings_s'].values())  # --jobs 2 by default: overlapping
    assert profile['lm']['tokens'] == pytest.approx(lm['iters'] * lm['tokens_per_iter'])
    assert profile['claims']['tokens'] is None
    best = str(out / 'bit' / 'best.pt')
    assert load_checkpoint(best)['config']['alibi']  # the MLM's ALiBi body, carried into the energy
    # the best energy is evaluated
    assert json.load(open(out / 'ppl.json'))['hashes']['BIT'] == file_hash(best)
    check_claims_from_run(out)

    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and '$ python' not in res.stderr, res.stderr  # the job's lines: stderr
    os.remove(out / 'bit' / 'results.json')  # as if killed after its last checkpoint
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    ran = [line.split(']')[0][1:] for line in res.stderr.splitlines() if '] $ python' in line]
    after = (['bit', 'metrics', 'estimate_ppl', 'samples', 'samples_untruncated', 'claims']
             + (['figures'] if importlib.util.find_spec('matplotlib') else []))
    # what depends on it, in an order the scheduler chose (the longest chain of stage times first)
    assert res.returncode == 0 and sorted(ran) == sorted(after) and ran[0] == 'bit', res.stderr
    assert ran.index('claims') > max(ran.index(s) for s in ('estimate_ppl', 'samples', 'samples_untruncated'))
    assert '--resume' in next(line for line in res.stderr.splitlines() if line.startswith('[bit] $'))


def test_lesson_quick_end_to_end(tmp_path):
    """`python -m job.lesson --quick`: every stage of the lesson with tiny sizes, then its table (each
    decoder's row, the joint mode's paired test against the others) printed and in lesson.json."""
    out = tmp_path / 'out'
    res = run_script(['-m', 'job.lesson', '--quick', '--quiet', '--out_dir', str(out), '--data_dir',
                      str(tmp_path / 'data')], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = json.load(open(out / 'lesson.json'))
    assert [r['decoder'] for r in table['rows']] == [label for label, _ in lesson.ROWS]
    assert 'The lesson: exact sums on 64 held-out test problems, n = 8' in res.stdout
    assert all(0 <= r['exact'] <= 1 and 0 < r['p'] <= 1 for r in table['rows'])


def test_lesson_table_against_hand_counts():
    """lesson_table on outcomes made by hand: exact match, its SE, and McNemar's exact p from the
    discordant pairs (the joint mode right where the LM's greedy sum is wrong on 6 problems, the
    reverse on 1: p = 2 (1 + 7) / 2^7 = 0.125)."""
    n, mode = 10, [1] * 8 + [0] * 2
    greedy = [0] * 6 + [1] * 2 + [1, 0]  # 6 where only the mode is right, 1 where only greedy is
    per = {'BASE LM': {'greedy_exact': greedy, f'majority_{n}_exact': mode, f'rerank_{n}_exact': mode,
                       f'oracle_{n}_exact': [1] * 10},
           'JOINT': {f'a1_{n}_exact': greedy, f'mode_{n}_exact': mode}}
    t = lesson.lesson_table(dict(ns=[1, n], per_problem=per, split='test'))
    rows = {r['decoder']: r for r in t['rows']}
    g = rows['LM greedy']
    assert g['exact'] == 0.3 and g['discordant'] == [6, 1] and g['p'] == pytest.approx(16 / 128)
    assert g['exact_se'] == pytest.approx(np.std(greedy, ddof=1) / math.sqrt(10))
    assert g['mode_minus'] == pytest.approx(0.5) and rows['LM majority vote of n']['p'] == 1.0
    assert t['any_of_n'] == 1.0 and t['a1_minus_greedy'] == 0 and t['num_prefixes'] == 10


def implied_verdict(name, c, p):
    """The verdict a claim's own numbers imply at p-value p: not significant unless p < ALPHA, else
    the sign of its difference (T3: inside its margin); C3 not significant where the better BIT has
    as many parameters as UNIT or more."""
    if p is None or not p < stats.ALPHA:
        return None
    if name == 'T3':
        return abs(c['diff']) < c['margin']
    if name == 'C3' and c['diff'] > 0 and c['params']['JOINT BIT'] >= c['params']['JOINT UNIT']:
        return None
    return c['diff'] > 0


def check_claims_from_run(out):
    """claims.json of a quick run: its fields, each verdict (alone and after Holm) the one its own
    difference and p-value imply, C1 recomputed from ppl.json's per-prefix columns by numpy here.
    Then every JOINT BIT energy of the test split raised by c, by many SE: C1 moves by exactly
    -c / L, C1 and C3 (JOINT BIT better) do not hold, T2 (better than JOINT BIT) holds; lowered by
    c, the reverse; C2 (UNIT vs RALM) as in the copy not raised. The numbers are computed from the run,
    not constants."""
    res = json.load(open(out / 'claims.json'))
    assert set(res['lms']) == {'BASE', 'RALM', 'BALM', 'TAILR'}
    assert set(res['claims']) == {f'C{i}' for i in range(1, 8)} | {'C6u', 'C7u', 'T1', 'T2', 'T3'}
    for m in res['lms'].values():
        assert ({'best_step', 'last_step', 'best_select_loss', 'converged'} <= set(m)
                and m['best_step'] <= m['last_step'])
    for name, c in res['claims'].items():
        assert 'diff' in c and 'se' in c and (c['p'] is None or 0 <= c['p'] <= c['p_holm'] <= 1)
        assert c['holds'] is implied_verdict(name, c, c['p']), (name, c)
        assert c['holds_holm'] is implied_verdict(name, c, c['p_holm']), (name, c)
    assert res['multiplicity']['method'].startswith('Holm') and res['multiplicity']['family']
    test = json.load(open(out / 'ppl.json'))['splits']['test']
    cols, L, n = test['per_prefix'], test['gen_len'], str(test['num_samples'])
    joint = (np.array(cols['lm_logp']) - np.array(cols['energy']['BIT'])
             - np.array(cols['logz']['BIT'][n]['high']))
    d = (joint - np.array(cols['extra_logp']['BALM'])) / L
    c1 = res['claims']['C1']
    assert abs(c1['diff'] - d.mean()) < 1e-9 and abs(c1['se'] - d.std(ddof=1) / math.sqrt(len(d))) < 1e-9
    flagged = any(cols['enum']['BIT']['flagged'])  # Eq. 4 flagged on a prefix: C1 gives no verdict
    assert bool(c1.get('not_measurable')) == flagged and (c1['p'] is None) == flagged
    metric = (np.array(cols['lm_logp']) - np.array(cols['energy']['METRICS'])
              - np.array(cols['logz']['METRICS'][n]['high']))
    gain = (metric - np.array(cols['lm_logp'])) / L  # T1; T3: minus the predicted KL of each prefix
    assert abs(res['claims']['T1']['diff'] - gain.mean()) < 1e-9
    assert abs(res['claims']['T3']['diff'] - (gain - np.array(cols['kl']['METRICS']) / L).mean()) < 1e-9
    c = L * max(abs(res['claims'][k]['diff']) + 20 * res['claims'][k]['se'] for k in ('C1', 'C3', 'T2'))
    params = res['claims']['C3']['params']
    fewer = True if params['JOINT BIT'] < params['JOINT UNIT'] else None
    alone = lambda claim: {k: v for k, v in claim.items() if 'holm' not in k}  # Holm's: of the family
    unshifted = shifted_claims(out, cols, 0, 0)['C2']  # its diagnostics gone as in the shifted ones
    for sign, want in ((1, dict(C1=False, C3=False, T2=True)), (-1, dict(C1=True, C3=fewer, T2=False))):
        moved = shifted_claims(out, cols, sign, c)
        assert abs(moved['C1']['diff'] - (c1['diff'] - sign * c / L)) < 1e-9
        assert {k: moved[k]['holds'] for k in want} == want, (sign, c, moved)
        assert alone(moved['C2']) == alone(unshifted)  # UNIT vs RALM: untouched


def shifted_claims(out, cols, sign, c):
    """job.claims on a copy of the run whose JOINT BIT energies of the test split are raised by sign * c,
    without log Z's diagnostics (enum: Eq. 4's ranges decide)."""
    ppl = json.load(open(out / 'ppl.json'))
    ppl['splits']['test']['per_prefix']['energy']['BIT'] = [e + sign * c for e in cols['energy']['BIT']]
    ppl['splits']['test']['per_prefix'].pop('enum', None)
    perturbed = out / f'perturbed{sign:+d}'
    shutil.copytree(out, perturbed,  # a hand-made variant: no provenance.json, so no chain to check
                    ignore=shutil.ignore_patterns('*.pt', 'neg_*', 'perturbed*', 'provenance.json'))
    with open(perturbed / 'ppl.json', 'w') as f:
        json.dump(ppl, f)
    run = run_script(['-m', 'job.claims', '--out_dir', str(perturbed)])
    assert run.returncode == 0, run.stderr
    return json.load(open(perturbed / 'claims.json'))['claims']


# the scheduler's "done" by provenance (a stage made again when what made it changed): test_provenance.py


# reproduce.py --jobs (issue 37, item 6): stages that need not each other's outputs run at once, each on
# cores // jobs threads and into its own log; a failure or Ctrl-C stops them all with one line

def fake_stage(tmp_path, name, seconds, fail=False):
    """(cmd, done) of a stage that sleeps, then records when it ran and on how many threads (fail:
    True or a mode of tests/scripts/fake_stage.py)."""
    script = os.path.join(SCRIPTS, 'fake_stage.py')
    done = str(tmp_path / f'{name}.json')
    return [str(script), done, str(seconds), 'fail' if fail is True else fail or 'ok'], done


def test_pipeline_jobs_runs_independent_stages_together(tmp_path, capsys):
    """--jobs 2: two stages that need nothing of each other run at the same time, each on the
    threads it was given and into its own log, and the stage that needs both starts after both
    ended; the terminal gets each stage's command and one line as it ends."""
    from job import reproduce
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=2, threads=1)
    for name, deps in (('a', ()), ('b', ()), ('c', ('a', 'b'))):
        pipe.run(name, *fake_stage(tmp_path, name, 1.0), deps)
    pipe.wait()
    a, b, c = (json.load(open(tmp_path / f'{n}.json')) for n in 'abc')
    assert a['start'] < b['end'] and b['start'] < a['end'], (a, b)  # together
    assert c['start'] >= max(a['end'], b['end']) and {a['threads'], b['threads'], c['threads']} == {'1'}
    assert 'stage writing' in (tmp_path / 'c.log').read_text() and not pipe.running
    assert set(json.load(open(tmp_path / 'timings.json'))) == {'a', 'b', 'c'}
    out = capsys.readouterr().err  # the job's diagnostics: stderr
    assert f"> {tmp_path / 'a.log'}" in out
    assert re.search(r'\[b\] finished in \d+s \(its output: .*b\.log\)', out), out
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=2, threads=1)
    pipe.run('a', *fake_stage(tmp_path, 'a', 1.0))  # done: skipped
    assert not pipe.running and 'skipped' in capsys.readouterr().err


@pytest.mark.parametrize('costs, first', [(dict(short=1, long=5, tail=5), 'long'), (None, 'short')])
def test_pipeline_jobs_starts_the_longest_chain_first(tmp_path, costs, first):
    """--jobs 2: when a slot frees and two stages are ready, the one heading the longest chain of
    costs starts (long -> tail: 10 against short's 1), whatever the order they were declared in;
    without costs, the order of declaration."""
    from job import reproduce
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=2, threads=1, costs=costs)
    pipe.run('gate', *fake_stage(tmp_path, 'gate', 0.3))
    pipe.run('other', *fake_stage(tmp_path, 'other', 3))  # holds the second slot
    for name, deps in (('short', ['gate']), ('long', ['gate']), ('tail', ['long'])):
        pipe.run(name, *fake_stage(tmp_path, name, 0), deps)
    assert set(pipe.running) == {'gate', 'other'} and list(pipe.queue) == ['short', 'long', 'tail']
    pipe.wait()
    start = {n: json.load(open(tmp_path / f'{n}.json'))['start'] for n in ('short', 'long')}
    assert min(start, key=start.get) == first, start


def test_pipeline_jobs_failure_stops_the_others_with_one_line(tmp_path):
    """--jobs 2: a stage that fails stops the one running beside it (killed, within seconds: every
    stage resumes), and the job ends with one line naming the stage, its log and its last line."""
    from job import reproduce
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=2, threads=1)
    t0 = time.time()
    pipe.run('slow', *fake_stage(tmp_path, 'slow', 60))
    with pytest.raises(SystemExit) as e:
        pipe.run('bad', *fake_stage(tmp_path, 'bad', 0.5, fail=True))
        pipe.run('after', *fake_stage(tmp_path, 'after', 0), ['bad'])
        pipe.wait()
    msg = str(e.value.code)
    assert msg == (f"error: stage 'bad' failed (its log {tmp_path / 'bad.log'} says: error: boom); fix it "
                   "and rerun: finished stages are skipped"), msg
    assert time.time() - t0 < 30 and not pipe.running
    assert not (tmp_path / 'slow.json').exists() and not (tmp_path / 'after.json').exists()
    with pytest.raises(ValueError, match='--jobs 0: must be at least 1'):
        reproduce_args(['--jobs', '0'])


def test_wall_seconds_is_the_union_of_the_spans():
    """The job's wall time: overlapping stages counted once, a pause between two invocations not at
    all (the closed form by hand)."""
    from job import reproduce
    spans = {'lm': [100.0, 110.0], 'balm': [105.0, 115.0], 'mlm': [106.0, 108.0], 'claims': [200.0, 205.0]}
    assert reproduce.wall_seconds(spans) == 15.0 + 5.0
    assert reproduce.wall_seconds({}) == 0


@pytest.mark.parametrize('cores, quick_jobs', [(1, 1), (2, 2), (16, 2)])
def test_jobs_default_one_two_with_quick(monkeypatch, cores, quick_jobs):
    """--jobs by default: 1; with --quick two stages at a time where there are two cores or more;
    a given --jobs is kept."""
    monkeypatch.setattr(torch, 'get_num_threads', lambda: cores)
    assert reproduce_args([]).jobs == 1 and reproduce_args(['--quick']).jobs == quick_jobs
    assert reproduce_args(['--quick', '--jobs', '3']).jobs == 3


@pytest.mark.parametrize('jobs, mode, said', [
    (2, 'late', "its log {log} says: error: the real reason"),  # the first error line, not the last line
    (2, 'kill', "killed by SIGKILL; its log: {log}"),
    (1, 'kill', "killed by SIGKILL"),
])
def test_pipeline_says_why_a_stage_failed(tmp_path, jobs, mode, said):
    """A failed stage is named by its first `error:` line (what follows is often a consequence),
    a stage ended by a signal as such (issue 48, item 3)."""
    from job import reproduce
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=jobs, threads=1)
    with pytest.raises(SystemExit) as e:
        pipe.run('bad', *fake_stage(tmp_path, 'bad', 0, fail=mode))
        pipe.wait()
    assert str(e.value.code) == (f"error: stage 'bad' failed ({said.format(log=tmp_path / 'bad.log')}); "
                                 "fix it and rerun: finished stages are skipped")


def test_pipeline_stages_die_with_the_job(tmp_path):
    """kill -9 of the job alone (not its process group): its stages die with it (the parent-death
    signal), none runs on as an orphan."""
    cmd, done = fake_stage(tmp_path, 'slow', 60)
    job = subprocess.Popen([sys.executable, '-c', (
        "import sys, time; from job.pipeline import Pipeline\n"
        f"p = Pipeline({str(tmp_path / 'timings.json')!r}, jobs=2, threads=1)\n"
        f"p.run('slow', {cmd!r}, {done!r})\n"
        "print(p.running['slow'][0].pid, flush=True); time.sleep(60)")], cwd=ROOT, stdout=subprocess.PIPE,
        text=True)
    stage = int(next(line for line in job.stdout if line.strip().isdigit()))  # after the command line
    job.kill()
    job.wait()
    alive = lambda: (os.path.exists(f'/proc/{stage}')
                     and 'Z' not in open(f'/proc/{stage}/stat').read().split()[2])  # a zombie is dead
    deadline = time.time() + 10
    while alive() and time.time() < deadline:
        time.sleep(0.1)
    assert not alive()


def test_the_jobs_lock_is_held_by_its_stages(tmp_path):
    """The job's --out_dir lock is held by its stages too: a stage that outlives a kill -9 of the job
    (no parent-death signal: not Linux, or the job died as it forked) keeps a rerun out with one
    line; once it ends, the folder is free."""
    from plumbing import lock_folder, one_job
    cmd, done = fake_stage(tmp_path, 'slow', 60)
    out = str(tmp_path / 'run')
    job = subprocess.Popen([sys.executable, '-c', (
        "import time; from job import pipeline; from plumbing import lock_folder\n"
        "pipeline.stage_setup = lambda job: None  # a stage that does not die with the job\n"
        f"lock_folder({out!r})\n"
        f"p = pipeline.Pipeline({str(tmp_path / 'timings.json')!r}, jobs=2, threads=1)\n"
        f"p.run('slow', {cmd!r}, {done!r})\n"
        "print(p.running['slow'][0].pid, flush=True); time.sleep(60)")], cwd=ROOT, stdout=subprocess.PIPE,
        text=True)
    stage = int(next(line for line in job.stdout if line.strip().isdigit()))
    job.kill()
    job.wait()
    try:
        with pytest.raises(ValueError, match=r"--out_dir .*run is in use by another job"):
            one_job(lock_folder)(out)
    finally:
        os.kill(stage, signal.SIGKILL)
    deadline = time.time() + 10
    while os.path.exists(f'/proc/{stage}') and 'Z' not in open(f'/proc/{stage}/stat').read().split()[2]:
        assert time.time() < deadline
        time.sleep(0.1)
    one_job(lock_folder)(out)  # free


def test_gpu_recipe_larger_batches_fewer_steps():
    """--recipe gpu (job.configs.large_batch): the energies 4x the batch for half the steps, their
    evaluations, warm-up and decay as many; the negatives in larger chunks; nothing else changes.
    Only with --data addition, into its own folder."""
    from job import reproduce
    from job.configs import ADDITION, large_batch
    gpu = large_batch(ADDITION)
    for name in ('bit', 'unit'):
        old, new = ADDITION[name], gpu[name]
        assert set(old) == set(new) and new['batch_size'] == 4 * old['batch_size'], name
        for k in ('max_iters', 'lr_decay_iters', 'eval_interval', 'warmup_iters'):
            if k in old:
                assert abs(new[k] - old[k] / 2) <= 0.5 and new[k] > 0, (name, k)
        assert {k: v for k, v in new.items() if k not in ('batch_size', 'max_iters', 'lr_decay_iters',
                                                           'eval_interval', 'warmup_iters')} == \
            {k: v for k, v in old.items() if k not in ('batch_size', 'max_iters', 'lr_decay_iters',
                                                        'eval_interval', 'warmup_iters')}
    assert gpu['neg'] == dict(ADDITION['neg'], chunk=4096)
    assert {k: v for k, v in gpu.items() if k not in ('bit', 'unit', 'neg')} == \
        {k: v for k, v in ADDITION.items() if k not in ('bit', 'unit', 'neg')}
    args = reproduce.get_args(['--data', 'addition', '--recipe', 'gpu'])
    assert args.cfg == gpu and args.out_dir == 'out-addition-gpu'
    assert reproduce.get_args(['--data', 'addition']).cfg is ADDITION
    with pytest.raises(ValueError, match=r"--recipe gpu is the addition job's .*: add --data addition"):
        reproduce.get_args(['--recipe', 'gpu'])


def test_lm_max_iters_sets_the_base_lms_budget():
    """--lm_max_iters N (--data addition): the base LM's max_iters N, its cosine to N - 500 (the
    recipe's 4,500 / 4,000), every other flag and model as the recipe's, its own default folder; the
    seeds' command passes it to each job. Refused without --data addition."""
    from job import reproduce, seeds
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--lm_max_iters', '7000'])
    assert args.cfg['lm'] == dict(ADDITION['lm'], max_iters=7000, lr_decay_iters=6500)
    rest = lambda cfg: {k: v for k, v in cfg.items() if k != 'lm'}
    assert rest(args.cfg) == rest(ADDITION)
    assert ADDITION['lm']['max_iters'] - ADDITION['lm']['lr_decay_iters'] == 500  # the default's gap
    assert args.out_dir == 'out-addition-lm7000'
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--lm_max_iters', '7000']), 2, 'r/seed2')
    assert cmd[cmd.index('--lm_max_iters') + 1] == '7000'
    assert reproduce.get_args(cmd[3:]).cfg == args.cfg
    assert '--lm_max_iters' not in seeds.seed_command(seeds.get_args(['--seeds', '1,2']), 2, 'r/seed2')
    with pytest.raises(ValueError, match=r"--lm_max_iters is the addition job's .*: add --data addition"):
        reproduce.get_args(['--lm_max_iters', '7000'])


def test_energy_max_iters_sets_the_energies_budget():
    """--energy_max_iters N (--data addition): the UNIT's and the BIT's max_iters N (their cosine to the
    end, as the recipe's), nothing else changed, its own default folder (with --lm_max_iters too); the
    seeds' command passes both budgets to each job. Refused without --data addition."""
    from job import reproduce, seeds
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--energy_max_iters', '16000'])
    for e in ('unit', 'bit'):
        assert args.cfg[e] == dict(ADDITION[e], max_iters=16000) and 'lr_decay_iters' not in ADDITION[e]
    rest = lambda cfg: {k: v for k, v in cfg.items() if k not in ('unit', 'bit')}
    assert rest(args.cfg) == rest(ADDITION) and args.out_dir == 'out-addition-e16000'
    both = ['--lm_max_iters', '7000', '--energy_max_iters', '16000']
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2'] + both), 2, 'r/seed2')
    assert cmd[-4:] == both
    args = reproduce.get_args(cmd[3:])
    assert args.cfg['lm']['max_iters'] == 7000 and args.cfg['bit']['max_iters'] == 16000
    assert reproduce.get_args(['--data', 'addition'] + both).out_dir == 'out-addition-lm7000-e16000'
    with pytest.raises(ValueError, match=r"--energy_max_iters is the addition job's .*: add --data addition"):
        reproduce.get_args(['--energy_max_iters', '16000'])


def test_test_problems_sets_the_accuracy_tables_problems(tmp_path):
    """--test_problems N (--data addition): the accuracy table's num_prefixes N, nothing else changed, its
    own default folder; the seeds' command passes it on. Above the prepared test split, a stage prepares
    the data again with the extra test problems (--extra_test_problems) into <data_dir>_test<N>, which
    only the accuracy table reads: every other split byte for byte the job's, the first test problems
    too. At or below it, no stage and no flag. Refused without --data addition."""
    from data.addition import prepare
    from job import reproduce, seeds, stages
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--test_problems', '10000'])
    assert args.cfg['accuracy'] == dict(ADDITION['accuracy'], num_prefixes=10000)
    rest = lambda cfg: {k: v for k, v in cfg.items() if k != 'accuracy'}
    assert rest(args.cfg) == rest(ADDITION) and args.out_dir == 'out-addition-test10000'
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--test_problems', '10000']), 2, 'r/seed2')
    assert cmd[-2:] == ['--test_problems', '10000'] and reproduce.get_args(cmd[3:]).cfg == args.cfg
    with pytest.raises(ValueError, match=r"--test_problems is the addition job's .*: add --data addition"):
        reproduce.get_args(['--test_problems', '10000'])
    data = tmp_path / 'addition'
    sizes = dict(digits=3, train_problems=40, select_problems=10, val_problems=10, test_problems=10)
    prepare.main(['--out_dir', str(data), '--seed', '1337', '--quiet', *stages.flags(sizes)])

    class Pipe:  # records the stages declared
        runs = []

        def run(self, name, cmd, done, deps=()):
            self.runs.append((name, cmd, done))
    for n, want in ((10, ([], [])), (25, (['--data_dir', f'{data}_test25'], ['prepare_test']))):
        args = reproduce.get_args(['--data', 'addition', '--data_dir', str(data), '--test_problems', str(n)])
        args.cfg = dict(args.cfg, data=sizes)
        assert reproduce.test_data(Pipe(), args) == want
    (name, cmd, done), = Pipe.runs
    assert name == 'prepare_test' and done == os.path.join(f'{data}_test25', 'meta.json')
    assert cmd[:2] == ['-m', 'data.addition.prepare'] and cmd[-2:] == ['--extra_test_problems', '15']
    prepare.main(cmd[2:])
    more = tmp_path / 'addition_test25'
    for split in ('train', 'select', 'val'):
        assert (more / f'{split}.bin').read_bytes() == (data / f'{split}.bin').read_bytes()
    assert (more / 'test.bin').read_bytes().startswith((data / 'test.bin').read_bytes())
    assert json.load(open(more / 'meta.json'))['num_docs']['test'] == 25


def test_pipeline_jobs_same_numbers_as_one_at_a_time(lm_corpus, tmp_path, monkeypatch):
    """The seed decides the numbers, not the schedule: a tiny train_lm stage run alone (--jobs 1,
    OMP_NUM_THREADS=1) and beside another (--jobs 2, one thread each) gives the same results.json
    (times aside) and bit-identical weights; its parameter count is reproduce.lm_params' (BALM's
    target, known before the LM trains)."""
    from job import reproduce

    def train(out, seed=1337):
        return (['train_lm.py', '--data_dir', lm_corpus, '--out_dir', str(out), '--max_iters', '12',
                 '--eval_interval', '4', '--seed', str(seed), *TRAIN_FLAGS], str(out / 'results.json'))
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    pipe = reproduce.Pipeline(str(tmp_path / 'one' / 'timings.json'))
    pipe.run('lm', *train(tmp_path / 'one' / 'lm'))
    pipe = reproduce.Pipeline(str(tmp_path / 'two' / 'timings.json'), jobs=2, threads=1)
    pipe.run('other', *train(tmp_path / 'two' / 'other', seed=7))
    pipe.run('lm', *train(tmp_path / 'two' / 'lm'))
    assert set(pipe.running) == {'other', 'lm'}
    pipe.wait()
    one, two = (json.load(open(tmp_path / d / 'lm' / 'results.json')) for d in ('one', 'two'))
    timeless = lambda r: {k: v for k, v in r.items() if k not in ('train_time_s', 'tokens_per_s')}
    assert timeless(one) == timeless(two) and one['curve']
    wa, wb = (load_checkpoint(tmp_path / d / 'lm' / 'best.pt')['model'] for d in ('one', 'two'))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    flag = lambda f: int(TRAIN_FLAGS[TRAIN_FLAGS.index(f) + 1])
    shape = {k: flag(f'--{k}') for k in ('n_layer', 'n_head', 'n_embd', 'block_size')}
    assert reproduce.lm_params(shape, load_meta(lm_corpus)['vocab_size']) == one['params']


def test_reproduce_quick_addition_end_to_end(tmp_path):
    """`job/reproduce.py --data addition --quick` (issue 31): the same pipeline on the addition
    corpus, with EXO in Table 1 (an LM: one exact PPL, no range) and the accuracy table against the
    known answer, Algorithm 1's best-of-n oracle at least its pick."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--data', 'addition', '--quick', '--quiet',
           '--out_dir', str(out), '--data_dir', str(data)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='2'), timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {(r['model'], r['split']): r for r in json.load(open(out / 'results.json'))['rows']}
    assert {'BASE LM', 'BALM', 'EXO', 'JOINT BIT'} <= {m for m, _ in rows}
    assert 'ppl_low' not in rows['EXO', 'test'] and rows['EXO', 'test']['ppl'] > 1
    acc = json.load(open(out / 'accuracy.json'))
    assert (acc['prefix_len'], acc['gen_len']) == (14, 8)
    joint = [r for r in acc['rows'] if r['model'] == 'JOINT']
    assert [r['n'] for r in joint if r['method'].startswith('Algorithm 1')] == [1, 5, 20]
    exo_methods = {r['method'] for r in acc['rows'] if r['model'] == 'EXO'}
    assert {'majority vote, n = 20', 'log-prob rerank, n = 20', 'oracle, n = 20'} <= exo_methods
    # the scheduler's stage times name the job's stages (a renamed stage would lose its priority)
    assert set(STAGE_SECONDS['addition']) == set(json.load(open(out / 'timings.json')))
    assert all(r['exact'] <= r['oracle_exact'] and r['p_correct'] <= 1 for r in joint)
    assert all(r['p_correct_low'] is None or r['p_correct_low'] <= r['p_correct_high'] <= 1 for r in joint)
    with pytest.raises(ValueError, match='char-level'):
        reproduce_args(['--data', 'addition', '--tokenizer', 'gpt2'])


def reproduce_args(argv):
    from job import reproduce
    return reproduce.get_args(argv)


def test_reproduce_quick_gpt2_end_to_end(tmp_path):
    """The paper's tokenizer (GPT-2 BPE, 50,257 tokens, offline) through every stage of the main
    job, tiny models on the bundled corpus (slow-ish, ~1 min: the vocabulary makes the LM head
    and the exact last-step enumeration big). Every row is there and the last step was enumerated."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--quick', '--tokenizer', 'gpt2', '--quiet',
           '--out_dir', str(out), '--data_dir', str(data)]
    env = dict(os.environ, OMP_NUM_THREADS='2')  # fixed: the numbers, so the thresholds, depend on it
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert load_meta(data)['vocab_size'] == 50257
    rows = {(r['model'], r['split']) for r in json.load(open(out / 'results.json'))['rows']}
    assert rows == {(m, s) for m in ('BASE LM', 'RALM', 'BALM', 'TAILR', 'JOINT UNIT', 'JOINT BIT')
                    for s in ('val', 'test')}
    ps = json.load(open(out / 'ppl.json'))['splits']['test']['per_step']
    assert math.isfinite(ps['last_step_exact_ppl']) and ps['last_step_mc_se'] > 0
    assert (out / 'samples.json').exists()


def test_bench_quick_runs(lm_corpus, tmp_path):
    """bench.py is measured, not tested for speed: this only checks that every section runs and
    that the last line of stdout is the JSON of all figures (also written to --out)."""
    out = tmp_path / 'bench.json'
    res = run_script(['-m', 'job.bench', '--quick', '--quiet', '--data_dir', lm_corpus, '--out', str(out),
                      '--n_layer', '1', '--n_embd', '32', '--n_head', '2', '--block_size', '64',
                      '--batch_size', '2', '--prefix_len', '16', '--num_samples', '2', '--gen_len', '8',
                      '--matmul_size', '128'])
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures == json.load(open(out))
    for key in ('matmul_gflops_fp32', 'train_tokens_per_s_fp32', 'sampling_speedup',
                'energy_forward_seqs_per_s', 'nce_train_tokens_per_s', 'logz_samples_per_s_n1000',
                'joint_samples_per_s_n1000'):
        assert figures[key] > 0, key


def test_figures_draws_the_four_pngs(tmp_path):
    fake_main_job_json(tmp_path)
    res = run_script(['-m', 'job.figures', '--out_dir', str(tmp_path), '--copy_to', str(tmp_path / 'copy')])
    assert res.returncode == 0, res.stderr
    names = ['fig1_per_step.png', 'fig2_left_bounds.png', 'fig2_right_ngrams.png', 'fig3_loglik.png']
    for d in (tmp_path, tmp_path / 'copy'):
        assert sorted(p.name for p in d.glob('*.png')) == names
        for name in names:
            with open(d / name, 'rb') as f:
                assert f.read(8) == b'\x89PNG\r\n\x1a\n', name  # a real PNG, not an empty file
    assert not list(tmp_path.glob('*.tmp'))  # written atomically


def test_data_of_other_flags_is_not_reused(tmp_path):
    """Issue 57, item 4: prepared data records its flags and seed (meta.json's made_with); the job
    asking for another --data_seed or other sizes is refused before its first stage, in one line
    naming the flag and the fix (it said "[prepare] done already" and trained on seed 1337's
    problems). A meta.json from before the record counts as made by the job's defaults."""
    from data.addition import prepare
    from job import reproduce, stages
    data = tmp_path / 'addition'
    sizes = dict(digits=6, train_problems=40, select_problems=10, val_problems=10, test_problems=10)
    prepare.main(['--out_dir', str(data), '--seed', '1337', '--quiet', *stages.flags(sizes)])

    def check(*argv, cfg_data=sizes):
        args = reproduce.get_args(['--data', 'addition', '--quick', '--data_dir', str(data), *argv])
        args.cfg = dict(args.cfg, data=cfg_data)
        reproduce.check_data_dir(args)
    check()
    check('--data_seed', '1337')
    for seed in ('5', '9'):
        with pytest.raises(ValueError, match=rf"--data_dir {data} was prepared with --seed 1337 \(its "
                                             rf"meta.json\), not the --data_seed {seed} this job asks for: "
                                             rf"pass --data_seed 1337 to use it, or a new --data_dir"):
            check('--data_seed', seed)
    with pytest.raises(ValueError, match=r"was prepared with --train_problems 40 \(its meta.json\), not the "
                                         r"--train_problems 200000 this job asks for: pass a new --data_dir"):
        check(cfg_data=dict(digits=6))  # the job's own sizes: 200,000 training problems
    meta = json.load(open(data / 'meta.json'))
    del meta['made_with']  # prepared before the record
    (data / 'meta.json').write_text(json.dumps(meta))
    check()
    with pytest.raises(ValueError, match=r"was prepared with --seed 1337 .*not the --data_seed 5"):
        check('--data_seed', '5')


def test_a_closed_pipe_with_jobs_1_ends_quietly(tmp_path):
    """Issue 57, item 5: `python -m job.reproduce --jobs 1 ... | head -4`: the stage in the terminal
    is ended by the closed pipe (status 141), and so is the job, quietly (it said "error: stage 'lm'
    failed (its message is above)" with nothing above, status 1)."""
    stage = tmp_path / 'stage.py'
    stage.write_text("import plumbing\n\ndef main(argv):\n    for i in range(10 ** 6):\n        print(i)\n\n"
                     "plumbing.run_main(main)\n")
    job = (f"from job.pipeline import Pipeline\nfrom plumbing import run_main\n"
           f"def main(argv):\n    Pipeline({str(tmp_path / 'timings.json')!r}).run('lm', [{str(stage)!r}], "
           f"{str(tmp_path / 'done')!r})\nrun_main(main)\n")
    shell = '"$0" -c "$1" | head -4; exit ${PIPESTATUS[0]}'
    res = subprocess.run(['bash', '-c', shell, sys.executable, job],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                         timeout=120)
    assert res.returncode == 141 and res.stdout == '0\n1\n2\n3\n', res
    assert res.stderr.startswith('[lm] $ python') and 'error' not in res.stderr, res.stderr

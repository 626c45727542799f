"""The main job's scheduler (job/pipeline.py, as job.reproduce drives it): --jobs N runs stages that need
not each other's outputs at once, the longest chain first, each on cores // N threads and into its own
log; a failure, Ctrl-C or a closed pipe stops them all with one line; the job's lock; the same numbers
whatever the schedule. Its "done" by provenance (a stage made again when what made it changed):
test_provenance.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from data import load_meta
from model import load_checkpoint
from tests.common import ROOT, SCRIPTS, TRAIN_FLAGS


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


def test_pipeline_wide_stage_runs_alone_on_every_slot(tmp_path):
    """--jobs 2: a wide stage (the addition job's EXO) waits until the stage running beside it has
    ended, runs on both slots' threads, and a stage ready meanwhile (lower on the critical path)
    starts only after it: no two overlap, and its thread count is the same whatever ran before."""
    from job import reproduce
    pipe = reproduce.Pipeline(str(tmp_path / 'timings.json'), jobs=2, threads=1, costs=dict(wide=5))
    pipe.run('gate', *fake_stage(tmp_path, 'gate', 0.3))
    pipe.run('other', *fake_stage(tmp_path, 'other', 1.5))
    pipe.run('wide', *fake_stage(tmp_path, 'wide', 0.5), ['gate'], wide=True)
    pipe.run('after', *fake_stage(tmp_path, 'after', 0), ['gate'])
    pipe.wait()
    ran = {n: json.load(open(tmp_path / f'{n}.json')) for n in ('other', 'wide', 'after')}
    assert ran['wide']['start'] >= ran['other']['end'] and ran['after']['start'] >= ran['wide']['end'], ran
    assert ran['wide']['threads'] == '2' and ran['other']['threads'] == ran['after']['threads'] == '1'


def test_the_lesson_is_wide(tmp_path, capsys):
    """With --jobs 2 the lesson (which runs alone, before every other stage) is declared wide: on every
    core, so its table is `python -m job.lesson`'s (README's), not a one-thread run's."""
    from job import reproduce
    args = reproduce.get_args(['--jobs', '2', '--out_dir', str(tmp_path)])
    (tmp_path / 'lesson').mkdir()
    (tmp_path / 'lesson' / 'lesson.txt').write_text('the table\n')
    declared = {}

    class Pipe:
        def run(self, name, cmd, done, deps=(), folder=None, wide=False):
            declared[name] = wide

        def wait(self, name=None):
            pass

    reproduce.lesson(Pipe(), args)
    assert declared == {'lesson': True} and 'the table' in capsys.readouterr().out


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
        reproduce.get_args(['--jobs', '0'])


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
    from job import reproduce
    monkeypatch.setattr(torch, 'get_num_threads', lambda: cores)
    assert reproduce.get_args([]).jobs == 1 and reproduce.get_args(['--quick']).jobs == quick_jobs
    assert reproduce.get_args(['--quick', '--jobs', '3']).jobs == 3


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

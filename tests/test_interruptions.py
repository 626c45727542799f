"""What one row of the bad-input table cannot hold: SIGTERM, Ctrl-C and kill -9 at known points (each
resumed or told how to), the memory headroom, the time said up front, NaN gradients, and correct runs
that used to fail. A full disk and writes that land whole: test_full_disk.py. The table itself and its
artifacts: test_bad_input.py.
"""

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import nce_train
import negatives
import plumbing
from plumbing import budget
import sample
from data import load_meta, load_negatives
from data.text import prepare as text_prepare
from energy import Energy, build_energy, energy_state
from model import GPT, GPTConfig, load_checkpoint
from plumbing import guards, save_checkpoint
from tests.common import (CLI_CPU, CLI_NCE, CLI_NEG, CLI_TRAIN, CORPUS, DIAGNOSTIC, ROOT, SCRIPTS, neg_files,
                          without_diagnostics)


def the_jobs_last_line(err):
    """The job's stderr: its "[stage] ..." lines and the setup's diagnostics, then the one line
    returned (None if anything else is there)."""
    *notes, last = err.strip().splitlines() or ['']
    return last if all(n.startswith('[') or DIAGNOSTIC.match(n) for n in notes) else None


def test_ctrl_c_reproduce_jobs_stops_every_stage(cli_run, tmp_path):
    """Ctrl-C with --jobs 2 while the LM and BALM train side by side (each into its log): both
    stop with the pipeline, and the one line is the pipeline's: rerun it."""
    out = str(tmp_path / 'out')
    argv = ['-m', 'job.reproduce', '--quick', '--quiet', '--data_dir', cli_run['data'],
            '--out_dir', out, '--device', 'cpu', '--jobs', '2', '--skip_lesson']  # its lesson: 20 s
    env = dict(os.environ, OMP_NUM_THREADS='2')  # one thread each
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=default_sigint)
    wait_for(lambda: all(os.path.exists(os.path.join(out, d, 'log.jsonl')) for d in ('lm', 'balm')), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and the_jobs_last_line(err) == (
        "interrupted: finished stages are kept and a stopped one resumes; continue with: "
        f"{shlex.join(['python', *argv])}"), err
    assert f"> {os.path.join(out, 'balm.log')}" in err  # the job's lines: stderr
    assert 'threads: 1' in open(os.path.join(out, 'lm.log')).read()
    t0 = time.time()
    with pytest.raises(ProcessLookupError):  # the stages went with it, within seconds
        while time.time() - t0 < 30:
            os.killpg(proc.pid, 0)
            time.sleep(0.05)


# ---- what the table cannot hold of issue 32: SIGTERM, the memory headroom, the time estimate ----

def test_sigterm_says_rerun_like_ctrl_c(cli_run, tmp_path):
    """SIGTERM (kill, a scheduler) while sampling negatives: the same one line as Ctrl-C."""
    out = str(tmp_path / 'neg')
    argv = ['negatives.py', '--lm', cli_run['ckpt'], '--split', 'train', '--out_dir', out,
            '--stride', '1', '--chunk', '1', *CLI_NEG]
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    wait_for(lambda: os.path.exists(os.path.join(out, 'done.bin')) and negatives.chunks_done(out) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and len(without_diagnostics(err)) == 1, err
    assert without_diagnostics(err)[0].startswith(f'interrupted: {negatives.chunks_done(out)} of ')
    assert err.strip().endswith(f"rerun the same command to finish them: {shlex.join(['python', *argv])}")


def test_memory_check_leaves_headroom(monkeypatch):
    """The probe's train_lm.py --batch_size 100000 passed the check (21 GiB estimated, 22.4 GiB
    available) and died: work above 80% of the available memory is refused."""
    config = GPTConfig(block_size=16, vocab_size=30, n_layer=2, n_head=2, n_embd=32)
    need = budget.training_memory(config, 100000)
    monkeypatch.setattr(budget, 'available_memory', lambda device='cpu': int(need * 22.4 / 21))
    with pytest.raises(ValueError, match=r'GiB of memory, more than the .* GiB it may use \(80% of the'):
        budget.check_training_memory(config, 100000, 'cpu', '--batch_size 100000')
    budget.check_training_memory(config, 75000, 'cpu', '--batch_size 75000')


def test_sampling_time_is_said_up_front(tmp_path, capsys):
    """sample.py estimates its time from its forward tokens before it samples: the probe's n = 100000
    with the default LM's shape (4 layers of 256) needs --force; the defaults run, saying so."""
    with torch.device('meta'):
        shape = dict(block_size=256, n_layer=4, n_head=4, n_embd=256)  # train_lm.py's default
        lm = GPT(GPTConfig(vocab_size=78, **shape))
        energy = Energy(GPTConfig(vocab_size=79, causal=False, **shape))
    args = sample.get_args(['--out', str(tmp_path / 's.json'), '--num_samples', '100000'])
    with pytest.raises(ValueError, match=r'--num_samples 100000, --candidate_samples 32 would take ~.* h '
                                         r'by a crude estimate.*--force'):
        guards.check_sampling_time(lm, energy, 4, 128, args, 'cpu')
    args.n = 100
    guards.check_sampling_time(lm, energy, 4, 128, args, 'cpu')
    assert capsys.readouterr().err.startswith(
        'sampling 4 prefixes with --num_samples 100, --candidate_samples 32: ~')
    with pytest.raises(SystemExit):
        sample.get_args(['--help'])
    assert 'to take more than 1.0 h, which is refused without it' in ' '.join(capsys.readouterr().out.split())


def test_nan_gradients_line_says_what_was_saved(tmp_path):
    """A trainer's line for non-finite gradients says the last checkpoint is finite only when one
    was saved (the trainers raise plumbing.diverged's text)."""
    line = plumbing.diverged(6, float('nan'), str(tmp_path))
    assert line.endswith('; nothing was saved (no evaluation came before)') and 'is finite' not in line
    save_checkpoint(dict(kind='lm', model={}, iter_num=4), str(tmp_path / 'ckpt.pt'))
    assert plumbing.diverged(6, float('nan'), str(tmp_path)).endswith(
        f"the last checkpoint saved ({tmp_path}/ckpt.pt, iteration 4) is finite")


# -----------------------------------------------------------------------------
# what the table cannot hold: Ctrl-C, a full disk, and correct runs that used to fail

def default_sigint():
    """In the child: SIGINT back to its default, so Python installs KeyboardInterrupt even when
    pytest was started in the background (where a shell without job control ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# tests/scripts/pauser.py runs a script that stops for good at a known point, so that a test can
# interrupt or kill it there, never after it has finished: right after its first ckpt.pt is saved (a
# trainer), or after its third finished chunk (negatives.py); it then writes PAUSE_MARKER and sleeps

def paused(argv, tmp_path, env, **kw):
    """The script of argv under tests/scripts/pauser.py, started; returns (process, its pause marker)."""
    marker = tmp_path / 'paused'
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, 'pauser.py'), *argv], cwd=ROOT,
                            env=dict(env, PAUSE_MARKER=str(marker), PYTHONPATH=ROOT), **kw)
    return proc, marker


def wait_for(cond, proc, timeout=120):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def test_ctrl_c_train_lm_says_how_to_resume(cli_run, tmp_path):
    """SIGINT mid-training: one line naming the checkpoint and the exact command that resumes; that
    command (with a nearer --max_iters) then continues from the checkpoint."""
    out = str(tmp_path / 'run')
    argv = ['train_lm.py', '--data_dir', cli_run['data'], '--out_dir', out, '--max_iters', '100000',
            '--eval_interval', '3', '--final_eval', '0', *CLI_TRAIN]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc, marker = paused(argv, tmp_path, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=default_sigint)
    wait_for(marker.exists, proc)  # stopped right after its first checkpoint
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = without_diagnostics(err)
    assert proc.returncode == 130 and len(lines) == 1, err
    it = load_checkpoint(os.path.join(out, 'ckpt.pt'))['iter_num']
    assert it == 3
    resume = shlex.join(['python', *argv, '--resume'])
    assert lines[0] == (f"interrupted: {out}/ckpt.pt holds iteration {it} of 100000 (saved every 3); "
                        f"resume with: {resume}"), lines[0]
    assert not [f for f in os.listdir(out) if '.tmp' in f]  # no half-written checkpoint left behind
    cmd = shlex.split(lines[0].split('resume with: ')[1])
    cmd[cmd.index('--max_iters') + 1] = str(it + 2)
    res = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    results = json.load(open(os.path.join(out, 'results.json')))
    assert results['iters'] == it + 2 and load_checkpoint(os.path.join(out, 'ckpt.pt'))['iter_num'] == it + 2


def test_ctrl_c_negatives_says_rerun(cli_run, tmp_path):
    """SIGINT while sampling: one line saying how many chunks are saved and that the same command
    finishes them; it does."""
    out = str(tmp_path / 'neg')
    argv = ['negatives.py', '--lm', cli_run['ckpt'], '--split', 'train', '--out_dir', out,
            '--stride', '1', '--chunk', '1', *CLI_NEG]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc, marker = paused(argv, tmp_path, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=default_sigint)
    done = os.path.join(out, 'done.bin')
    wait_for(marker.exists, proc)  # stopped right after its third chunk
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = without_diagnostics(err)
    assert proc.returncode == 130 and len(lines) == 1, err
    n_done, n_chunks = negatives.chunks_done(out), len(open(done, 'rb').read())
    assert n_done == 3 < n_chunks
    assert lines[0] == (f"interrupted: {n_done} of {n_chunks} chunks of negatives are saved in {out}; "
                        f"rerun the same command to finish them: {shlex.join(['python', *argv])}"), lines[0]


def test_kill_9_under_load_then_resume_is_exact(cli_run, tmp_path):
    """kill -9 of train_lm.py and negatives.py beside a busy process (two threads, --dtype auto,
    OpenMP's wait policy chosen for the load), then the resume: the same weights (torch.equal) and
    byte-identical negatives as uninterrupted runs on the idle machine."""
    def argvs(name):
        train = ['train_lm.py', '--data_dir', cli_run['data'], '--out_dir', str(tmp_path / name),
                 '--max_iters', '100', '--eval_interval', '5', '--final_eval', '0', *CLI_TRAIN]
        neg = ['negatives.py', '--lm', cli_run['ckpt'], '--split', 'train', '--num_prefixes', '40',
               '--chunk', '1', '--out_dir', str(tmp_path / f'{name}_neg'), *CLI_NEG]
        return [[a if a != 'float32' else 'auto' for a in argv] for argv in (train, neg)]
    env = dict(os.environ, OMP_NUM_THREADS='2')
    for argv in argvs('a'):
        res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr
    busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    try:
        train, neg = argvs('b')
        ckpt, done = tmp_path / 'b' / 'ckpt.pt', tmp_path / 'b_neg' / 'done.bin'
        for argv in (train, neg):  # each killed where it paused: after its first checkpoint, third chunk
            proc, marker = paused(argv, tmp_path, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for(marker.exists, proc)
            proc.kill()
            proc.wait()
            marker.unlink()
        assert load_checkpoint(str(ckpt))['iter_num'] == 5
        assert negatives.chunks_done(str(done.parent)) == 3 < len(done.read_bytes())
        for argv in (train + ['--resume'], neg):
            res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
            assert res.returncode == 0, res.stderr
    finally:
        busy.kill()
        busy.wait()
    ca, cb = (load_checkpoint(str(tmp_path / d / 'ckpt.pt')) for d in 'ab')
    assert ca['iter_num'] == cb['iter_num'] == 100
    assert all(torch.equal(ca['model'][k], cb['model'][k]) for k in ca['model'])
    assert neg_files(str(tmp_path / 'a_neg')) == neg_files(str(tmp_path / 'b_neg'))


def test_ctrl_c_reproduce_says_rerun(cli_run, tmp_path):
    """Ctrl-C at the terminal (SIGINT to the whole process group) during a stage: the stage is
    stopped with the pipeline, and the one line is the pipeline's: rerun it."""
    out = str(tmp_path / 'out')
    argv = ['-m', 'job.reproduce', '--quick', '--quiet', '--data_dir', cli_run['data'],
            '--out_dir', out, '--device', 'cpu', '--skip_lesson']  # the lesson first would take 20 s
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=default_sigint)
    wait_for(lambda: os.path.exists(os.path.join(out, 'lm', 'log.jsonl')), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and the_jobs_last_line(err) == (
        "interrupted: finished stages are kept and a stopped one resumes; continue with: "
        f"{shlex.join(['python', *argv])}"), err
    t0 = time.time()
    with pytest.raises(ProcessLookupError):  # the stage went with it, within seconds
        while time.time() - t0 < 30:
            os.killpg(proc.pid, 0)
            time.sleep(0.05)


def test_a_second_ctrl_c_still_ends_in_one_line(monkeypatch, capsys):
    """Ctrl-C while the first one's line is being made (its resume hint loads a checkpoint): the
    same one line, exit 130; later SIGINTs are ignored while it is printed."""
    handlers = []
    monkeypatch.setattr(signal, 'signal', lambda sig, handler: handlers.append((sig, handler)))
    monkeypatch.setattr(sys, 'argv', ['x.py', '--a', '1'])

    def interrupted(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        plumbing.run_main(interrupted, resume_hint=interrupted)
    ignored = [(signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_IGN)]
    assert e.value.code == 130 and handlers == [(signal.SIGTERM, plumbing.interrupt), *ignored]  # as Ctrl-C
    assert capsys.readouterr().err == "interrupted: nothing was saved; rerun: python x.py --a 1\n"


def test_sample_data_dir_from_another_working_directory(cli_run, tmp_path):
    """An LM trained with a relative --data_dir: from another folder sample.py cannot find its data
    (one line naming it, where it comes from and the flag), and --data_dir points it there."""
    A = cli_run
    rel = os.path.relpath(A['data'], A['root'])
    ck = load_checkpoint(A['ckpt'])
    ck['meta']['data_dir'] = rel
    lm = str(tmp_path / 'rel_lm.pt')
    save_checkpoint(ck, lm)
    meta = dict(load_meta(A['data']), data_dir=A['data'])
    energy = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    save_checkpoint(energy_state(energy, lm, meta), str(tmp_path / 'energy.pt'))
    argv = [sys.executable, os.path.join(ROOT, 'sample.py'), '--lm', lm,
            '--energy', str(tmp_path / 'energy.pt'), '--prompt', 'the quick', '--gen_len', '4',
            '--num_samples', '3',
            '--table_k', '2', '--out', str(tmp_path / 's.json'), *CLI_CPU]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    res = subprocess.run(argv, cwd=str(tmp_path), capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0 and '\n'.join(without_diagnostics(res.stderr)) == (
        f"error: {lm} was trained on the data in {rel}, which holds no prepared data seen from here "
        f"({tmp_path}): pass --data_dir with that data"), res.stderr
    res = subprocess.run(argv + ['--data_dir', A['data']], cwd=str(tmp_path), capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.load(open(tmp_path / 's.json'))['samples'][0]['prefix'] == 'the quick'


def test_incomplete_negatives_name_the_command_that_finishes_them(cli_run, tmp_path):
    """nce_train.py on an unfinished negatives folder prints the negatives.py command that
    finishes it; run, it ends with the same files as the uninterrupted run."""
    d = str(tmp_path / 'neg')
    shutil.copytree(cli_run['neg_incomplete'], d)
    with open(os.path.join(d, 'done.bin'), 'r+b') as f:
        n = len(f.read())
        f.seek(0)
        f.write(bytes([1, 1]) + bytes(n - 2))  # the first two chunks done, the rest garbage
    neg = load_negatives(d, mode='r+')
    for name in ('tokens', 'logp', 'logq'):
        neg[name][16:] = 7
        neg[name].flush()
    del neg
    with pytest.raises(ValueError, match='incomplete: rerun negatives.py with the same flags') as e:
        nce_train.main(['--lm', cli_run['ckpt'], '--negatives', cli_run['neg_train'],
                        '--held_out_negatives', d, '--out_dir', str(tmp_path / 'e'), *CLI_NCE])
    cmd = shlex.split(str(e.value).split('to finish them: ')[1])
    assert cmd[:2] == ['python', 'negatives.py']
    negatives.main(cmd[2:] + ['--device', 'cpu', '--dtype', 'float32', '--quiet'])
    for f in ('tokens.bin', 'logp.bin', 'logq.bin', 'done.bin', 'offsets.npy'):
        assert (open(os.path.join(d, f), 'rb').read()
                == open(os.path.join(cli_run['neg_select'], f), 'rb').read()), f
    assert json.load(open(os.path.join(d, 'meta.json')))['complete']


def test_negatives_folder_with_nothing_done_restarts(cli_run, tmp_path):
    """A negatives folder holding no finished chunk (e.g. stopped at once) has nothing to lose: a
    rerun with other settings starts it again instead of refusing, and finishes it."""
    out = str(tmp_path / 'neg')
    flags = ['--lm', cli_run['ckpt'], '--split', 'val', '--out_dir', out, *CLI_NEG]
    negatives.main([*flags, '--chunk', '4'])
    with open(os.path.join(out, 'done.bin'), 'r+b') as f:
        n = len(f.read())
        f.seek(0)
        f.write(bytes(n))  # no chunk done
    negatives.main([*flags, '--chunk', '5', '--gen_len', '3'])
    neg = json.load(open(os.path.join(out, 'meta.json')))
    assert neg['complete'] and neg['chunk'] == 5 and neg['gen_len'] == 3


def test_prepare_identical_rerun_keeps_files_and_force_replaces(cli_run, tmp_path):
    """Rerunning prepare.py with the same input rewrites nothing (models and reproduce.py's
    timestamps see the same files); other input needs --force."""
    raw = tmp_path / 'a.txt'
    raw.write_text(CORPUS)
    out = str(tmp_path / 'data')
    text_prepare.main([str(raw), '--out_dir', out, '--quiet'])
    stamps = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    time.sleep(0.01)
    text_prepare.main([str(raw), '--out_dir', out, '--quiet'])
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == stamps
    other = tmp_path / 'other.txt'
    other.write_text("a different text with the same letters, of course.\n" * 40)
    with pytest.raises(ValueError, match='already holds other prepared data'):
        text_prepare.main([str(other), '--out_dir', out, '--quiet'])
    text_prepare.main([str(other), '--out_dir', out, '--quiet', '--force'])
    assert load_meta(out)['num_tokens'] != load_meta(cli_run['data'])['num_tokens']


def test_nce_results_are_finite_and_best_exists(cli_run):
    """The fixture's short NCE run: results.json parses strictly and the best.pt it names exists."""
    res = json.load(open(os.path.join(cli_run['nce'], 'results.json')),
                    parse_constant=lambda c: pytest.fail(f'{c} in results.json'))
    assert math.isfinite(res['best_value']) and os.path.exists(cli_run['energy'])



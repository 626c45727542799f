"""The method's runs stopped and resumed, distributed and in fp16: resume is exact, one job per
folder, DDP on 2 processes and torchrun as documented (a rank killed under it), every collective on
the run's device; a diverged run's checkpoints stay finite, non-finite ones are refused, results
are not replaced without --force. The method's own tests: test_all.py and the files it names.
"""

import ast
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import estimate_ppl
from extensions import metric_ebm
import nce_train
import negatives
import plumbing
import sample
import train_lm
from data import load_negatives
from energy import load_energy
from model import GPT, load_checkpoint, load_lm
from plumbing import guards, save_checkpoint
from tests.common import (NCE_FLAGS, NEG_FLAGS, ROOT, SCRIPTS, TRAIN_FLAGS, assert_clean_error, is_test,
                          neg_files, ppl_argv, python_files, read_log, run_script)


# =============================================================================
# ==== the method's runs stopped and resumed, distributed, in fp16: resume is exact, one job per
#      folder, torchrun as documented, the collectives on the run's device ====

def test_resume_is_exact(lm_corpus, tmp_path):
    flags = ['--data_dir', lm_corpus, '--eval_interval', '4', '--log_interval', '1', '--lr_decay_iters', '8',
             '--dropout', '0.1', '--final_eval', '0', *TRAIN_FLAGS]
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    train_lm.main(['--out_dir', a, '--max_iters', '8', *flags])
    train_lm.main(['--out_dir', b, '--max_iters', '4', *flags])
    assert load_checkpoint(os.path.join(b, 'ckpt.pt'))['iter_num'] == 4
    with open(os.path.join(b, 'log.jsonl'), 'a') as f:  # a killed attempt went on past the checkpoint
        f.write('{"iter": 5, "loss": 99.0}\n{"iter": 6, "loss": 99.0}\n{"iter": 7, "lo')
    torch.manual_seed(123)  # whatever the global RNG holds, resume restores the checkpoint's
    train_lm.main(['--out_dir', b, '--max_iters', '8', '--resume', *flags])
    la, va = read_log(a)
    lb, vb = read_log(b)
    assert sorted(la) == sorted(lb) == list(range(1, 9))
    iters = [[json.loads(line)['iter'] for line in open(os.path.join(d, 'log.jsonl'))] for d in (a, b)]
    assert iters[0] == iters[1], iters  # the killed attempt's lines after iteration 4 are gone
    for it in range(1, 9):
        assert abs(la[it] - lb[it]) <= 1e-6, (it, la[it], lb[it])
    assert abs(va[8] - vb[8]) <= 1e-6
    ca, cb = (load_checkpoint(os.path.join(d, 'ckpt.pt')) for d in (a, b))
    assert ca['iter_num'] == cb['iter_num'] == 8
    for k in ca['model']:
        assert (ca['model'][k] - cb['model'][k]).abs().max().item() <= 1e-6, k


# fp16 (a V100's precision) trains with a GradScaler: an overflowing step is skipped and the loss
# scale halved; tests/scripts/fp16_overflow.py runs a trainer with the gradients made infinite at one step

def test_fp16_scaler_skips_an_overflow_and_resumes_exactly(lm_corpus, tmp_path):
    """--dtype float16: at step 3 the gradients overflow; the GradScaler skips that step (the
    weights do not move), halves its scale and training goes on; stopped at step 4 and resumed,
    the run ends with the very weights and scale of the uninterrupted one."""
    flags = ['--data_dir', lm_corpus, '--eval_interval', '2', '--log_interval', '1', '--lr_decay_iters', '8',
             '--final_eval', '0', *[f if f != 'float32' else 'float16' for f in TRAIN_FLAGS]]
    runs = {}
    for name, max_iters, overflow in (('a', 8, '3'), ('b', 4, '3'), ('b', 8, '0'), ('c', 2, '0')):
        out = str(tmp_path / name)
        resume = ['--resume'] if os.path.exists(os.path.join(out, 'ckpt.pt')) else []
        res = run_script([os.path.join(SCRIPTS, 'fp16_overflow.py'), 'train_lm.py', '--out_dir', out,
                          '--max_iters', str(max_iters), *resume, *flags],
                         env=dict(OVERFLOW_AT=overflow, PYTHONPATH=ROOT))
        assert res.returncode == 0, res.stderr
        runs[name] = load_checkpoint(os.path.join(out, 'ckpt.pt'))
    a, b, c = runs['a'], runs['b'], runs['c']
    assert a['args']['dtype'] == 'float16' and a['iter_num'] == b['iter_num'] == 8
    assert a['scaler']['scale'] == b['scaler']['scale'] == c['scaler']['scale'] / 2  # halved once
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    grad_norms = {r['iter']: r['grad_norm'] for r in map(json.loads, open(tmp_path / 'a' / 'log.jsonl'))
                  if 'grad_norm' in r}
    assert grad_norms[3] is None and all(math.isfinite(grad_norms[i]) for i in (1, 2, 4, 5, 6, 7, 8))


def test_collectives_run_on_the_run_device():
    """Every tensor handed to dist.all_reduce or dist.broadcast is moved to the run's device in the
    function that hands it over (NCCL refuses a CPU tensor; gloo, in the 2-process tests on a CPU,
    takes any): read from the code, so that a CPU-only machine sees what only a GPU run would. The
    trainers' sums go through plumbing's all_reduce, which moves them (counted: its callers)."""
    bad, calls, helper = [], 0, 0
    for path, tree in python_files().items():
        if is_test(path):
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            moved = {ast.unparse(n.targets[0]) for n in ast.walk(fn)
                     if isinstance(n, ast.Assign) and len(n.targets) == 1
                     and re.search(r"\.to\(device\)|device=device", ast.unparse(n.value))}
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                name = ast.unparse(call.func)
                helper += name == 'all_reduce' and ast.unparse(call.args[1]) == 'device'
                if name in ('dist.all_reduce', 'dist.broadcast'):
                    calls += 1
                    if ast.unparse(call.args[0]) not in moved:
                        bad.append(f'{path}:{call.lineno} {fn.name}: {ast.unparse(call)}')
    assert calls >= 1 and helper >= 4 and not bad, (calls, helper, bad)


def test_negatives_resume_byte_identical(train_negatives, tmp_path, monkeypatch):
    a, flags = train_negatives
    b = str(tmp_path / 'b')
    # b: killed while sampling its third chunk (of 5), after a partial write of that chunk's rows
    orig, calls = GPT.generate, []

    def killed_at_third_chunk(self, *args, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return orig(self, *args, **kw)

    monkeypatch.setattr(GPT, 'generate', killed_at_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        negatives.main(['--out_dir', b, *flags])
    monkeypatch.setattr(GPT, 'generate', orig)
    part = load_negatives(b, mode='r+')
    assert part['done'].tolist() == [1, 1, 0, 0, 0] and not part['meta']['complete']
    rng = np.random.default_rng(0)
    for name in ('tokens', 'logp', 'logq', 'pos_logp', 'pos_logq'):
        part[name][10:15] = rng.integers(0, 60000, part[name][10:15].shape)
        part[name].flush()
    del part
    with pytest.raises(ValueError, match='incomplete: rerun negatives.py with the same flags'):
        load_negatives(b)
    fa, fb = neg_files(a), neg_files(b)
    assert fa['tokens.bin'] != fb['tokens.bin'] and fa['done.bin'] != fb['done.bin']
    assert fa['tokens.bin'][:10 * 3 * 4 * 2] == fb['tokens.bin'][:10 * 3 * 4 * 2]  # the two done chunks
    res = run_script(['negatives.py', '--out_dir', b, *flags])
    assert res.returncode == 0, res.stdout + res.stderr
    assert neg_files(b) == fa
    res = run_script(['negatives.py', '--out_dir', b, *flags])  # complete: nothing left to do
    assert res.returncode == 0 and neg_files(b) == fa


@pytest.mark.parametrize('script', ['train_lm.py', 'nce_train.py'])
def test_torchrun_as_documented(script, lm_corpus, lm_ckpt, fox_negatives, tmp_path):
    """`torchrun --standalone --nproc_per_node N SCRIPT ...` runs as docs/using.md writes it, without
    --grad_accum: by default one micro-batch per process (it stopped at the old default of 1). A bad
    flag there is one `error:` line, from rank 0, and a nonzero exit: no rank's traceback (torchrun's
    own report of the failed process follows)."""
    flags = {'train_lm.py': ['--data_dir', lm_corpus, '--final_eval', '0', *TRAIN_FLAGS],
             'nce_train.py': ['--lm', lm_ckpt, '--negatives', fox_negatives['train'],
                              '--held_out_negatives', fox_negatives['select'], *NCE_FLAGS]}[script]
    torchrun = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', script,
                '--max_iters', '2', '--eval_interval', '2', *flags, '--device', 'cpu']
    res = run_script([*torchrun, '--out_dir', str(tmp_path / 'out')])
    assert res.returncode == 0 and '2 process(es)' in res.stdout, res.stderr[-3000:]
    assert load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))['args']['grad_accum'] == 2
    res = run_script([*torchrun, '--out_dir', str(tmp_path / 'bad'), '--lr', '-1'])
    errors = [line for line in res.stderr.splitlines() if line.startswith('error:')]
    assert res.returncode != 0 and errors == ['error: --lr -1.0: must be above 0'], res.stderr
    assert f'{script}", line' not in res.stderr and not (tmp_path / 'bad').exists()


def rank_pid(parent, rank):
    """The pid of the torchrun worker of `rank` among parent's children (None until it has started)."""
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/status') as f:
                ppid = int(next(line for line in f if line.startswith('PPid:')).split()[1])
            with open(f'/proc/{pid}/environ', 'rb') as f:
                environ = f.read().split(b'\0')
        except (OSError, StopIteration):
            continue
        if ppid == parent and f'RANK={rank}'.encode() in environ:
            return int(pid)
    return None


@pytest.mark.skipif(not os.path.exists('/proc/self/environ'), reason='Linux only')
def test_torchrun_a_killed_rank_leaves_one_line(lm_corpus, tmp_path):
    """kill -9 of rank 1 mid-training under torchrun: the survivor's collective fails (gloo:
    connection reset by peer) and it says so in one line, no traceback of ours (peer_lost); if
    torchrun's SIGTERM reaches it first, its one line is the Ctrl-C one. torchrun's own report follows."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
           'train_lm.py', '--data_dir', lm_corpus, '--final_eval', '0', *TRAIN_FLAGS, '--max_iters', '100000',
           '--eval_interval', '100000', '--device', 'cpu', '--out_dir', str(tmp_path / 'out')]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS='1'))
    try:
        while '2 process(es)' not in proc.stdout.readline():  # rank 0 is training
            assert proc.poll() is None, proc.stderr.read()
        pid = rank_pid(proc.pid, 1)
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    ours = [line for line in err.splitlines() if line.startswith(('error:', 'interrupted:'))]
    assert proc.returncode != 0 and len(ours) == 1, err[-3000:]
    assert ours[0].startswith(('error: rank 0: another process of this torchrun job stopped', 'interrupted:'))
    assert 'train_lm.py", line' not in err, err[-3000:]


def test_a_signal_while_exiting_after_the_one_line_is_no_traceback():
    """torchrun's SIGTERM reaching a survivor after its one line, as the interpreter's atexit callbacks
    run (1 try in 4 after a killed rank): no "Exception ignored in atexit callback ... raise
    KeyboardInterrupt" after it (run_main: signals_end_quietly)."""
    res = run_script([os.path.join(SCRIPTS, 'atexit_signal.py')])
    assert res.stderr.strip() == 'error: the one line', res.stderr
    assert res.returncode == 128 + signal.SIGTERM


def test_a_collective_error_without_a_lost_peer_stays_a_traceback(monkeypatch):
    """peer_lost is narrow: a RuntimeError under torchrun that does not say a peer is gone, or
    gloo's words in a single process, is a bug and keeps its traceback."""
    def raising(text):
        def main(argv):
            raise RuntimeError(text)
        return main
    gone = raising('[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5009: Connection reset by peer')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '1')
    with pytest.raises(SystemExit, match='error: rank 1: another process of this torchrun job stopped'):
        plumbing.run_main(gone)
    with pytest.raises(RuntimeError, match='shapes'):
        plumbing.run_main(raising('shapes cannot be multiplied'))
    monkeypatch.setenv('WORLD_SIZE', '1')
    with pytest.raises(RuntimeError, match='Connection reset'):
        plumbing.run_main(gone)


def test_one_job_per_folder_and_no_stale_lock(tmp_path):
    """A folder that a job holds (lock_folder: the trainers', reproduce.py's --out_dir) is refused to
    a second job with one line; a job killed with kill -9 leaves no stale lock behind."""
    d = str(tmp_path / 'out')
    hold = ('import sys, time, plumbing; plumbing.lock_folder(sys.argv[1]); print("locked", flush=True); '
            'time.sleep(120)')
    holder = subprocess.Popen([sys.executable, '-c', hold, d], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'locked'
        with pytest.raises(ValueError, match=f'--out_dir {d} is in use by another job'):
            plumbing.lock_folder(d)
    finally:
        holder.kill()  # SIGKILL: nothing of it runs
        holder.wait()
    held = dict(plumbing.LOCKS)
    plumbing.one_job(plumbing.lock_folder)(d)  # free again; and released as the job returns
    assert plumbing.LOCKS == held
    plumbing.one_job(plumbing.lock_folder)(d)


def test_nce_resume_is_exact(lm_corpus, tmp_path):
    """A UNIT from an LM with dropout 0.1, ranking NCE over 2 of 3 negatives: the resumed run
    continues the dropout draws too, also where the stopped run's folder and everything it read
    was moved before the --resume (ckpt.pt recorded the old paths; their contents decide)."""
    def flags(root):
        lm = os.path.join(root, 'lm', 'ckpt.pt')
        return ['--lm', lm, '--init_from', lm, '--negatives', os.path.join(root, 'train'),
                '--held_out_negatives', os.path.join(root, 'select'),
                '--body', 'unit', '--loss', 'ranking', '--num_neg', '2', '--eval_interval', '4',
                '--log_interval', '1', '--lr_decay_iters', '8', '--lr', '1e-2', *NCE_FLAGS[6:]]
    run, moved = str(tmp_path / 'run'), str(tmp_path / 'moved')
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', os.path.join(run, 'lm'), '--max_iters', '2',
                   '--eval_interval', '2', '--final_eval', '0', '--dropout', '0.1', *TRAIN_FLAGS])
    for split in ('train', 'select'):
        negatives.main(['--lm', os.path.join(run, 'lm', 'ckpt.pt'), '--split', split,
                        '--out_dir', os.path.join(run, split), '--num_prefixes', '24', *NEG_FLAGS])
    a, b = str(tmp_path / 'a'), os.path.join(run, 'b')
    nce_train.main(['--out_dir', a, '--max_iters', '8', *flags(run)])
    nce_train.main(['--out_dir', b, '--max_iters', '4', *flags(run)])
    cb = load_checkpoint(os.path.join(b, 'ckpt.pt'))
    assert cb['iter_num'] == 4 and cb['energy_kind'] == 'unit' and cb['config']['dropout'] == 0.1
    os.rename(run, moved)
    b = os.path.join(moved, 'b')
    torch.manual_seed(123)
    nce_train.main(['--out_dir', b, '--max_iters', '8', '--resume', *flags(moved)])
    (la, va), (lb, vb) = read_log(a), read_log(b)
    assert sorted(la) == sorted(lb) == list(range(1, 9)) and sorted(va) == sorted(vb) == [4, 8]
    for it in range(1, 9):
        assert abs(la[it] - lb[it]) <= 1e-6, (it, la[it], lb[it])
    assert abs(va[8] - vb[8]) <= 1e-6
    assert abs(la[1] - math.log(3)) < 1e-6  # E = 0 at the start: ranking among 3 is ln 3
    ca, cb = (load_checkpoint(os.path.join(d, 'ckpt.pt')) for d in (a, b))
    assert ca['iter_num'] == cb['iter_num'] == 8
    for k in ca['model']:
        assert (ca['model'][k] - cb['model'][k]).abs().max().item() <= 1e-6, k


def test_resume_keeps_the_precision_of_the_run(lm_corpus, tmp_path, monkeypatch):
    """--dtype auto: a run started in bf16 (the CPU said it has bf16 units) and resumed where the
    hardware would now say fp32 continues in bf16, recorded in its checkpoint: the same weights as
    the uninterrupted run (torch.equal). A --dtype that contradicts the checkpoint is refused."""
    flags = ['--data_dir', lm_corpus, '--eval_interval', '4', '--log_interval', '1', '--lr_decay_iters', '8',
             '--final_eval', '0', *TRAIN_FLAGS[:-2], '--dtype', 'auto']
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    monkeypatch.setattr(plumbing.device, 'cpu_bf16_units', lambda: 'avx512_bf16')
    assert train_lm.main(['--out_dir', a, '--max_iters', '8', *flags])['dtype'] == 'bfloat16'
    train_lm.main(['--out_dir', b, '--max_iters', '4', *flags])
    monkeypatch.setattr(plumbing.device, 'cpu_bf16_units', lambda: '')  # a fresh run would now pick fp32
    assert train_lm.main(['--out_dir', b, '--max_iters', '8', '--resume', *flags])['dtype'] == 'bfloat16'
    ca, cb = (load_checkpoint(os.path.join(d, 'ckpt.pt')) for d in (a, b))
    assert cb['args']['dtype'] == 'bfloat16'
    assert all(torch.equal(ca['model'][k], cb['model'][k]) for k in ca['model'])
    with pytest.raises(ValueError, match='--dtype float32 contradicts .*trained in bfloat16'):
        train_lm.main(['--out_dir', b, '--max_iters', '12', '--resume', *flags, '--dtype', 'float32'])


def test_diverging_training_stops_and_keeps_finite_checkpoints(lm_corpus, tmp_path):
    """A run that diverges (resumed at the lr of 1e30 its checkpoint was given: --resume refuses a
    contradicting --lr) ends with one line naming the divergence and the flags, and its last
    checkpoint, from before the divergence, is untouched and finite;
    --weight_decay inf and --final_eval_windows -1 are refused before any work."""
    out = tmp_path / 'lr'
    argv = ['train_lm.py', '--data_dir', lm_corpus, '--out_dir', str(out), '--eval_interval', '2',
            '--final_eval', '0', *TRAIN_FLAGS]
    assert run_script([*argv, '--max_iters', '4']).returncode == 0
    ckpt = load_checkpoint(str(out / 'ckpt.pt'))
    ckpt['args'].update(lr=1e30, min_lr=1e30)  # what --resume continues (past --lr_decay_iters too)
    torch.save(ckpt, out / 'ckpt.pt')
    saved = {name: (out / name).read_bytes() for name in ('ckpt.pt', 'best.pt')}
    res = run_script([*argv, '--max_iters', '8', '--resume'])
    assert_clean_error(res, 'diverged', '--lr')
    assert {name: (out / name).read_bytes() for name in saved} == saved
    for name in saved:
        assert all(torch.isfinite(v).all() for v in load_checkpoint(str(out / name))['model'].values())
    for bad, flag in ((['--weight_decay', 'inf'], '--weight_decay'),
                      (['--final_eval_windows', '-1'], '--final_eval_windows')):
        with pytest.raises(ValueError, match=flag):
            train_lm.main(['--data_dir', lm_corpus, '--out_dir', str(tmp_path / 'x'), *TRAIN_FLAGS, *bad])
        assert not (tmp_path / 'x').exists()


def test_load_energy_refuses_non_finite_weights(eval_ckpts, tmp_path):
    ck = load_checkpoint(eval_ckpts['bit'])
    ck['model'] = {k: v * float('inf') if k.endswith('head.weight') else v for k, v in ck['model'].items()}
    save_checkpoint(ck, str(tmp_path / 'inf.pt'))
    with pytest.raises(ValueError, match='non-finite weights'):
        load_energy(str(tmp_path / 'inf.pt'))


def test_load_lm_refuses_non_finite_weights(lm_ckpt, tmp_path):
    ck = load_checkpoint(lm_ckpt)
    ck['model'] = {k: v * float('nan') if k.endswith('lm_head.weight') else v for k, v in ck['model'].items()}
    save_checkpoint(ck, str(tmp_path / 'nan.pt'))
    with pytest.raises(ValueError, match='non-finite weights'):
        load_lm(str(tmp_path / 'nan.pt'))


def test_results_are_not_replaced_without_force(lm_ckpt, eval_ckpts, tmp_path):
    """estimate_ppl.py --out (and its .txt), sample.py --out and metric_ebm.py's folder are refused
    when they exist, untouched; --force replaces them."""
    out = tmp_path / 'ppl.json'
    out.write_text('{"keep": 1}')
    argv = ppl_argv(lm_ckpt, eval_ckpts['bit'], out, '--calib_prefixes', '0')
    with pytest.raises(ValueError, match='pass --force'):
        estimate_ppl.main(argv)
    assert out.read_text() == '{"keep": 1}'
    estimate_ppl.main(argv + ['--force'])
    assert 'rows' in json.loads(out.read_text())
    with pytest.raises(ValueError, match=r'ppl.txt already exist'):
        estimate_ppl.main(argv)
    (tmp_path / 's.json').write_text('{}')
    with pytest.raises(ValueError, match='pass --force'):
        guards.check_sample_flags(sample.get_args(['--lm', lm_ckpt, '--energy', eval_ckpts['bit'], '--out',
                                                   str(tmp_path / 's.json')]))
    (tmp_path / 'm').mkdir()
    (tmp_path / 'm' / 'energy.pt').write_text('x')
    with pytest.raises(ValueError, match='pass --force'):
        metric_ebm.get_args(['--lm', lm_ckpt, '--out_dir', str(tmp_path / 'm')])

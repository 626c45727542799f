"""A full disk and writes that land whole: one line naming the file and its sizes, on a real tmpfs where
one can be mounted and mocked everywhere; what belongs together (checkpoints, results) in together;
nothing half-written. Ctrl-C, SIGTERM and kill -9: test_interruptions.py.
"""

import collections
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import estimate_ppl
import negatives
import plumbing
import sample
import train_lm
from data.text import prepare as text_prepare
from model import GPT, load_checkpoint
from plumbing import save_checkpoint, write_json
from tests.common import (CLI_NEG, CLI_TRAIN, CORPUS, ROOT, assert_clean_error, dir_snapshot, ppl_argv,
                          run_script, run_scripts, sample_argv)

FULL = "is full: free some space and rerun (what was written before is intact)"
DiskUsage = collections.namedtuple('DiskUsage', 'total used free')  # what shutil.disk_usage returns


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MB tmpfs: a disk that fills for real. Mounting one needs root (skipped otherwise)."""
    d = tmp_path / 'disk'
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip('a 2 MB tmpfs (a real full disk) needs root to mount')
    try:
        res = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=2m', 'tmpfs', str(d)], capture_output=True,
                             text=True)
    except FileNotFoundError:
        pytest.skip('no mount command here')
    if res.returncode:
        pytest.skip(f'cannot mount a tmpfs here: {res.stderr.strip()}')
    try:
        yield str(d)
    finally:  # lazily: an in-process run that failed may hold a file there until it is collected
        subprocess.run(['umount', '-l', str(d)], check=True)



def main_line(main, argv, monkeypatch, resume_hint=None):
    """What run_main(main) exits with in this process, argv given: the one `error:` line."""
    monkeypatch.setattr(sys, 'argv', ['x.py', *argv])
    with pytest.raises(SystemExit) as e:
        plumbing.run_main(main, resume_hint)
    return e.value.code



def test_full_disk_prepare_on_a_tmpfs(tmpfs, tmp_path, monkeypatch):
    """prepare.py on a 2 MB disk: refused up front with the sizes; with that check off the write
    fails for real, and the line still says the disk is full. Nothing is left (no half dataset, no
    temporary folder, not the folders the run made), and a dataset already there stays whole."""
    big, small = tmp_path / 'big.txt', tmp_path / 'small.txt'
    big.write_text(CORPUS * 700)  # 1.9 M characters: 3.8 MB of tokens
    small.write_text(CORPUS)
    out, old = os.path.join(tmpfs, 'new', 'data'), os.path.join(tmpfs, 'old')
    res = run_script(['-m', 'data.text.prepare', str(big), '--out_dir', out, '--quiet'])
    assert_clean_error(res, f'--out_dir: the disk holding {out} is full: ', ' MB needed, ')
    if [f for f in os.listdir(os.path.join(ROOT, 'data', 'shakespeare')) if f.endswith('.whl')]:  # offline
        res = run_script(['-m', 'data.shakespeare.prepare', '--out_dir', os.path.join(tmpfs, 'sh'),
                          '--quiet'])
        assert_clean_error(res, f"the disk holding {os.path.join(tmpfs, 'sh')} is full: ", ' MB needed, ')
    assert os.listdir(tmpfs) == []
    text_prepare.main([str(small), '--out_dir', old, '--quiet'])
    before = dir_snapshot(old)
    monkeypatch.setattr('data.check_free_space', lambda *a: None)
    for target in (out, old):
        argv = [str(big), '--out_dir', target, '--quiet', '--force']
        assert main_line(text_prepare.main, argv, monkeypatch) == f"error: the disk holding {target} {FULL}"
    assert os.listdir(tmpfs) == ['old'] and dir_snapshot(old) == before



def test_full_disk_train_lm_and_negatives_on_a_tmpfs(tmpfs, cli_run, monkeypatch):
    """train_lm.py at its first save and negatives.py before its first chunk, on a 2 MB disk:
    refused with the sizes before a byte is written; with that check off the writes fail for real
    (torch.save's 'enforce fail ... unexpected pos', posix_fallocate) and the line still names the
    path and says the disk is full. No checkpoint, no half folder, not the folder the run made."""
    lm, neg = os.path.join(tmpfs, 'lm'), os.path.join(tmpfs, 'neg')
    train = ['--data_dir', cli_run['data'], '--out_dir', lm, '--max_iters', '2', '--eval_interval', '2',
             '--final_eval', '0', *CLI_TRAIN, '--n_embd', '128']  # checkpoints of 6.6 MB
    sample = ['--lm', cli_run['ckpt'], '--split', 'train', '--out_dir', neg, *CLI_NEG,
              '--num_samples', '2000']  # 6.5 MB of samples
    res_train, res_neg = run_scripts([['train_lm.py', *train], ['negatives.py', *sample]])
    assert_clean_error(res_train, f'error: the disk holding {lm}/ckpt.pt is full: ', ' MB needed, ')
    assert_clean_error(res_neg, f'error: --out_dir: the disk holding {neg} is full: ', ' MB needed, ')
    assert os.listdir(tmpfs) == []
    monkeypatch.setattr(plumbing.files, 'check_disk', lambda *a: None)
    assert main_line(train_lm.main, train, monkeypatch) == f"error: the disk holding {lm}/ckpt.pt {FULL}"
    monkeypatch.setattr(plumbing.guards, 'check_free_space', lambda *a: None)  # negatives' check of its disk
    assert main_line(negatives.main, sample, monkeypatch) == f"error: the disk holding {neg} {FULL}"
    assert os.listdir(tmpfs) == []



def test_full_disk_mocked_leaves_nothing(cli_run, tmp_path, monkeypatch):
    """The same without a tmpfs: a disk reported full refuses prepare.py and train_lm.py's first
    save with the sizes (the folders they made are gone), and a dataset whose meta.json cannot be
    written leaves no split behind."""
    data, lm = str(tmp_path / 'data'), str(tmp_path / 'lm')
    raw = tmp_path / 'fox.txt'
    raw.write_text(CORPUS)
    monkeypatch.setattr(plumbing.files, 'free_space', lambda path: 1000)
    line = main_line(text_prepare.main, [str(raw), '--out_dir', data, '--quiet'], monkeypatch)
    assert line.startswith(f"error: --out_dir: the disk holding {data} is full: 0.0"), line
    assert '0.001 MB free' in line
    line = main_line(train_lm.main, ['--data_dir', cli_run['data'], '--out_dir', lm, '--max_iters', '2',
                                     '--eval_interval', '2', '--final_eval', '0', *CLI_TRAIN], monkeypatch)
    assert line.startswith(f"error: the disk holding {lm}/ckpt.pt is full: 0.") and '0.001 MB free' in line
    assert os.listdir(tmp_path) == ['fox.txt']
    monkeypatch.undo()

    def full(*a):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr('data.write_json', full)
    assert main_line(text_prepare.main, [str(raw), '--out_dir', data, '--quiet'], monkeypatch) == (
        f"error: the disk holding {data} {FULL}")
    assert os.listdir(tmp_path) == ['fox.txt']



def test_checkpoints_go_in_together_ckpt_first(cli_run, tmp_path, monkeypatch):
    """At each evaluation ckpt.pt is replaced before best.pt (a --resume can always continue), and
    a write that fails leaves both as they were; the size the disk check uses is never below the
    file's."""
    replaced, real_replace, real_save = [], os.replace, torch.save

    def replace(a, b):
        replaced.append(os.path.basename(b))
        real_replace(a, b)
    monkeypatch.setattr(os, 'replace', replace)
    out = tmp_path / 'lm'
    train_lm.main(['--data_dir', cli_run['data'], '--out_dir', str(out), '--max_iters', '4',
                   '--eval_interval', '2', '--final_eval', '0', *CLI_TRAIN])
    assert replaced[0] == 'ckpt.pt' and replaced.count('ckpt.pt') == 2
    assert all(replaced[i - 1] == 'ckpt.pt' for i, f in enumerate(replaced) if f == 'best.pt')
    ck, before = load_checkpoint(str(out / 'ckpt.pt')), dir_snapshot(out)
    size = (out / 'ckpt.pt').stat().st_size
    assert size <= plumbing.files.saved_bytes(ck) < 2 * size

    def save(obj, f):
        if 'best.pt' in str(f):
            raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598')
        real_save(obj, f)
    monkeypatch.setattr(torch, 'save', save)
    with pytest.raises(OSError, match='cannot write .*best.pt'):
        plumbing.save_checkpoints([(ck, str(out / 'ckpt.pt')), (ck, str(out / 'best.pt'))])
    assert dir_snapshot(out) == before



def test_checkpoints_and_their_results_land_together(tmp_path):
    """save_checkpoints(saves, texts) (metric_ebm's energies and results): all land, or none does: a
    text that cannot be written leaves no checkpoint and no temp file."""
    obj = {'w': torch.ones(3)}
    plumbing.save_checkpoints([(obj, str(tmp_path / 'e.pt'))],
                              [('{"a": 1}', str(tmp_path / 'results.json'))])
    assert json.loads((tmp_path / 'results.json').read_text()) == {'a': 1}
    assert torch.load(tmp_path / 'e.pt', weights_only=True)['w'].tolist() == [1, 1, 1]
    with pytest.raises(OSError):
        plumbing.save_checkpoints([(obj, str(tmp_path / 'f.pt'))],
                                  [('{}', str(tmp_path / 'e.pt' / 'r.json'))])  # e.pt is a file
    assert sorted(os.listdir(tmp_path)) == ['e.pt', 'results.json']



def test_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """ENOSPC while writing results: the previous file is intact, no temp file is left, and
    run_main prints one line naming the file."""
    path = str(tmp_path / 'results.json')
    write_json(dict(a=1), path)

    def full(*a, **kw):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(os, 'replace', full)
    monkeypatch.setattr(sys, 'argv', ['x.py'])
    with pytest.raises(SystemExit) as e:
        plumbing.run_main(lambda argv: write_json(dict(a=2), path))
    monkeypatch.undo()
    assert e.value.code == (f"error: the disk holding {path} is full: free some space and rerun "
                            f"(what was written before is intact)")
    assert '\n' not in e.value.code
    assert json.load(open(path)) == dict(a=1) and os.listdir(tmp_path) == ['results.json']



def test_results_refused_up_front_on_a_full_disk(lm_ckpt, eval_ckpts, tmp_path, monkeypatch):
    """estimate_ppl.py and sample.py check the free space for their JSON before any sampling:
    one line with what is needed and what is free, nothing written."""
    monkeypatch.setattr(shutil, 'disk_usage', lambda d: DiskUsage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(GPT, 'generate', None)  # any sampling would fail otherwise than with the line
    for main, argv in ((estimate_ppl.main, ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'p.json')),
                       (sample.main, sample_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 's.json'))):
        with pytest.raises(ValueError, match=r'--out: the disk holding .* is full: 0\.\d+ MB needed, 0\.001'):
            main(argv)
    assert os.listdir(tmp_path) == []



def test_checkpoint_write_failure_names_the_file(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')

    def fail(obj, f):
        open(f, 'wb').write(b'half')
        raise RuntimeError('PytorchStreamWriter failed writing file data/0: file write failed')

    monkeypatch.setattr(torch, 'save', fail)
    with pytest.raises(OSError, match='cannot write .*ckpt.pt') as e:
        save_checkpoint(dict(model={}, kind='lm'), path)
    assert e.value.filename == path and os.listdir(tmp_path) == []



def test_results_json_is_strict_json(tmp_path):
    """JSON has no NaN or Infinity: they are written as null, and the file parses strictly."""
    path = str(tmp_path / 'r.json')
    write_json(dict(a=float('inf'), b=[1.5, float('nan')], c=dict(d=-float('inf')), e='x'), path)

    def refuse(name):
        raise AssertionError(f'{name} in JSON')

    assert json.load(open(path), parse_constant=refuse) == dict(a=None, b=[1.5, None], c=dict(d=None), e='x')



def test_addition_figures_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A figure whose write fails half-way (a full disk) leaves the figure already there intact
    and no temp file: addition_eval's accuracy plot and the carry-chain plot."""
    from matplotlib.figure import Figure
    from extensions.addition_eval import plot
    from extensions.carry import plot_carry
    rows = [dict(model='BASE LM', method='greedy', n=1, exact=0.8)]
    chains = dict(count={'0': 5}, exact={'BASE LM': {'greedy_exact': {'0': 0.8}}})
    res = dict(split='test', ns=[1], by_carry_chain=chains)

    def half_then_full(self, fname, **kw):
        open(fname, 'wb').write(b'\x89PNG half')
        raise OSError(errno.ENOSPC, 'No space left on device')
    for draw, args in ((plot, (rows,)), (plot_carry, (res,))):
        path = tmp_path / f'{draw.__name__}.png'
        path.write_bytes(b'the earlier figure')
        monkeypatch.setattr(Figure, 'savefig', half_then_full)
        with pytest.raises(OSError):
            draw(*args, str(path))
        monkeypatch.undo()
        assert path.read_bytes() == b'the earlier figure' and os.listdir(tmp_path) == [path.name]
        draw(*args, str(path))
        assert path.read_bytes()[:4] == b'\x89PNG'
        path.unlink()


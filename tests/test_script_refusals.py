"""Each script's refusals, case by case: for prepare, train_lm, negatives and nce_train,
estimate_ppl, human_eval, sample and figures, a fixture runs every bad invocation at once against the
shared tiny checkpoints (tests/conftest.py), and each case gets one clear 'error: ...' line, no
traceback, and leaves what was there as it was. The CLI table: test_bad_input.py; what it cannot
hold (Ctrl-C, SIGTERM, kill -9): test_interruptions.py; a full disk: test_full_disk.py.
"""

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import negatives
from data import load_meta
from energy import build_energy, energy_state
from model import load_checkpoint
from plumbing import save_checkpoint
from tests.common import (CORPUS, EVAL_L, EVAL_P, HE_SAMPLES, NCE_FLAGS, NEG_FLAGS, ROOT, TRAIN_FLAGS,
                          assert_clean_error, dir_snapshot, exported_votes, fake_main_job_json, ppl_argv,
                          prepare_corpus, run_script, run_scripts, sample_argv, write_hand_key_and_votes,
                          write_samples)


def run_bad_cases(cases):
    """Run every bad invocation {case: (argv, error fragment, path or None)} at once (they are
    mostly python start-up). Returns {case: (result, fragment, path, its snapshot before the run,
    None if it did not exist)} for check_bad_case."""
    before = {c: dir_snapshot(p) if p is not None and os.path.exists(p) else None
              for c, (_, _, p) in cases.items()}
    results = run_scripts([argv for argv, _, _ in cases.values()])
    assert len(results) == len(cases)
    return {c: (res, msg, p, before[c]) for (c, (_, msg, p)), res in zip(cases.items(), results)}


def check_bad_case(res, msg, path, before):
    """One clear error line naming the problem (msg: a fragment, or a tuple of them); path (if given)
    untouched: unchanged if it existed, still absent if not."""
    assert_clean_error(res, *(msg if isinstance(msg, tuple) else (msg,)))
    if path is not None:
        assert (dir_snapshot(path) == before) if before is not None else not os.path.exists(path), path


@pytest.fixture(scope='module')
def prepare_bad(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('prepare_bad')
    (tmp / 'empty').mkdir()
    script = ['-m', 'data.text.prepare']
    return run_bad_cases({
        'missing_input': ([*script, str(tmp / 'nope.txt'), '--out_dir', str(tmp / 'out1')], 'does not exist',
                          tmp / 'out1'),
        'empty_dir': ([*script, str(tmp / 'empty'), '--out_dir', str(tmp / 'out2')], 'no non-empty text',
                      tmp / 'out2'),
    })


@pytest.mark.parametrize('case', ['missing_input', 'empty_dir'])
def test_prepare_bad_input(prepare_bad, case):
    check_bad_case(*prepare_bad[case])


@pytest.fixture(scope='module')
def train_lm_bad(lm_corpus, lm_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('train_lm_bad')

    def train(data_dir, out_dir, *extra):
        return ['train_lm.py', '--data_dir', str(data_dir), '--out_dir', str(out_dir), '--max_iters', '2',
                *TRAIN_FLAGS, *extra]

    (tmp / 'empty').mkdir()
    for name in ('existing', 'existing2'):  # a finished run: refused, and left untouched
        (tmp / name).mkdir()
        (tmp / name / 'ckpt.pt').write_bytes(open(lm_ckpt, 'rb').read())
    (tmp / 'corrupt').mkdir()
    (tmp / 'corrupt' / 'ckpt.pt').write_bytes(open(lm_ckpt, 'rb').read()[:1000])
    other = prepare_corpus(tmp / 'other', {'x.txt': "XYZ xyz 0123456789 ~~~\n" * 40})
    # a test split too short for one window: refused before training, not a NaN perplexity
    short = prepare_corpus(tmp / 'short', {'s.txt': CORPUS[:400]},
                           extra=['--val_frac', '0.1', '--test_frac', '0.02'])
    return run_bad_cases({
        'missing_data': (train(tmp / 'missing', tmp / 'o1'), 'no prepared data', None),
        'empty_data': (train(tmp / 'empty', tmp / 'o2'), 'no prepared data', None),
        'existing_checkpoint': (train(lm_corpus, tmp / 'existing'), 'exists: pass --resume',
                                tmp / 'existing'),
        'resume_missing': (train(lm_corpus, tmp / 'none', '--resume'), 'does not exist', None),
        'resume_truncated': (train(lm_corpus, tmp / 'corrupt', '--resume'), 'corrupt or truncated', None),
        'resume_other_data': (train(other, tmp / 'existing2', '--resume'), '--data_dir', tmp / 'existing2'),
        'test_split_too_short': (train(short, tmp / 'o3'), 'test split has', None),
    })


@pytest.mark.parametrize('case', ['missing_data', 'empty_data', 'existing_checkpoint', 'resume_missing',
                                  'resume_truncated', 'resume_other_data', 'test_split_too_short'])
def test_train_lm_bad_input(train_lm_bad, case):
    check_bad_case(*train_lm_bad[case])


@pytest.fixture(scope='module')
def negatives_nce_bad(lm_ckpt, fox_negatives, mlm_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('negatives_nce_bad')
    # another LM: the fox LM with its weights nudged
    other_lm = str(tmp / 'other_lm.pt')
    ck = load_checkpoint(lm_ckpt)
    ck['model'] = {k: v + 0.01 for k, v in ck['model'].items()}
    save_checkpoint(ck, other_lm)
    # a corpus with the LM's characters whose splits are shorter than prefix + continuation
    sentence = CORPUS[:45]
    short = prepare_corpus(tmp / 'short', {f'{i}.txt': sentence[9 * i:9 * i + 9] for i in range(5)})
    # a complete negatives dir, rerun with other settings
    rerun = tmp / 'rerun'
    shutil.copytree(fox_negatives['select'], rerun)
    existing = tmp / 'existing'
    existing.mkdir()
    (existing / 'ckpt.pt').write_bytes(b'an older energy')
    # --resume of a checkpoint that is an LM, or the energy of another LM
    lm_dir, other_energy = tmp / 'lm_dir', tmp / 'other_energy'
    lm_dir.mkdir()
    (lm_dir / 'ckpt.pt').write_bytes(open(lm_ckpt, 'rb').read())
    meta = load_meta(load_checkpoint(lm_ckpt)['meta']['data_dir'])
    save_checkpoint(dict(energy_state(build_energy('bit', other_lm, meta), other_lm, meta), iter_num=1,
                         optimizer={}, scaler={}, args={}),  # a ckpt.pt, not a best.pt copied over it
                    str(other_energy / 'ckpt.pt'))
    # held-out negatives with fewer samples than the ranking loss compares; val negatives as held-out
    val_k1, val_neg = str(tmp / 'val_k1'), str(tmp / 'val_neg')
    negatives.main(['--lm', lm_ckpt, '--split', 'select', '--out_dir', val_k1, *NEG_FLAGS,
                    '--num_samples', '1'])
    negatives.main(['--lm', lm_ckpt, '--split', 'val', '--out_dir', val_neg, *NEG_FLAGS,
                    '--num_prefixes', '4'])
    neg = ['negatives.py', '--lm', lm_ckpt, *NEG_FLAGS]
    nce = ['nce_train.py', '--negatives', fox_negatives['train'],
           '--held_out_negatives', fox_negatives['select'],
           '--max_iters', '2', *NCE_FLAGS]
    n1, n2, n3, e1, e2, e3, e4, e5, e6, e7, e8 = (
        tmp / name for name in ('n1', 'n2', 'n3', 'e1', 'e2', 'e3', 'e4', 'e5', 'e6', 'e7', 'e8'))
    return run_bad_cases({
        'negatives_no_samples': ([*neg, '--out_dir', str(n1), '--num_samples', '0'],
                                 '--num_samples 0: must be at least 1', n1),
        'negatives_documents_too_short': ([*neg, '--out_dir', str(n2), '--data_dir', short, '--split', 'val',
                                           '--gen_len', '5'],
                                          'val split is shorter than 11 tokens', n2),
        'negatives_past_block_size': ([*neg, '--out_dir', str(n3), '--prefix_len', '12', '--gen_len', '8'],
                                      "exceeds the LM's block_size 16", n3),
        'negatives_rerun_other_settings': ([*neg, '--out_dir', str(rerun), '--split', 'select',
                                            '--chunk', '8',
                                            '--gen_len', '3', '--seed', '7'],
                                           'other settings (gen_len, num_prefixes, seed)', rerun),
        'nce_negatives_of_another_lm': ([*nce, '--lm', other_lm, '--out_dir', str(e1)],
                                        'sampled from another LM', e1),
        'nce_past_energy_block_size': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e2), '--init_from', mlm_ckpt],
                                       "exceeds the energy's block_size 8", e2),
        'nce_unit_of_another_shape': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e3), '--body', 'unit',
                                       '--n_layer', '3'],
                                      'a UNIT energy has the shape of the LM', e3),
        'nce_bit_from_an_lm': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e4), '--init_from', lm_ckpt],
                               "is a 'lm' checkpoint", e4),
        'nce_existing_checkpoint': ([*nce, '--lm', lm_ckpt, '--out_dir', str(existing)],
                                    'exists: pass --resume', existing),
        'nce_too_many_negatives': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e5), '--loss', 'ranking',
                                    '--num_neg', '4'],
                                   '--num_neg 4 must be between 1 and the 3', e5),
        'nce_no_negatives': (['nce_train.py', '--negatives', str(tmp / 'nowhere'),
                              '--held_out_negatives', fox_negatives['select'], '--lm', lm_ckpt,
                              '--out_dir', str(e6)], 'no negatives in', e6),
        'nce_resume_an_lm': ([*nce, '--lm', lm_ckpt, '--out_dir', str(lm_dir), '--resume'],
                             "holds a 'lm' model, not an energy", lm_dir),
        'nce_resume_energy_of_another_lm': ([*nce, '--lm', lm_ckpt, '--out_dir', str(other_energy),
                                             '--resume'],
                                            'is the residual of another LM', other_energy),
        'nce_too_few_val_negatives': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e7), '--loss', 'ranking',
                                       '--held_out_negatives', val_k1],
                                      '--num_neg 3 must be between 1 and the 1 stored negatives per prefix '
                                      '(train 3, held-out 1)', e7),
        'nce_held_out_from_val': ([*nce, '--lm', lm_ckpt, '--out_dir', str(e8),
                                   '--held_out_negatives', val_neg],
                                  'were made from the val split: held-out pairs choose the energy kept', e8),
    })


@pytest.mark.parametrize('case', [
    'negatives_no_samples', 'negatives_documents_too_short', 'negatives_past_block_size',
    'negatives_rerun_other_settings', 'nce_negatives_of_another_lm', 'nce_past_energy_block_size',
    'nce_unit_of_another_shape', 'nce_bit_from_an_lm',
    'nce_existing_checkpoint', 'nce_too_many_negatives', 'nce_no_negatives', 'nce_resume_an_lm',
    'nce_resume_energy_of_another_lm', 'nce_too_few_val_negatives', 'nce_held_out_from_val'])
def test_negatives_and_nce_bad_input(negatives_nce_bad, case):
    check_bad_case(*negatives_nce_bad[case])


@pytest.fixture(scope='module')
def estimate_ppl_bad(lm_ckpt, eval_ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('estimate_ppl_bad')

    def ppl(case, *extra, lm=lm_ckpt):
        return ['estimate_ppl.py', *ppl_argv(lm, eval_ckpts['bit'], tmp / f'{case}.json', *extra)]

    no_name = ppl('energy_without_name')
    no_name[no_name.index('--energy') + 1] = eval_ckpts['bit']  # no NAME=
    cases = {
        'one_sample': (ppl('one_sample', '--num_samples', '1'), 'at least 2'),
        'sweep_of_one': (ppl('sweep_of_one', '--ns', '1,4'), 'at least 2'),
        'energy_of_another_lm': (ppl('energy_of_another_lm', lm=eval_ckpts['lm2']), 'residual of another LM'),
        'energy_without_name': (no_name, 'must be NAME=CHECKPOINT'),
        'past_block_size': (ppl('past_block_size', '--gen_len', '12'), 'exceeds'),
        'calib_below_n': (ppl('calib_below_n', '--calib_prefixes', '2', '--calib_samples', '3'),
                          '--calib_samples 3 must be'),
        'last_step_of_one': (ppl('last_step_of_one', '--per_step', '--last_step_samples', '1'),
                             '--last_step_samples'),
    }
    return run_bad_cases({case: (argv, msg, tmp / f'{case}.json') for case, (argv, msg) in cases.items()})


@pytest.mark.parametrize('case', ['one_sample', 'sweep_of_one', 'energy_of_another_lm', 'energy_without_name',
                                  'past_block_size', 'calib_below_n', 'last_step_of_one'])
def test_estimate_ppl_bad_input(estimate_ppl_bad, case):
    check_bad_case(*estimate_ppl_bad[case])


@pytest.fixture(scope='module')
def human_eval_bad(he_export, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('human_eval_bad')
    out_dir, samples = he_export
    _, votes = exported_votes(out_dir)
    # votes naming an item the key does not have, or a bad choice
    for name, bad in (('unknown_item', ['r1', '99', 'A']), ('bad_choice', ['r1', '0', 'C'])):
        with open(tmp / f'{name}.csv', 'w', newline='') as f:
            w = csv.writer(f)
            w.writerow(['rater', 'item', 'choice'])
            w.writerows(votes[:3] + [bad])
    no_gold = write_samples(tmp / 'nogold.json',
                            [{k: v for k, v in s.items() if k != 'gold'} for s in HE_SAMPLES])
    score = ['-m', 'job.human_eval', 'score', '--key', str(out_dir / 'key.json'), '--votes']
    return run_bad_cases({
        'vote_for_an_unknown_item': ([*score, str(tmp / 'unknown_item.csv')], 'bad vote', None),
        'vote_with_a_bad_choice': ([*score, str(tmp / 'bad_choice.csv')], 'bad vote', None),
        'unknown_system': (['-m', 'job.human_eval', 'export', '--samples', samples, '--systems', 'joint,nope',
                            '--out_dir', str(tmp / 'x')], '--systems', None),
        'checks_without_gold': (['-m', 'job.human_eval', 'export', '--samples', no_gold,
                                 '--out_dir', str(tmp / 'y')],
                                'attention checks need real continuations', None),
    })


@pytest.mark.parametrize('case', ['vote_for_an_unknown_item', 'vote_with_a_bad_choice', 'unknown_system',
                                  'checks_without_gold'])
def test_human_eval_bad_input(human_eval_bad, case):
    check_bad_case(*human_eval_bad[case])


@pytest.fixture(scope='module')
def human_eval_files_bad(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('human_eval_files_bad')
    key_path, votes_path = write_hand_key_and_votes(tmp)
    samples = write_samples(tmp / 'samples.json')
    out_dir = tmp / 'he'
    export = ['-m', 'job.human_eval', 'export', '--samples', samples, '--checks', '2',
              '--out_dir', str(out_dir)]
    assert run_script(export).returncode == 0
    bad = tmp / 'bad.json'
    bad.write_text('{"samples": [')
    notsamples = tmp / 'notsamples.json'
    notsamples.write_text('[1, 2]')
    badcsv = tmp / 'bad.csv'
    badcsv.write_text('who,what\nr1,0\n')
    missing = str(tmp / 'missing')
    score = ['-m', 'job.human_eval', 'score', '--key']
    return run_bad_cases({
        # votes may have been collected against the key: nothing is overwritten, items included
        'export_over_a_key': (export + ['--seed', '7'], (str(out_dir / 'key.json'), 'exists', '--force'),
                              out_dir),
        'export_missing_samples': (['-m', 'job.human_eval', 'export', '--samples', missing,
                                    '--out_dir', str(tmp / 'x1')],
                                   ('--samples', missing, 'does not exist'), None),
        'export_samples_not_json': (['-m', 'job.human_eval', 'export', '--samples', str(bad),
                                     '--out_dir', str(tmp / 'x2')],
                                    ('--samples', str(bad), 'not valid JSON'), None),
        'export_samples_not_a_list': (['-m', 'job.human_eval', 'export', '--samples', str(notsamples),
                                       '--out_dir', str(tmp / 'x3')],
                                      ('--samples', "no 'samples' list"), None),
        'score_missing_key': ([*score, missing, '--votes', str(votes_path)],
                              ('--key', missing, 'does not exist'), None),
        'score_key_not_json': ([*score, str(bad), '--votes', str(votes_path)],
                               ('--key', str(bad), 'not valid JSON'), None),
        'score_key_not_a_key': ([*score, str(notsamples), '--votes', str(votes_path)],
                                ('--key', 'not a key written by human_eval.py export'), None),
        'score_missing_votes': ([*score, str(key_path), '--votes', missing],
                                ('--votes', missing, 'does not exist'), None),
        'score_votes_without_header': ([*score, str(key_path), '--votes', str(badcsv)],
                                       ('--votes', 'rater,item,choice'), None),
        'score_votes_not_csv': ([*score, str(key_path), '--votes', str(bad)],
                                ('--votes', 'rater,item,choice'), None),
    })


@pytest.mark.parametrize('case', ['export_over_a_key', 'export_missing_samples', 'export_samples_not_json',
                                  'export_samples_not_a_list', 'score_missing_key', 'score_key_not_json',
                                  'score_key_not_a_key', 'score_missing_votes', 'score_votes_without_header',
                                  'score_votes_not_csv'])
def test_human_eval_bad_files(human_eval_files_bad, case):
    check_bad_case(*human_eval_files_bad[case])


@pytest.fixture(scope='module')
def sample_bad(lm_ckpt, eval_ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('sample_bad')
    return run_bad_cases({
        'no_samples': (['sample.py', *sample_argv(lm_ckpt, eval_ckpts['bit'], tmp / 'bad.json'),
                        '--num_samples', '0'],
                       'at least 1', None),
        'table_k_over_keep': (['sample.py', *sample_argv(lm_ckpt, eval_ckpts['bit'], tmp / 'bad3.json'),
                               '--keep', '2'],
                              '--table_k (3) <= --keep (2)', None),
        'energy_of_another_lm': (['sample.py', '--lm', eval_ckpts['lm2'], '--energy', eval_ckpts['bit'],
                                  '--num_samples', '2', '--out', str(tmp / 'bad2.json')],
                                 'residual of another LM', None),
    })


@pytest.mark.parametrize('case', ['no_samples', 'table_k_over_keep', 'energy_of_another_lm'])
def test_sample_bad_input(sample_bad, case):
    check_bad_case(*sample_bad[case])


def test_sample_lines_that_mislead(lm_ckpt, eval_ckpts, tmp_path):
    """Issue 40, item 7: --num_prefixes beyond the split takes the split and says how many it
    holds (it said the disk was full); `sample.py | head` exits quietly (it said 'Broken pipe: check
    the path and its permissions'), as does any script whose stdout's reader goes away."""
    argv = ['sample.py', *sample_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 's.json'), '--table_k', '0',
            '--num_samples', '2']
    res = run_script([*argv, '--num_prefixes', '1000000000'])
    assert res.returncode == 0 and 'is full' not in res.stderr, res.stderr
    held = re.search(r'--num_prefixes 1000000000: the test split holds (\d+) prefixes of --prefix_len '
                     rf'{EVAL_P} \+ --gen_len {EVAL_L} tokens: taking all', res.stderr)
    assert held and len(json.loads((tmp_path / 's.json').read_text())['samples']) == int(held[1])
    quiet = ("import plumbing\ndef main(argv):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
             "plumbing.run_main(main)")
    res = subprocess.run([sys.executable, '-c', quiet], cwd=ROOT, capture_output=True, text=True)
    assert (res.returncode, res.stderr) == (141, ''), res
    loud = [a for a in argv if a != '--quiet']
    shell = f"{shlex.join([sys.executable, *loud, '--out', str(tmp_path / 'p.json')])} --force | head -1"
    res = subprocess.run(['bash', '-c', f'set -o pipefail; {shell}'], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert 'Broken pipe' not in res.stderr and 'error' not in res.stderr, res.stderr
    assert res.returncode in (0, 141), res  # 141: sample.py outlived head's read, as a Unix tool would
    # issue 48, item 5: the file is written before the screen; issue 57, item 5: the setup lines
    # (threads, sample and score precision) are diagnostics, on stderr, so `| head -1` takes the first
    # line of results, after the file is written (it took 'threads: ...' and sample.py stopped unwritten)
    shell = f"{shlex.join([sys.executable, *argv, '--out', str(tmp_path / 'q.json')])} --force | head -1"
    res = subprocess.run(['bash', '-c', f'set -o pipefail; {shell}'], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    assert res.returncode in (0, 141) and json.loads((tmp_path / 'q.json').read_text())['samples'], res
    assert 'threads' not in res.stdout and res.stderr.startswith('threads: 1'), res


def test_memory_check_respects_ulimit_v():
    """Issue 40, item 1: under `ulimit -v` (RLIMIT_AS) lower than the machine's free memory, the
    memory check uses what the limit leaves this process, and says so."""
    code = ("import resource\nfrom plumbing import budget\n"
            "vm = next(int(l.split()[1]) * 1024"
            " for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))\n"
            "assert budget.available_memory() <= 2**30\n"
            "budget.check_memory(2**30, 'a batch', 'lower --batch_size')\n")
    res = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1'))
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith('ValueError: a batch needs ~1.0 GiB'), \
        res.stderr
    assert 'GiB available under ulimit -v): lower --batch_size' in res.stderr


@pytest.mark.parametrize('case', ['no matplotlib', 'no ppl.json', 'empty ppl.json', 'ppl.json a list'])
def test_figures_bad_input_is_one_line(tmp_path, case):
    if case == 'no matplotlib':  # a matplotlib that cannot be imported, found before any installed one
        fake = tmp_path / 'fake' / 'matplotlib'
        fake.mkdir(parents=True)
        (fake / '__init__.py').write_text("raise ImportError('no matplotlib here')\n")
        fake_main_job_json(tmp_path)
        res = run_script(['-m', 'job.figures', '--out_dir', str(tmp_path)],
                         env=dict(PYTHONPATH=str(fake.parent)))
        assert_clean_error(res, 'matplotlib is not installed: pip install matplotlib')
    else:
        pytest.importorskip('matplotlib', reason='the check of ppl.json comes after the import of matplotlib')
        if case == 'empty ppl.json':
            (tmp_path / 'ppl.json').write_text('')
        if case == 'ppl.json a list':  # issue 40: an AttributeError before
            fake_main_job_json(tmp_path)
            (tmp_path / 'ppl.json').write_text('[{"splits": {}}]')
        res = run_script(['-m', 'job.figures', '--out_dir', str(tmp_path)])
        assert_clean_error(res, 'ppl.json', 'estimate_ppl.py')
    assert not list(tmp_path.glob('*.png'))


def test_a_looping_link_as_out_dir_names_the_flag(lm_corpus, tmp_path):
    """A symbolic link to itself (or to nothing) as --out_dir: one line naming the flag (it said
    "File exists: <path>" before)."""
    loop = tmp_path / 'loop'
    os.symlink(loop, loop)
    res = run_script(['train_lm.py', '--data_dir', lm_corpus, '--out_dir', str(loop), '--max_iters', '2'])
    assert_clean_error(res, f"--out_dir {loop} is a symbolic link to nothing (broken, or a loop)")


def test_a_reader_gone_before_anything_was_saved_leaves_no_folder(lm_corpus, tmp_path):
    """`train_lm.py ... | head -1`: the reader leaves after the first line, the run stops quietly
    (status 141, as a Unix tool) and the --out_dir it created, with nothing saved in it, is removed."""
    out = tmp_path / 'lm'
    cmd = shlex.join([sys.executable, 'train_lm.py', '--data_dir', lm_corpus, '--out_dir', str(out),
                      *TRAIN_FLAGS, '--max_iters', '50', '--eval_interval', '50'])
    res = subprocess.run(['bash', '-c', f'set -o pipefail; {cmd} | head -1'], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONUNBUFFERED='1'))
    assert res.returncode == 141 and 'Traceback' not in res.stderr, res
    assert not out.exists()

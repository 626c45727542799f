"""
Bad input across every script (issue 13): each row of CLI_TABLE is one misuse. Every row must exit
non-zero with exactly one `error:` line on stderr that names the flag or file, no traceback, and
leave every file under the artifacts folder byte-identical, creating nothing there. A new script
or flag adds its rows here.

The artifacts (a tiny corpus, LM, negatives, energy, human-eval kit) are built once; all rows then
run in one python process that executes each script as `python script.py ...` would (runpy,
__name__ == '__main__', so through its run_main), catching SystemExit and capturing stderr. Only
Ctrl-C needs a real process of its own.
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

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import human_eval  # noqa: E402
import negatives  # noqa: E402
import nce_train  # noqa: E402
import runtime  # noqa: E402
import train_lm  # noqa: E402
from data import load_meta, load_negatives, write_json  # noqa: E402
from data.text import prepare as text_prepare  # noqa: E402
from energy import build_energy, energy_state  # noqa: E402
from model import load_checkpoint, save_checkpoint  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from threads, and a busy machine makes them spin

CLI_TEXT = "the quick brown fox jumps over the lazy dog.\n" * 60
CLI_CPU = ['--device', 'cpu', '--dtype', 'float32', '--quiet']
CLI_TRAIN = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--block_size', '16', '--batch_size', '4',
             '--eval_iters', '2', '--warmup_iters', '2', '--num_samples', '0', *CLI_CPU]
CLI_NEG = ['--prefix_len', '6', '--gen_len', '4', '--num_samples', '3', *CLI_CPU]
CLI_NCE = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--batch_size', '4', '--warmup_iters', '1',
           '--eval_prefixes', '8', *CLI_CPU]
UNWRITABLE = '/proc/rebm-nowhere'  # no one can create anything under /proc, root included


class CliEvil:
    """A pickle that writes a file when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, 'w')


@pytest.fixture(scope='module')
def cli_artifacts(tmp_path_factory):
    """Everything the rows point at, built once: {name: path}, all under A['root']."""
    root = tmp_path_factory.mktemp('cli')
    A = {k: str(root / k) for k in ('data', 'lm', 'neg_train', 'neg_val', 'nce', 'neg_incomplete', 'neg_bad', 'bad_meta',
                                    'he', 'repro', 'new')}
    A['root'] = str(root)
    (root / 'raw').mkdir()
    (root / 'raw' / 'fox.txt').write_text(CLI_TEXT)
    text_prepare.main([str(root / 'raw'), '--out_dir', A['data'], '--val_frac', '0.1', '--test_frac', '0.1', '--quiet'])
    train_lm.main(['--data_dir', A['data'], '--out_dir', A['lm'], '--max_iters', '2', '--eval_interval', '2',
                   '--final_eval', '0', *CLI_TRAIN])
    A['ckpt'] = os.path.join(A['lm'], 'ckpt.pt')
    for split, extra in (('train', ['--max_prefixes', '20']), ('val', [])):
        negatives.main(['--lm', A['ckpt'], '--split', split, '--out_dir', A[f'neg_{split}'], '--chunk', '8', *CLI_NEG, *extra])
    nce_train.main(['--lm', A['ckpt'], '--negatives', A['neg_train'], '--val_negatives', A['neg_val'], '--out_dir', A['nce'],
                    '--max_iters', '2', '--eval_interval', '2', *CLI_NCE])
    A['energy'] = os.path.join(A['nce'], 'best.pt')
    shutil.copytree(A['neg_val'], A['neg_incomplete'])  # as if killed before it finished
    meta = json.load(open(os.path.join(A['neg_val'], 'meta.json')))
    write_json(dict(meta, complete=False), os.path.join(A['neg_incomplete'], 'meta.json'))
    os.makedirs(A['neg_bad'])
    (root / 'neg_bad' / 'meta.json').write_text('{"lm_path": ')
    shutil.copytree(A['data'], A['bad_meta'])
    (root / 'bad_meta' / 'meta.json').write_text('')
    samples = [dict(prefix=f'p{i}', base=f'b{i}', joint=f'j{i}', worst=f'w{i}', gold=f'g{i}') for i in range(4)]
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
    A['evil'] = str(root / 'evil.pt')  # unpickling it would create root/pwned: weights_only must refuse it
    torch.save(dict(kind='lm', model=CliEvil(str(root / 'pwned'))), A['evil'])
    A['votes_99'] = str(root / 'votes_99.csv')
    (root / 'votes_99.csv').write_text('rater,item,choice\nr1,99,A\n')
    A['repro_list'] = str(root / 'repro_list')
    os.makedirs(A['repro_list'])
    (root / 'repro_list' / 'timings.json').write_text('[1, 2]')
    A['latin1'] = str(root / 'latin1.txt')
    (root / 'latin1.txt').write_bytes('caf\xe9 cr\xe8me\n'.encode('latin-1'))
    return A


# (id, script, argv with {name} for cli_artifacts paths and {new} for a fresh output path, what the line names)
T = ['train_lm.py', '--data_dir', '{data}', '--out_dir', '{new}', '--max_iters', '2', *CLI_TRAIN]
N = ['negatives.py', '--lm', '{ckpt}', '--split', 'val', '--out_dir', '{new}', *CLI_NEG]
E = ['nce_train.py', '--lm', '{ckpt}', '--negatives', '{neg_train}', '--val_negatives', '{neg_val}', '--out_dir', '{new}',
     '--max_iters', '2', *CLI_NCE]
P = ['estimate_ppl.py', '--lm', '{ckpt}', '--energy', 'BIT={energy}', '--splits', 'val', '--prefix_len', '6', '--gen_len', '4',
     '--max_prefixes', '4', '--num_samples', '4', '--out', '{new}.json', *CLI_CPU]
S = ['sample.py', '--lm', '{ckpt}', '--energy', '{energy}', '--prefix_len', '6', '--gen_len', '4', '--n', '4',
     '--num_prefixes', '2', '--table_k', '0', '--out', '{new}.json', *CLI_CPU]
B = ['bench.py', '--data_dir', '{data}', '--out', '{new}.json', '--quick', '--quiet', '--n_layer', '1', '--n_head', '2',
     '--n_embd', '32', '--block_size', '64', '--prompt_len', '16', '--new_tokens', '8']
HX = ['human_eval.py', 'export', '--samples', '{samples}', '--out_dir', '{new}']
HS = ['human_eval.py', 'score', '--key', '{key}', '--votes', '{votes}', '--out', '{new}.json']
R = ['reproduce.py', '--quick', '--quiet', '--data_dir', '{data}', '--out_dir', '{new}']
TX = ['data/text/prepare.py', '{other_text}', '--out_dir', '{new}', '--quiet']
SH = ['data/shakespeare/prepare.py', '--quiet']
CC = ['data/cc_news/prepare.py', '--quiet']
BAD = f'{UNWRITABLE}/out'

CLI_TABLE = [
    # train_lm.py
    ('train-batch-size-0', [*T, '--batch_size', '0'], '--batch_size 0: must be at least 1'),
    ('train-max-iters-0', [*T, '--max_iters', '0'], '--max_iters 0'),
    ('train-eval-interval-0', [*T, '--eval_interval', '0'], '--eval_interval 0'),
    ('train-eval-iters-0', [*T, '--eval_iters', '0'], '--eval_iters 0'),
    ('train-log-interval-0', [*T, '--log_interval', '0'], '--log_interval 0'),
    ('train-grad-accum-0', [*T, '--grad_accum', '0'], '--grad_accum 0'),
    ('train-block-size-0', [*T, '--block_size', '0'], '--block_size 0'),
    ('train-heads-do-not-divide', [*T, '--n_embd', '33', '--n_head', '2'], '--n_embd 33 is not a multiple of --n_head 2'),
    ('train-n-layer-0', [*T, '--n_layer', '0'], '--n_layer 0'),
    ('train-lr-negative', [*T, '--lr', '-1'], '--lr -1'),
    ('train-lr-nan', [*T, '--lr', 'nan'], '--lr nan'),
    ('train-dropout-1.5', [*T, '--dropout', '1.5'], '--dropout 1.5'),
    ('train-warmup-negative', [*T, '--warmup_iters', '-1'], '--warmup_iters -1'),
    ('train-final-eval-2', [*T, '--final_eval', '2'], '--final_eval 2'),
    ('train-batch-size-not-int', [*T, '--batch_size', 'abc'], '--batch_size'),
    ('train-unknown-flag', [*T, '--bogus_flag'], '--bogus_flag'),
    ('train-unknown-preset', [*T, '--preset', 'huge'], '--preset'),
    ('train-out-dir-unwritable', [*T, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('train-out-dir-under-a-file', [*T, '--out_dir', '{file}/sub'], '--out_dir'),
    ('train-data-dir-missing', [*T, '--data_dir', '{root}/nowhere'], 'nowhere'),
    ('train-meta-malformed', [*T, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json is not valid JSON'),
    ('train-residual-of-missing', [*T, '--residual_of', '{missing}'], 'missing.pt'),
    ('train-residual-of-energy', [*T, '--residual_of', '{energy}'], "best.pt holds a 'energy' model"),
    ('train-init-from-energy', [*T, '--init_from', '{energy}'], 'is an energy'),
    ('train-init-from-missing', [*T, '--init_from', '{missing}'], 'missing.pt'),
    ('train-mlm-with-residual', [*T, '--objective', 'mlm', '--residual_of', '{ckpt}'], '--residual_of'),
    ('train-block-size-too-long', [*T, '--block_size', '4000'], '--block_size'),
    ('train-device-cuda', [*T, '--device', 'cuda'], '--device cuda'),
    ('train-device-bogus', [*T, '--device', 'tpu'], '--device tpu'),
    ('train-existing-ckpt', [*T, '--out_dir', '{lm}'], 'ckpt.pt exists: pass --resume'),
    ('train-resume-nothing', [*T, '--resume'], 'does not exist'),
    ('train-resume-an-energy', [*T, '--out_dir', '{nce}', '--resume'], "ckpt.pt holds a 'energy' model"),
    ('train-init-from-a-code-pickle', [*T, '--init_from', '{evil}'], 'evil.pt holds more than tensors'),
    ('train-init-from-folder', [*T, '--init_from', '{lm}'], 'lm is a folder, not a checkpoint'),
    ('train-float16-on-cpu', [*T, '--dtype', 'float16'], '--dtype float16'),
    ('train-match-params-unreachable', [*T, '--match_params', '100000000000'], '--match_params 100000000000'),
    ('train-ralm-block-too-long', [*T, '--residual_of', '{ckpt}', '--block_size', '32'], '--block_size 32 exceeds'),
    # negatives.py: every flag checked before the output folder exists
    ('neg-top-k-0', [*N, '--top_k', '0'], '--top_k 0'),
    ('neg-top-k-above-vocab', [*N, '--top_k', '9999'], '--top_k 9999'),
    ('neg-top-p-1.5', [*N, '--top_p', '1.5'], '--top_p 1.5'),
    ('neg-top-p-0', [*N, '--top_p', '0'], '--top_p 0'),
    ('neg-temperature-negative', [*N, '--temperature', '-1'], '--temperature -1'),
    ('neg-prefix-len-0', [*N, '--prefix_len', '0'], '--prefix_len 0'),
    ('neg-gen-len-0', [*N, '--gen_len', '0'], '--gen_len 0'),
    ('neg-chunk-0', [*N, '--chunk', '0'], '--chunk 0'),
    ('neg-stride-0', [*N, '--stride', '0'], '--stride 0'),
    ('neg-max-prefixes-negative', [*N, '--max_prefixes', '-1'], '--max_prefixes -1'),
    ('neg-num-samples-0', [*N, '--num_samples', '0'], '--num_samples 0'),
    ('neg-split-bogus', [*N, '--split', 'dev'], '--split'),
    ('neg-too-long-for-lm', [*N, '--prefix_len', '12', '--gen_len', '8'], "exceeds the LM's block_size 16"),
    ('neg-lm-missing', [*N, '--lm', '{missing}'], 'missing.pt'),
    ('neg-lm-is-energy', [*N, '--lm', '{energy}'], "holds a 'energy' model"),
    ('neg-out-dir-unwritable', [*N, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('neg-out-dir-is-a-file', [*N, '--out_dir', '{file}'], 'file.txt is a file'),
    ('neg-meta-malformed', [*N, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json'),
    ('neg-other-settings', [*N, '--out_dir', '{neg_val}', '--gen_len', '3'], 'other settings (chunk, gen_len'),
    ('neg-device-cuda', [*N, '--device', 'cuda'], '--device cuda'),
    ('neg-temperature-inf', [*N, '--temperature', 'inf'], '--temperature inf'),
    ('neg-lm-is-folder', [*N, '--lm', '{lm}'], 'lm is a folder, not a checkpoint'),
    ('neg-data-dir-missing', [*N, '--data_dir', '{root}/nowhere'], 'nowhere'),
    # nce_train.py
    ('nce-max-iters-0', [*E, '--max_iters', '0'], '--max_iters 0'),
    ('nce-batch-size-0', [*E, '--batch_size', '0'], '--batch_size 0'),
    ('nce-eval-interval-0', [*E, '--eval_interval', '0'], '--eval_interval 0'),
    ('nce-eval-prefixes-0', [*E, '--eval_prefixes', '0'], '--eval_prefixes 0'),
    ('nce-grad-accum-0', [*E, '--grad_accum', '0'], '--grad_accum 0'),
    ('nce-num-neg-0', [*E, '--loss', 'ranking', '--num_neg', '0'], '--num_neg 0'),
    ('nce-context-negative', [*E, '--context', '-1'], '--context -1'),
    ('nce-dropout-1', [*E, '--dropout', '1'], '--dropout 1'),
    ('nce-heads-do-not-divide', [*E, '--n_embd', '15'], '--n_embd 15 is not a multiple of --n_head 2'),
    ('nce-lm-is-energy', [*E, '--lm', '{energy}'], "--lm {energy} holds a 'energy' model, not a language model"),
    ('nce-lm-missing', [*E, '--lm', '{missing}'], 'missing.pt'),
    ('nce-val-negatives-from-train', [*E, '--val_negatives', '{neg_train}'], 'held-out pairs must not be training prefixes'),
    ('nce-negatives-incomplete', [*E, '--negatives', '{neg_incomplete}'], 'python negatives.py --lm'),
    ('nce-negatives-missing', [*E, '--negatives', '{root}/nowhere'], 'nowhere'),
    ('nce-negatives-malformed', [*E, '--negatives', '{neg_bad}'], 'neg_bad/meta.json is not valid JSON'),
    ('nce-existing-run', [*E, '--out_dir', '{nce}'], 'ckpt.pt exists: pass --resume'),
    ('nce-out-dir-unwritable', [*E, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('nce-energy-kind-bogus', [*E, '--energy', 'mlp'], '--energy'),
    ('nce-device-cuda', [*E, '--device', 'cuda'], '--device cuda'),
    ('nce-float16-on-cpu', [*E, '--dtype', 'float16'], '--dtype float16'),
    ('nce-lm-is-folder', [*E, '--lm', '{lm}'], 'lm is a folder, not a checkpoint'),
    ('nce-val-negatives-same-split', [*E, '--negatives', '{neg_val}'], 'which --negatives trains on'),
    ('nce-negatives-is-a-data-dir', [*E, '--negatives', '{data}'], '{data} does not hold negatives'),
    ('nce-bit-from-an-lm', [*E, '--init_from', '{ckpt}'], "ckpt.pt is a 'lm' checkpoint"),
    ('nce-unit-from-an-energy', [*E, '--energy', 'unit', '--init_from', '{energy}'], "best.pt holds a 'energy' model"),
    ('nce-num-neg-above-k', [*E, '--loss', 'ranking', '--num_neg', '9'], '--num_neg 9'),
    # estimate_ppl.py
    ('ppl-out-unwritable', [*P, '--out', f'{BAD}/p.json'], f'--out {BAD}/p.json'),
    ('ppl-out-is-a-folder', [*P, '--out', '{lm}'], 'is a folder'),
    ('ppl-chunk-0', [*P, '--chunk', '0'], '--chunk 0'),
    ('ppl-max-prefixes-negative', [*P, '--max_prefixes', '-1'], '--max_prefixes -1'),
    ('ppl-max-rows-0', [*P, '--max_rows', '0'], '--max_rows 0'),
    ('ppl-gen-len-0', [*P, '--gen_len', '0'], '--gen_len 0'),
    ('ppl-num-samples-1', [*P, '--num_samples', '1'], '--num_samples'),
    ('ppl-step-samples-1', [*P, '--step_samples', '1'], '--step_samples 1'),
    ('ppl-sweep-not-int', [*P, '--sweep', '2,x'], '--sweep 2,x'),
    ('ppl-splits-bogus', [*P, '--splits', 'val,dev'], '--splits val,dev'),
    ('ppl-per-step-without-energy', ['estimate_ppl.py', '--lm', '{ckpt}', '--per_step', '--out', '{new}.json', *CLI_CPU],
     '--per_step'),
    ('ppl-energy-missing', [*P, '--energy', 'BIT={missing}'], 'missing.pt'),
    ('ppl-energy-without-name', [*P, '--energy', '{energy}'], 'must be NAME=CHECKPOINT'),
    ('ppl-lm-is-energy', [*P, '--lm', '{energy}'], "holds a 'energy' model"),
    ('ppl-too-long', [*P, '--gen_len', '12'], 'exceeds'),
    ('ppl-meta-malformed', [*P, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json'),
    ('ppl-lm-is-a-code-pickle', [*P, '--lm', '{evil}'], 'evil.pt holds more than tensors'),
    ('ppl-max-prefixes-1', [*P, '--max_prefixes', '1'], '--max_prefixes 1'),
    ('ppl-energy-empty-path', [*P, '--energy', 'BIT='], 'must be NAME=CHECKPOINT'),
    ('ppl-names-not-distinct', [*P, '--extra_lm', 'BIT={ckpt}'], 'distinct'),
    ('ppl-per-step-unknown', [*P, '--per_step', 'NOPE'], '--per_step NOPE'),
    ('ppl-extra-lm-is-energy', [*P, '--extra_lm', 'X={energy}'], "holds a 'energy' model"),
    ('ppl-out-under-a-file', [*P, '--out', '{file}/p.json'], 'file.txt is a file'),
    # sample.py
    ('sample-num-prefixes-0', [*S, '--num_prefixes', '0'], '--num_prefixes 0'),
    ('sample-out-unwritable', [*S, '--out', f'{BAD}/s.json'], f'--out {BAD}/s.json'),
    ('sample-n-0', [*S, '--n', '0'], '--n 0'),
    ('sample-m-1', [*S, '--m', '1'], '--m 1'),
    ('sample-gen-len-0', [*S, '--gen_len', '0'], '--gen_len 0'),
    ('sample-top-k-negative', [*S, '--top_k', '-1'], '--top_k -1'),
    ('sample-top-k-above-vocab', [*S, '--top_k', '9999'], '--top_k'),
    ('sample-too-long', [*S, '--prefix_len', '14'], '--gen_len 4 exceeds'),
    ('sample-data-dir-missing', [*S, '--data_dir', '{root}/nowhere'], 'nowhere'),
    ('sample-energy-is-lm', [*S, '--energy', '{ckpt}'], 'not an energy'),
    ('sample-energy-missing', [*S, '--energy', '{missing}'], 'missing.pt'),
    ('sample-prompt-unknown-char', [*S, '--prompt', 'QX#'], "character 'Q'"),
    ('sample-prompt-empty', [*S, '--prompt', ''], '--prompt is empty'),
    ('sample-prompt-too-long', [*S, '--prompt', 'the quick brown fox jumps'], "exceeds the LM's block_size 16"),
    ('sample-table-k-above-vocab', [*S, '--table_k', '99'], '--table_k'),
    ('sample-lm-is-folder', [*S, '--lm', '{lm}'], 'lm is a folder, not a checkpoint'),
    # bench.py
    ('bench-out-unwritable', [*B, '--out', f'{BAD}/b.json'], f'--out {BAD}/b.json'),
    ('bench-repeats-0', [*B, '--repeats', '0'], '--repeats 0'),
    ('bench-batch-size-0', [*B, '--batch_size', '0'], '--batch_size 0'),
    ('bench-heads-do-not-divide', [*B, '--n_embd', '33'], '--n_embd 33'),
    ('bench-prompt-too-long', [*B, '--prompt_len', '60'], '--prompt_len 60'),
    ('bench-block-longer-than-data', [*B, '--block_size', '4000', '--prompt_len', '16'], '--block_size'),
    ('bench-data-dir-missing', [*B, '--data_dir', '{root}/nowhere'], 'nowhere'),
    ('bench-device-cuda', [*B, '--device', 'cuda'], '--device cuda'),
    ('bench-threads-negative', [*B, '--threads', '-1'], '--threads -1'),
    ('bench-warmup-negative', [*B, '--warmup', '-1'], '--warmup -1'),
    ('bench-new-tokens-0', [*B, '--new_tokens', '0'], '--new_tokens 0'),
    ('bench-out-is-a-folder', [*B, '--out', '{lm}'], 'is a folder'),
    # human_eval.py
    ('he-no-command', ['human_eval.py'], 'cmd'),
    ('he-export-samples-missing', [*HX, '--samples', '{missing}'], 'missing.pt does not exist'),
    ('he-export-samples-empty-file', [*HX, '--samples', '{empty}'], 'empty.json is not valid JSON'),
    ('he-export-no-samples', [*HX, '--samples', '{no_samples}'], "no_samples.json has no 'samples' list"),
    ('he-export-checks-negative', [*HX, '--checks', '-1'], '--checks -1'),
    ('he-export-out-dir-unwritable', [*HX, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('he-export-systems-unknown', [*HX, '--systems', 'joint,nope'], '--systems'),
    ('he-score-key-missing', [*HS, '--key', '{missing}'], 'missing.pt does not exist'),
    ('he-score-key-malformed', [*HS, '--key', '{empty}'], 'empty.json is not valid JSON'),
    ('he-score-key-not-a-key', [*HS, '--key', '{samples}'], 'samples.json is not a key written by human_eval.py export'),
    ('he-score-votes-missing', [*HS, '--votes', '{root}/nowhere.csv'], 'nowhere.csv does not exist'),
    ('he-score-votes-bad-header', [*HS, '--votes', '{votes_bad}'], 'votes_bad.csv needs a header with columns rater,item,choice'),
    ('he-score-max-failed-negative', [*HS, '--max_failed_checks', '-1'], '--max_failed_checks -1'),
    ('he-score-out-unwritable', [*HS, '--out', f'{BAD}/r.json'], f'--out {BAD}/r.json'),
    ('he-score-vote-for-no-item', [*HS, '--votes', '{votes_99}'], 'bad vote (r1, 99, A)'),
    # reproduce.py
    ('repro-timings-empty', [*R, '--out_dir', '{repro}'], 'repro/timings.json is not valid JSON'),
    ('repro-device-cuda', [*R, '--device', 'cuda'], '--device cuda'),
    ('repro-out-dir-unwritable', [*R, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('repro-dtype-bogus', [*R, '--dtype', 'fp8'], '--dtype'),
    ('repro-timings-not-a-table', [*R, '--out_dir', '{repro_list}'], 'timings.json is not a table'),
    ('repro-data-meta-malformed', [*R, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json is not valid JSON'),
    ('repro-data-dir-unwritable', [*R, '--data_dir', BAD], f'--data_dir {BAD}'),
    # data/*/prepare.py
    ('text-fractions-over-1', [*TX, '--val_frac', '0.6', '--test_frac', '0.6'], '--val_frac 0.6 + --test_frac 0.6'),
    ('text-test-frac-negative', [*TX, '--test_frac', '-0.1'], '--test_frac -0.1'),
    ('text-val-frac-0', [*TX, '--val_frac', '0'], '--val_frac 0'),
    ('text-val-frac-too-small', [*TX, '--val_frac', '0.0001'], '--val_frac gives the val split no text'),
    ('text-input-missing', ['data/text/prepare.py', '{root}/nowhere.txt', '--out_dir', '{new}'], "'{root}/nowhere.txt' does not exist"),
    ('text-input-blank', ['data/text/prepare.py', '{blank}', '--out_dir', '{new}'], 'blank.txt'),
    ('text-out-dir-unwritable', [*TX, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('text-other-data-without-force', [*TX, '--out_dir', '{data}'], '--force'),
    ('text-tokenizer-bogus', [*TX, '--tokenizer', 'bpe'], '--tokenizer'),
    ('text-input-not-utf8', ['data/text/prepare.py', '{latin1}', '--out_dir', '{new}'], 'latin1.txt is not UTF-8'),
    ('shakespeare-out-dir-unwritable', [*SH, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('shakespeare-out-dir-under-a-file', [*SH, '--out_dir', '{file}/sub'], '--out_dir'),
    ('shakespeare-tokenizer-bogus', [*SH, '--out_dir', '{new}', '--tokenizer', 'bpe'], '--tokenizer'),
    ('ccnews-eval-docs-0', [*CC, '--out_dir', '{new}', '--eval_docs', '0'], '--eval_docs 0'),
    ('ccnews-max-docs-negative', [*CC, '--out_dir', '{new}', '--max_docs', '-1'], '--max_docs -1'),
    ('ccnews-out-dir-unwritable', [*CC, '--out_dir', BAD], f'--out_dir {BAD}'),
]

# One python process runs every row: the script as __main__ (its run_main included), argv set, stderr captured.
# Around each row, every file under the artifacts folder is hashed: nothing may change or appear.
CLI_RUNNER = r'''
import contextlib, hashlib, io, json, os, runpy, sys, traceback
import torch
torch.set_num_threads(1)
rows_path, root, out_path = sys.argv[1:4]
sys.path.insert(0, os.getcwd())

def snapshot():
    snap = {}
    for d, _, files in os.walk(root):
        snap[os.path.relpath(d, root) + '/'] = 'folder'
        for f in files:
            with open(os.path.join(d, f), 'rb') as fh:
                snap[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return snap

results = {}
for row in json.load(open(rows_path)):
    before, err = snapshot(), io.StringIO()
    sys.argv = list(row['argv'])
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(row['argv'][0], run_name='__main__')
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            err.write(e.code + '\n')
    except BaseException:
        rc = 1
        err.write(traceback.format_exc())
    after = snapshot()
    results[row['id']] = dict(rc=rc, stderr=err.getvalue(), changed=sorted(k for k in before if after.get(k) != before[k]),
                              created=sorted(k for k in after if k not in before))
json.dump(results, open(out_path, 'w'))
'''


def cli_fill(s, A, row_id):
    return s.format(**dict(A, new=os.path.join(A['new'], row_id)))


@pytest.fixture(scope='module')
def cli_table_results(cli_artifacts):
    A = cli_artifacts
    rows = [dict(id=i, argv=[cli_fill(a, A, i) for a in argv]) for i, argv, _ in CLI_TABLE]
    rows_path, out_path = os.path.join(A['root'], '..', 'rows.json'), os.path.join(A['root'], '..', 'results.json')
    with open(rows_path, 'w') as f:
        json.dump(rows, f)
    env = dict(os.environ, OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')  # '--device cuda' must find no GPU
    res = subprocess.run([sys.executable, '-c', CLI_RUNNER, rows_path, A['root'], out_path], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out_path) as f:
        return json.load(f)


def test_cli_table_is_large_and_unique():
    ids = [i for i, _, _ in CLI_TABLE]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
    scripts = {argv[0] for _, argv, _ in CLI_TABLE}
    assert scripts == {'train_lm.py', 'negatives.py', 'nce_train.py', 'estimate_ppl.py', 'sample.py', 'human_eval.py',
                       'reproduce.py', 'bench.py', 'data/text/prepare.py', 'data/shakespeare/prepare.py',
                       'data/cc_news/prepare.py'}


@pytest.mark.parametrize('row_id,names', [(i, n) for i, _, n in CLI_TABLE], ids=[i for i, _, _ in CLI_TABLE])
def test_cli_bad_input(cli_table_results, cli_artifacts, row_id, names):
    r = cli_table_results[row_id]
    lines = r['stderr'].strip().splitlines()
    assert r['rc'] != 0, r
    assert 'Traceback' not in r['stderr'], r['stderr']
    assert len(lines) == 1 and lines[0].startswith('error: '), r['stderr']
    assert cli_fill(names, cli_artifacts, row_id) in lines[0], lines[0]
    assert not r['changed'] and not r['created'], r


# -----------------------------------------------------------------------------
# what the table cannot hold: Ctrl-C, a full disk, and correct runs that used to fail

def wait_for(cond, proc, timeout=120):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def test_ctrl_c_train_lm_says_how_to_resume(cli_artifacts, tmp_path):
    """SIGINT mid-training: one line naming the checkpoint and the exact command that resumes; that
    command (with a nearer --max_iters) then continues from the checkpoint."""
    out = str(tmp_path / 'run')
    argv = ['train_lm.py', '--data_dir', cli_artifacts['data'], '--out_dir', out, '--max_iters', '100000',
            '--eval_interval', '3', '--final_eval', '0', *CLI_TRAIN]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    wait_for(lambda: os.path.exists(os.path.join(out, 'ckpt.pt')), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err
    it = load_checkpoint(os.path.join(out, 'ckpt.pt'))['iter_num']
    assert it > 0 and it % 3 == 0
    resume = shlex.join(['python', *argv, '--resume'])
    assert lines[0] == (f"interrupted: {out}/ckpt.pt holds iteration {it} of 100000 (saved every 3); "
                        f"resume with: {resume}"), lines[0]
    assert not [f for f in os.listdir(out) if '.tmp' in f]  # no half-written checkpoint left behind
    cmd = shlex.split(lines[0].split('resume with: ')[1])
    cmd[cmd.index('--max_iters') + 1] = str(it + 2)
    res = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    results = json.load(open(os.path.join(out, 'results.json')))
    assert results['iters'] == it + 2 and load_checkpoint(os.path.join(out, 'ckpt.pt'))['iter_num'] == it + 2


def test_ctrl_c_negatives_says_rerun(cli_artifacts, tmp_path):
    """SIGINT while sampling: one line saying how many chunks are saved and that the same command
    finishes them; it does."""
    out = str(tmp_path / 'neg')
    argv = ['negatives.py', '--lm', cli_artifacts['ckpt'], '--split', 'train', '--out_dir', out, '--stride', '1',
            '--chunk', '1', *CLI_NEG]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    done = os.path.join(out, 'done.bin')
    wait_for(lambda: os.path.exists(done) and negatives.chunks_done(out) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err
    n_done, n_chunks = negatives.chunks_done(out), len(open(done, 'rb').read())
    assert 3 <= n_done < n_chunks
    assert lines[0] == (f"interrupted: {n_done} of {n_chunks} chunks of negatives are saved in {out}; "
                        f"rerun the same command to finish them: {shlex.join(['python', *argv])}"), lines[0]


def test_ctrl_c_reproduce_says_rerun(cli_artifacts, tmp_path):
    """Ctrl-C at the terminal (SIGINT to the whole process group) during a stage: the stage is
    stopped with the pipeline, and the one line is the pipeline's: rerun it."""
    out = str(tmp_path / 'out')
    argv = ['reproduce.py', '--quick', '--quiet', '--data_dir', cli_artifacts['data'], '--out_dir', out, '--device', 'cpu']
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    wait_for(lambda: os.path.exists(os.path.join(out, 'lm', 'log.jsonl')), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == (
        f"interrupted: finished stages are kept and a stopped one resumes; continue with: {shlex.join(['python', *argv])}"), err
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the stage went with it
        os.killpg(proc.pid, 0)


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
        runtime.run_main(lambda argv: write_json(dict(a=2), path))
    monkeypatch.undo()
    assert e.value.code.startswith('error: cannot write ') and path in e.value.code and 'free some space' in e.value.code
    assert '\n' not in e.value.code
    assert json.load(open(path)) == dict(a=1) and os.listdir(tmp_path) == ['results.json']


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


def test_sample_data_dir_from_another_working_directory(cli_artifacts, tmp_path):
    """An LM trained with a relative --data_dir: from another folder sample.py cannot find its data
    (one line naming it), and --data_dir points it there."""
    A = cli_artifacts
    rel = os.path.relpath(A['data'], A['root'])
    ck = load_checkpoint(A['ckpt'])
    ck['meta']['data_dir'] = rel
    lm = str(tmp_path / 'rel_lm.pt')
    save_checkpoint(ck, lm)
    meta = dict(load_meta(A['data']), data_dir=A['data'])
    energy = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    save_checkpoint(energy_state(energy, lm, meta), str(tmp_path / 'energy.pt'))
    argv = [sys.executable, os.path.join(ROOT, 'sample.py'), '--lm', lm, '--energy', str(tmp_path / 'energy.pt'),
            '--prompt', 'the quick', '--gen_len', '4', '--n', '3', '--table_k', '2', '--out', str(tmp_path / 's.json'),
            *CLI_CPU]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    res = subprocess.run(argv, cwd=str(tmp_path), capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0 and res.stderr.strip() == f"error: no prepared data in '{rel}' (missing meta.json): " \
        "run data/shakespeare/prepare.py or data/text/prepare.py first", res.stderr
    res = subprocess.run(argv + ['--data_dir', A['data']], cwd=str(tmp_path), capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.load(open(tmp_path / 's.json'))['samples'][0]['prefix'] == 'the quick'


def test_incomplete_negatives_name_the_command_that_finishes_them(cli_artifacts, tmp_path):
    """nce_train.py on an unfinished negatives folder prints the negatives.py command that
    finishes it; run, it ends with the same files as the uninterrupted run."""
    d = str(tmp_path / 'neg')
    shutil.copytree(cli_artifacts['neg_incomplete'], d)
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
        nce_train.main(['--lm', cli_artifacts['ckpt'], '--negatives', cli_artifacts['neg_train'], '--val_negatives', d,
                        '--out_dir', str(tmp_path / 'e'), *CLI_NCE])
    cmd = shlex.split(str(e.value).split('to finish them: ')[1])
    assert cmd[:2] == ['python', 'negatives.py']
    negatives.main(cmd[2:] + ['--device', 'cpu', '--dtype', 'float32', '--quiet'])
    for f in ('tokens.bin', 'logp.bin', 'logq.bin', 'done.bin', 'offsets.npy'):
        assert open(os.path.join(d, f), 'rb').read() == open(os.path.join(cli_artifacts['neg_val'], f), 'rb').read(), f
    assert json.load(open(os.path.join(d, 'meta.json')))['complete']


def test_negatives_folder_with_nothing_done_restarts(cli_artifacts, tmp_path):
    """A negatives folder holding no finished chunk (e.g. stopped at once) has nothing to lose: a
    rerun with other settings starts it again instead of refusing, and finishes it."""
    out = str(tmp_path / 'neg')
    flags = ['--lm', cli_artifacts['ckpt'], '--split', 'val', '--out_dir', out, *CLI_NEG]
    negatives.main([*flags, '--chunk', '4'])
    with open(os.path.join(out, 'done.bin'), 'r+b') as f:
        n = len(f.read())
        f.seek(0)
        f.write(bytes(n))  # no chunk done
    negatives.main([*flags, '--chunk', '5', '--gen_len', '3'])
    neg = json.load(open(os.path.join(out, 'meta.json')))
    assert neg['complete'] and neg['chunk'] == 5 and neg['gen_len'] == 3


def test_prepare_identical_rerun_keeps_files_and_force_replaces(cli_artifacts, tmp_path):
    """Rerunning prepare.py with the same input rewrites nothing (models and reproduce.py's
    timestamps see the same files); other input needs --force."""
    raw = tmp_path / 'a.txt'
    raw.write_text(CLI_TEXT)
    out = str(tmp_path / 'data')
    text_prepare.main([str(raw), '--out_dir', out, '--quiet'])
    stamps = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    time.sleep(0.01)
    text_prepare.main([str(raw), '--out_dir', out, '--quiet'])
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == stamps
    with pytest.raises(ValueError, match='already holds other prepared data'):
        text_prepare.main([cli_artifacts['other_text'], '--out_dir', out, '--quiet'])
    text_prepare.main([cli_artifacts['other_text'], '--out_dir', out, '--quiet', '--force'])
    assert load_meta(out)['num_tokens'] != load_meta(cli_artifacts['data'])['num_tokens']


def test_nce_results_are_finite_and_best_exists(cli_artifacts):
    """The fixture's short NCE run: results.json parses strictly and the best.pt it names exists."""
    res = json.load(open(os.path.join(cli_artifacts['nce'], 'results.json')),
                    parse_constant=lambda c: pytest.fail(f'{c} in results.json'))
    assert math.isfinite(res['best_loss']) and os.path.exists(cli_artifacts['energy'])

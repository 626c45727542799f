"""
Tests of evaluation (issue 4: log Z bounds, joint PPL, per-step PPL) and generation (issue 5:
joint sampling, analyses, human evaluation). Work in progress, to be merged into test_all.py as
two sections. Every numeric check is against an independent reference: float64 brute force,
exact enumeration of every continuation on a tiny vocabulary, or a closed form.
Run: python -m pytest -q test_eval_wip.py
"""

import contextlib
import csv
import itertools
import json
import math
import os
import types
from fractions import Fraction

import numpy as np
import pytest
import torch

from test_all import (assert_clean_error, enumerate_continuations, lm_ckpt, lm_corpus,  # noqa: F401 (fixtures)
                      logprobs64, run_script, tiny_gpt)

import estimate_ppl  # noqa: E402
import human_eval  # noqa: E402
import sample  # noqa: E402
from data import load_meta, load_split  # noqa: E402
from energy import Energy, build_energy, energy_state, load_energy  # noqa: E402
from estimate_ppl import (evaluate_prefixes, last_step_logz, leave_one_out_lse, logz_bounds,  # noqa: E402
                          per_step, per_step_report, sample_log_weights, score, summarize)
from model import GPT, GPTConfig, file_hash, load_checkpoint, load_lm, save_checkpoint  # noqa: E402
from negatives import window_tokens, windows  # noqa: E402
from sample import joint_sample, next_token_table, topk_autoregressive, unique_ngrams  # noqa: E402
from tokenizer import EOT, load_tokenizer  # noqa: E402

NULL = contextlib.nullcontext()
CHI2_999 = {3: 16.266, 9: 27.877, 15: 37.697}  # chi-square critical values at p = 0.001, by degrees of freedom


# ---- evaluation: log Z bounds, joint PPL, per-step PPL (issue 4) ----

def rand_energy(V, seed=2, head_std=2.0, block_size=8, pool='continuation', causal=False):
    """A tiny Energy with random weights everywhere, the head included (it starts at zero, which
    is E = 0). With V = 4 and seed 2 the weights w = exp(-E) of 3-token continuations have a
    relative variance of 0.1-5 depending on the prefix, and the joint model is far from P_LM."""
    torch.manual_seed(seed)
    e = Energy(GPTConfig(block_size=block_size, vocab_size=V, n_layer=1, n_head=2, n_embd=16, causal=causal), pool)
    with torch.no_grad():
        for p in e.body.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
        e.head.weight.normal_(0.0, head_std)
        e.head.bias.fill_(0.3)
    return e.eval()


def energies(energy, seqs, prefix_len):
    with torch.no_grad():
        return energy(seqs, prefix_len).double()


def enumerate_joint(lm, energy, fixed, n_rest, V, P):
    """Exact enumeration over the V**n_rest completions r of the token row `fixed` (whose first P
    tokens are the prefix): continuation tokens r, log P_LM(r | fixed) (float64), E(fixed, r) with
    the energy's prefix length P, and log Z(fixed) = log sum_r P_LM(r | fixed) exp(-E(fixed, r))."""
    fixed = torch.as_tensor(fixed).view(1, -1)
    if n_rest == 0:
        E = energies(energy, fixed, P)
        return torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.float64), E, -E[0]
    conts = torch.tensor(list(itertools.product(range(V), repeat=n_rest)))
    seqs = torch.cat([fixed.expand(len(conts), -1), conts], 1)
    F = fixed.size(1)
    lp = logprobs64(lm, seqs)[:, F - 1:-1].gather(-1, conts[..., None]).squeeze(-1).sum(1)
    E = energies(energy, seqs, P)
    return conts, lp, E, torch.logsumexp(lp - E, 0)


def lme(a):
    """log mean exp of a float64 numpy vector, shifted by its max (no log(S - w_i) anywhere)."""
    a = np.asarray(a, dtype=np.float64)
    m = a.max()
    return m + math.log(np.mean(np.exp(a - m)))


def ref_bounds(lw):
    """Eq. 4 in float64 numpy loops: T_n and (2n-1) T_n - 2(n-1) mean_i T_{n-1}(x without x_i)."""
    lw = np.asarray(lw, dtype=np.float64)
    n = len(lw)
    T = lme(lw)
    T_loo = np.mean([lme(np.delete(lw, i)) for i in range(n)])
    return T, (2 * n - 1) * T - 2 * (n - 1) * T_loo


def tv(p, q):
    return 0.5 * float((torch.as_tensor(p, dtype=torch.float64) - torch.as_tensor(q, dtype=torch.float64)).abs().sum())


def test_leave_one_out_lse_brute_force():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 9):
        lw = torch.randn(3, 5, n, generator=g, dtype=torch.float64) * 4
        got = leave_one_out_lse(lw)
        assert got.shape == lw.shape
        for idx in itertools.product(range(3), range(5)):
            a = lw[idx].numpy()
            ref = [lme(np.delete(a, i)) + math.log(n - 1) for i in range(n)]
            assert np.abs(got[idx].numpy() - ref).max() < 1e-12
    # one weight dominating by e^50 (and by e^10000): what is left after removing it is exact
    got = leave_one_out_lse(torch.tensor([50.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert abs(got[0].item() - math.log(3)) < 1e-12 and abs(got[1].item() - (50 + math.log1p(2 * math.exp(-50)))) < 1e-12
    got = leave_one_out_lse(torch.tensor([0.0, -1e4, -1e4], dtype=torch.float64))
    assert abs(got[0].item() - (-1e4 + math.log(2))) < 1e-9 and got[1].item() == got[2].item() == 0.0


def test_logz_bounds_brute_force():
    g = torch.Generator().manual_seed(1)
    for n in (2, 3, 10, 64):
        lw = (torch.randn(2, 3, n, generator=g) * 3).float()  # float32 in, float64 out
        lo, hi = logz_bounds(lw)
        assert lo.shape == hi.shape == (2, 3) and lo.dtype == hi.dtype == torch.float64
        for i, j in itertools.product(range(2), range(3)):
            ref_lo, ref_hi = ref_bounds(lw[i, j].double().numpy())
            assert abs(lo[i, j].item() - ref_lo) < 1e-12 and abs(hi[i, j].item() - ref_hi) < 1e-9, (n, i, j)
        assert (hi - lo >= -1e-12).all()  # Jensen: T_n >= mean_i T_{n-1}^(-i), so lower <= upper always
        # shift invariance at |E| ~ 1e4: bounds(log w + c) = bounds(log w) + c, finite
        lo_s, hi_s = logz_bounds(lw.double() - 1e4)
        assert torch.isfinite(lo_s).all() and torch.isfinite(hi_s).all()
        assert (lo_s - (lo - 1e4)).abs().max() < 1e-9 and (hi_s - (hi - 1e4)).abs().max() < 1e-8
        ref = ref_bounds(lw[0, 0].double().numpy() - 1e4)
        assert abs(lo_s[0, 0].item() - ref[0]) < 1e-9 and abs(hi_s[0, 0].item() - ref[1]) < 1e-8
    # n = 2 in closed form: T_1 without x_i is log w_j, so upper = 3 T_2 - 2 mean(log w)
    lw = torch.tensor([[0.3, -1.2], [5.0, 5.0]], dtype=torch.float64)
    lo, hi = logz_bounds(lw)
    T2 = torch.log((lw.exp()).mean(1))
    assert (lo - T2).abs().max() < 1e-14 and (hi - (3 * T2 - 2 * lw.mean(1))).abs().max() < 1e-13
    # equal weights: both bounds are exact
    lo, hi = logz_bounds(torch.full((7,), 3.25))
    assert abs(lo.item() - 3.25) < 1e-12 and abs(hi.item() - 3.25) < 1e-12
    # one dominant weight, where log(S - w_i) cancels catastrophically
    for lw in ([50.0, 0.0, 0.0, 0.0], [0.0] + [-1e4] * 4, [1e4, 0.0, -3.0, 2.0, 1.0]):
        lo, hi = logz_bounds(torch.tensor(lw, dtype=torch.float64))
        ref_lo, ref_hi = ref_bounds(lw)
        assert math.isfinite(lo.item()) and math.isfinite(hi.item())
        assert abs(lo.item() - ref_lo) < 1e-9 * max(1, abs(ref_lo)) and abs(hi.item() - ref_hi) < 1e-9 * max(1, abs(ref_hi)), lw
        with np.errstate(divide='ignore', over='ignore', invalid='ignore'):  # the naive formula would be wrong here
            w = np.exp(np.array(lw))
            naive_loo = np.log(w.sum() - w) - math.log(len(lw) - 1)
        assert not np.isfinite(naive_loo[0]) or abs(naive_loo[0] - lme(np.delete(lw, 0))) > 1
    for n in (0, 1):
        with pytest.raises(ValueError, match='at least 2 samples'):
            logz_bounds(torch.zeros(3, n))


def test_logz_bounds_bias_lognormal():
    """w = exp(sigma z), z ~ N(0, 1): log E[w] = sigma^2 / 2. T_n is biased low and the upper
    estimator high, both by about Var(w) / (2 n E[w]^2) = (e^{sigma^2} - 1) / (2n), and both
    converge to the truth (Theorem 2). Tolerances are Monte Carlo standard errors."""
    sigma, R = 1.0, 20000
    truth = sigma ** 2 / 2
    c = (math.exp(sigma ** 2) - 1) / 2
    g = torch.Generator().manual_seed(0)
    bias = {}
    for n in (4, 16, 64):
        lo, hi = logz_bounds(sigma * torch.randn(R, n, generator=g, dtype=torch.float64))
        (m_lo, m_hi), (se_lo, se_hi) = (lo.mean().item(), hi.mean().item()), (lo.std().item() / R ** .5, hi.std().item() / R ** .5)
        assert m_lo + 4 * se_lo < truth < m_hi - 4 * se_hi, (n, m_lo, truth, m_hi)
        bias[n] = (truth - m_lo, m_hi - truth, se_lo, se_hi)
        if n >= 16:  # first-order theory: both biases ~ c / n
            assert abs((truth - m_lo) - c / n) < 4 * se_lo + 0.25 * c / n, (n, truth - m_lo, c / n)
            assert abs((m_hi - truth) - c / n) < 4 * se_hi + 0.25 * c / n, (n, m_hi - truth, c / n)
    for a, b in ((4, 16), (16, 64)):  # both gaps shrink as n grows
        for k in (0, 1):
            assert bias[b][k] + 4 * bias[b][k + 2] < bias[a][k] - 4 * bias[a][k + 2], (a, b, k, bias)


def toy_lm(V=4):
    return tiny_gpt(vocab_size=V, block_size=8, std=0.5, seed=3)


def test_logz_bounds_exact_enumeration():
    """log Z(prefix) of a random tiny LM and energy, exactly over all 4^3 continuations; the
    weights from sample_log_weights are unbiased for Z, and the bounds bracket log Z on average
    over independent groups of n samples and close in on it as n grows."""
    V, L, P = 4, 3, 2
    lm, e = toy_lm(V), rand_energy(V)
    prefixes = torch.tensor([[0, 0], [1, 2], [3, 1]])
    exact = torch.stack([enumerate_joint(lm, e, p, L, V, P)[3] for p in prefixes])
    N = 16384
    lw2 = sample_log_weights(lm, [e, rand_energy(V, seed=5)], prefixes, L, N, NULL, torch.Generator().manual_seed(0), max_rows=8192)
    assert lw2.shape == (2, 3, N) and lw2.dtype == torch.float64
    lw = lw2[0]
    w = (lw - exact[:, None]).exp()  # w / Z: mean 1 if the samples are exact draws of the untruncated LM
    se = w.std(1) / N ** .5
    assert ((w.mean(1) - 1).abs() < 5 * se).all(), (w.mean(1), se)
    # the second energy's weights are its own: the exact Z of energy 2 matches too
    e2_exact = torch.stack([enumerate_joint(lm, rand_energy(V, seed=5), p, L, V, P)[3] for p in prefixes])
    w2 = (lw2[1] - e2_exact[:, None]).exp()
    assert ((w2.mean(1) - 1).abs() < 5 * w2.std(1) / N ** .5).all()
    gaps = {}
    for n in (4, 16, 256):
        lo, hi = logz_bounds(lw.view(3, N // n, n))
        d_lo, d_hi = (lo - exact[:, None]).flatten(), (hi - exact[:, None]).flatten()
        m_lo, m_hi = d_lo.mean().item(), d_hi.mean().item()
        se_lo, se_hi = d_lo.std().item() / d_lo.numel() ** .5, d_hi.std().item() / d_hi.numel() ** .5
        gaps[n] = (m_lo, m_hi)
        if n <= 16:
            assert m_lo + 4 * se_lo < 0 < m_hi - 4 * se_hi, (n, m_lo, m_hi, se_lo, se_hi)
        else:
            assert abs(m_lo) < 4 * se_lo + 0.01 and abs(m_hi) < 4 * se_hi + 0.01, (n, m_lo, m_hi)
    assert -gaps[4][0] > 0.1 and gaps[4][1] > 0.05  # a visible bias at n = 4 that large n removes
    assert -gaps[16][0] < 0.5 * -gaps[4][0] and gaps[16][1] < 0.6 * gaps[4][1]
    # one large n per prefix: both bounds within a few standard deviations of log Z
    lo, hi = logz_bounds(lw)
    sd = (w.var(1) / N).sqrt()  # delta method: sd(T_N) ~ sd(w / Z) / sqrt(N)
    assert ((lo - exact).abs() < 4 * sd + 0.002).all() and ((hi - exact).abs() < 4 * sd + 0.002).all()


def toy_split(V, P, L, n_windows, seed=0):
    """A token stream of n_windows back-to-back windows with no end-of-text token (id V)."""
    data = torch.randint(V, (n_windows * (P + L),), generator=torch.Generator().manual_seed(seed)).numpy().astype(np.uint16)
    offsets = windows(data, V, P, L)
    assert len(offsets) == n_windows
    return data, offsets


def test_summarize_closed_form_and_exact_joint_ppl():
    V, L, P = 4, 3, 2
    lm, e = toy_lm(V), rand_energy(V)
    data, offsets = toy_split(V, P, L, 5)
    x = window_tokens(data, offsets, P + L)
    recs, exact_joint_lp, lp_ref, e_ref = [], [], [], []
    for b in range(len(x)):
        conts, lp, E, logz = enumerate_joint(lm, e, x[b, :P], L, V, P)
        i = int((conts == x[b, P:]).all(1).nonzero())
        joint = lp - E
        joint_lp = joint[i] - torch.logsumexp(joint, 0)  # log of the normalised joint table at x_b
        assert abs((joint - torch.logsumexp(joint, 0)).exp().sum().item() - 1) < 1e-12
        exact_joint_lp.append(joint_lp.item())
        lp_ref.append(lp[i].item())
        e_ref.append(E[i].item())
        recs.append(dict(index=b, lm_logp=lp[i].item(), extra_logp=[lp[i].item() - 0.25], energy=[E[i].item()],
                         logz={7: [[logz.item(), logz.item()]], 9: [[logz.item() - 0.1 * b, logz.item() + 0.2]]}))
    N = len(x) * L
    exact_ppl = math.exp(-sum(exact_joint_lp) / N)
    rows = summarize(recs, ['E'], ['LM2'], N, 7)
    assert [r['model'] for r in rows] == ['BASE LM', 'LM2', 'JOINT E']
    assert abs(rows[0]['ppl'] - math.exp(-sum(lp_ref) / N)) < 1e-12 * rows[0]['ppl']
    assert abs(rows[1]['ppl'] - math.exp(-(sum(lp_ref) - 0.25 * len(x)) / N)) < 1e-12 * rows[1]['ppl']
    assert abs(rows[2]['ppl_low'] - exact_ppl) < 1e-9 * exact_ppl and abs(rows[2]['ppl_high'] - exact_ppl) < 1e-9 * exact_ppl
    assert abs(exact_ppl - rows[0]['ppl']) > 0.05 * exact_ppl  # the joint model is not the LM here
    # the range: the low end of the PPL comes from the low end of log Z
    rows = summarize(recs, ['E'], [], N, 9, num_chars=40)
    lo_shift, hi_shift = sum(-0.1 * b for b in range(len(x))), 0.2 * len(x)
    assert abs(math.log(rows[1]['ppl_low']) - (-(sum(exact_joint_lp) - lo_shift) / N)) < 1e-9
    assert abs(math.log(rows[1]['ppl_high']) - (-(sum(exact_joint_lp) - hi_shift) / N)) < 1e-9
    assert abs(math.log(rows[1]['ppl_char_high']) - (-(sum(exact_joint_lp) - hi_shift) / 40)) < 1e-9
    assert abs(math.log(rows[0]['ppl_char']) - (-sum(lp_ref) / 40)) < 1e-9
    gain = (np.array(exact_joint_lp) - 0.2 - np.array(lp_ref)) / L  # per prefix, at the upper log Z
    assert abs(rows[1]['gain_nats_per_token'] - gain.mean()) < 1e-9
    assert abs(rows[1]['gain_se'] - gain.std(ddof=1) / math.sqrt(len(gain))) < 1e-9


def test_evaluate_prefixes_exact():
    """Per-prefix records of evaluate_prefixes against enumeration; their joint PPL is within
    Monte Carlo error of the exact one, and the range is ordered."""
    V, L, P = 4, 3, 2
    lm, e, lm2 = toy_lm(V), rand_energy(V), tiny_gpt(vocab_size=V, block_size=8, std=0.5, seed=7)
    data, offsets = toy_split(V, P, L, 5, seed=1)
    x = window_tokens(data, offsets, P + L)
    args = types.SimpleNamespace(prefix_len=P, gen_len=L, sweep=[4], num_samples=4096, chunk=2, seed=3,
                                 max_rows=8192, quiet=True)
    recs = evaluate_prefixes(lm, [e], [lm2], data, offsets, args, NULL, 'cpu', 0, 1, 'test')
    assert [r['index'] for r in recs] == list(range(5))
    lp_ref = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1).sum(1)
    lp2_ref = logprobs64(lm2, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1).sum(1)
    E_ref = energies(e, x, P)
    exact = torch.stack([enumerate_joint(lm, e, x[b, :P], L, V, P)[3] for b in range(5)])
    for b, r in enumerate(recs):
        assert abs(r['lm_logp'] - lp_ref[b].item()) < 1e-4 and abs(r['extra_logp'][0] - lp2_ref[b].item()) < 1e-4
        assert abs(r['energy'][0] - E_ref[b].item()) < 1e-6 * max(1, abs(E_ref[b].item()))  # float32 energies
        assert sorted(r['logz']) == [4, 4096]
        for n in (4, 4096):
            lo, hi = r['logz'][n][0]
            assert lo <= hi + 1e-12
        lo, hi = r['logz'][4096][0]
        assert abs(lo - exact[b].item()) < 0.15 and abs(hi - exact[b].item()) < 0.15
    exact_lp = lp_ref - E_ref - exact
    N = 5 * L
    exact_ppl = math.exp(-exact_lp.sum().item() / N)
    row = summarize(recs, ['E'], ['LM2'], N, 4096)[2]
    assert row['ppl_low'] <= row['ppl_high']
    for k in ('ppl_low', 'ppl_high'):
        assert abs(math.log(row[k]) - math.log(exact_ppl)) < 0.03, (k, row[k], exact_ppl)


def test_last_step_logz_exact():
    V, P, L = 4, 2, 3
    lm = toy_lm(V)
    x = torch.randint(V, (4, P + L), generator=torch.Generator().manual_seed(4))
    for pool in ('continuation', 'all'):
        e = rand_energy(V, pool=pool)
        got = last_step_logz(lm, e, x, P, NULL)
        assert got.shape == (4,) and got.dtype == torch.float64
        for b in range(4):
            _, lp, E, logz = enumerate_joint(lm, e, x[b, :-1], 1, V, P)
            assert abs(got[b].item() - logz.item()) < 1e-5
            # the exact last-step distribution P(v | x_<T) = P_LM(v | x_<T) exp(-E(x_<T, v)) / Z sums to 1
            assert abs((lp - E - got[b]).exp().sum().item() - 1) < 1e-5
    # where the energy's pooling starts matters: a last-step Z with another prefix length is another Z
    e = rand_energy(V)
    assert (energies(e, x, P) - energies(e, x, P + L - 1)).abs().max() > 0.1


def exact_step_logz(lm, e, x, P, V):
    """Exact log Z(x_<=t) for k = 0..L fixed continuation tokens of each row of x: (B, L+1)."""
    L = x.size(1) - P
    return torch.tensor([[enumerate_joint(lm, e, x[b, :P + k], L - k, V, P)[3].item() for k in range(L + 1)]
                         for b in range(x.size(0))], dtype=torch.float64)


def test_per_step_exact():
    V, P, L = 4, 2, 3
    lm, e = toy_lm(V), rand_energy(V)
    x = torch.tensor([[0, 0, 1, 3, 2], [3, 1, 0, 0, 1]])
    Z = exact_step_logz(lm, e, x, P, V)
    lp_ref = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1)
    E = energies(e, x, P)
    # Eq. 5 with exact Z: each step's distribution sums to 1 over the vocabulary, and the steps
    # telescope to the sequence-level joint log-prob log P_LM(x) - E(x) - log Z(prefix)
    for b in range(2):
        for k in range(L):
            step_lp = logprobs64(lm, x[b:b + 1, :P + k])[0, -1]
            z_next = torch.tensor([enumerate_joint(lm, e, torch.cat([x[b, :P + k], torch.tensor([v])]), L - k - 1, V, P)[3].item()
                                   for v in range(V)], dtype=torch.float64)
            assert abs((step_lp + z_next - Z[b, k]).exp().sum().item() - 1) < 1e-5  # float32 energies
        steps = lp_ref[b] + Z[b, 1:] - Z[b, :-1]
        assert abs(steps.sum().item() - (lp_ref[b].sum() - E[b] - Z[b, 0]).item()) < 1e-9
    assert torch.allclose(Z[:, L], -E)
    # per_step with many samples: bounds close to the exact Z, the last column exactly -E(x)
    lp, lo, hi = per_step(lm, e, x, P, 4000, NULL, torch.Generator().manual_seed(0), max_rows=8192)
    assert lp.shape == (2, L) and lo.shape == hi.shape == (2, L + 1)
    assert (lp - lp_ref).abs().max() < 1e-5
    assert (lo[:, L] - (-E)).abs().max() < 1e-6 and torch.equal(lo[:, L], hi[:, L])
    assert (hi >= lo - 1e-12).all()
    assert (lo - Z).abs().max() < 0.1 and (hi - Z).abs().max() < 0.1, (lo - Z, hi - Z)
    # the sum of the per-step log-probs at exact Z is the sequence-level joint log-prob, and the
    # per_step estimates of it are close
    joint_steps = lp + lo[:, 1:] - hi[:, :-1]
    assert ((joint_steps.sum(1) - (lp_ref.sum(1) - E - Z[:, 0])).abs() < 0.2).all()


def test_per_step_report_exact():
    V, P, L = 4, 2, 3
    lm, e = toy_lm(V), rand_energy(V)
    data, offsets = toy_split(V, P, L, 4, seed=2)
    args = types.SimpleNamespace(prefix_len=P, gen_len=L, step_prefixes=3, step_samples=4000, seed=1, max_rows=8192)
    rep = per_step_report(lm, e, data, offsets, args, NULL, 'cpu')
    x = window_tokens(data, offsets[:3], P + L)
    Z = exact_step_logz(lm, e, x, P, V)
    lp = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1)
    exact_step = lp + Z[:, 1:] - Z[:, :-1]  # (3, L) exact log P(x_t | x_<t) of the joint model
    assert rep['num_prefixes'] == 3 and rep['position'] == [1, 2, 3] and rep['step_samples'] == 4000
    assert np.allclose(rep['base_ppl'], torch.exp(-lp.mean(0)).numpy(), rtol=1e-5)
    assert abs(rep['last_step_base_ppl'] - math.exp(-lp[:, -1].mean().item())) < 1e-5 * rep['last_step_base_ppl']
    assert abs(rep['last_step_exact_ppl'] - math.exp(-exact_step[:, -1].mean().item())) < 1e-5 * rep['last_step_exact_ppl']
    exact_ppl = torch.exp(-exact_step.mean(0)).numpy()
    assert abs(exact_ppl[-1] - rep['base_ppl'][-1]) > 0.05  # the joint model differs from the LM at the last step
    for t in range(L):
        assert rep['joint_ppl_low'][t] <= rep['joint_ppl_high'][t]
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert abs(math.log(rep[k][t]) - math.log(exact_ppl[t])) < 0.15, (k, t, rep[k][t], exact_ppl[t])


# the command line, on a tiny trained LM and a random energy

EVAL_P, EVAL_L = 8, 4


@pytest.fixture(scope='module')
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


def test_energy_checkpoints(lm_ckpt, eval_ckpts):
    """The checkpoints the command-line tests use: load_energy rebuilds the saved energy exactly
    (the zero head is E = 0, the random head is not), tied to its LM by hash."""
    x = torch.randint(1, 30, (5, EVAL_P + EVAL_L), generator=torch.Generator().manual_seed(0))
    zero, ck = load_energy(eval_ckpts['zero'], lm_ckpt)
    assert ck['lm_hash'] == file_hash(lm_ckpt) and not zero.training
    assert torch.equal(energies(zero, x, EVAL_P), torch.zeros(5, dtype=torch.float64))
    bit, ck = load_energy(eval_ckpts['bit'])
    assert ck['pool'] == 'continuation' and ck['energy_kind'] == 'bit' and not bit.config.causal
    E = energies(bit, x, EVAL_P)
    assert E.std() > 0.05 and (E - energies(bit, x, EVAL_P + 1)).abs().max() > 1e-3  # pooling starts at the prefix
    ref = Energy(GPTConfig(**ck['config']), ck['pool'])
    ref.load_state_dict(torch.load(eval_ckpts['bit'], weights_only=True)['model'])
    assert torch.equal(energies(ref.eval(), x, EVAL_P), E)
    with pytest.raises(ValueError, match='not an energy'):
        load_energy(lm_ckpt)
    with pytest.raises(ValueError, match='residual of another LM'):
        load_energy(eval_ckpts['bit'], eval_ckpts['lm2'])


def ppl_argv(lm, energy, out, *extra):
    return ['--lm', lm, '--energy', f'BIT={energy}', '--splits', 'val,test', '--prefix_len', str(EVAL_P),
            '--gen_len', str(EVAL_L), '--max_prefixes', '5', '--num_samples', '8', '--chunk', '2',
            '--device', 'cpu', '--dtype', 'float32', '--quiet', '--out', str(out), *extra]


def test_estimate_ppl_cli(lm_corpus, lm_ckpt, eval_ckpts, tmp_path):
    extra = ['--per_step', '--step_prefixes', '2', '--step_samples', '4', '--sweep', '2,4,16',
             '--extra_lm', f"LM2={eval_ckpts['lm2']}"]
    out = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'a.json', *extra))
    estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'b.json', *extra))
    text = (tmp_path / 'a.json').read_text()
    assert text == (tmp_path / 'b.json').read_text()  # deterministic
    res = json.loads(text)
    assert res['hashes'] == dict(lm=file_hash(lm_ckpt), BIT=file_hash(eval_ckpts['bit']), LM2=file_hash(eval_ckpts['lm2']))
    meta = load_meta(lm_corpus)
    lm, lm2 = load_lm(lm_ckpt)[0], load_lm(eval_ckpts['lm2'])[0]
    energy = load_energy(eval_ckpts['bit'], lm_ckpt)[0]
    for split in ('val', 'test'):
        s = res['splits'][split]
        data = load_split(lm_corpus, split, meta)
        offsets = windows(data, meta['eot_id'], EVAL_P, EVAL_L, max_windows=5)
        x = window_tokens(data, offsets, EVAL_P + EVAL_L)
        assert (s['split'], s['num_samples'], s['num_prefixes'], s['num_tokens']) == (split, 8, 5, 5 * EVAL_L)
        lp = logprobs64(lm, x)[:, EVAL_P - 1:-1].gather(-1, x[:, EVAL_P:, None]).squeeze(-1).sum(1)
        assert abs(s['base_ppl'] - math.exp(-lp.sum().item() / (5 * EVAL_L))) < 1e-5 * s['base_ppl']
        lp2 = logprobs64(lm2, x)[:, EVAL_P - 1:-1].gather(-1, x[:, EVAL_P:, None]).squeeze(-1).sum(1)
        row = {r['model']: r for r in s['rows']}
        assert abs(row['LM2']['ppl'] - math.exp(-lp2.sum().item() / (5 * EVAL_L))) < 1e-5 * row['LM2']['ppl']
        assert s['joint_ppl_low'] <= s['joint_ppl_high']
        assert (row['JOINT BIT']['ppl_low'], row['JOINT BIT']['ppl_high']) == (s['joint_ppl_low'], s['joint_ppl_high'])
        assert abs(s['joint_ppl_low'] - s['base_ppl']) > 1e-3 * s['base_ppl']  # a non-zero energy moves it
        assert sorted(s['sweep'], key=int) == ['2', '4', '16'] and all(len(v) == 1 for v in s['sweep'].values())
        for n in s['sweep']:
            assert s['sweep'][n][0]['model'] == 'JOINT BIT' and s['sweep'][n][0]['ppl_low'] <= s['sweep'][n][0]['ppl_high']
        assert len({s['sweep'][n][0]['ppl_low'] for n in s['sweep']} | {s['joint_ppl_low']}) == 4
        ps = s['per_step']
        assert ps['position'] == list(range(1, EVAL_L + 1)) and ps['num_prefixes'] == 2
        lp_t = logprobs64(lm, x[:2])[:, EVAL_P - 1:-1].gather(-1, x[:2, EVAL_P:, None]).squeeze(-1)
        assert np.allclose(ps['base_ppl'], torch.exp(-lp_t.mean(0)).numpy(), rtol=1e-5)
        last = [enumerate_joint(lm, energy, x[b, :-1], 1, meta['vocab_size'], EVAL_P) for b in range(2)]
        exact_last = [lp_t[b, -1].item() - last[b][2][x[b, -1]].item() - last[b][3].item() for b in range(2)]
        assert abs(ps['last_step_exact_ppl'] - math.exp(-np.mean(exact_last))) < 1e-4 * ps['last_step_exact_ppl']
        assert all(a <= b for a, b in zip(ps['joint_ppl_low'], ps['joint_ppl_high']))
    assert {(r['model'], r['split']) for r in out['rows']} == {(m, s) for m in ('BASE LM', 'LM2', 'JOINT BIT') for s in ('val', 'test')}
    # another seed: other samples, other bounds
    estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'c.json', '--seed', '7'))
    other = json.loads((tmp_path / 'c.json').read_text())['splits']['test']
    assert other['base_ppl'] == res['splits']['test']['base_ppl'] and other['joint_ppl_low'] != res['splits']['test']['joint_ppl_low']
    # E = 0: the joint model is the LM, both ends of the range included
    zero = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['zero'], tmp_path / 'z.json', '--per_step', '--step_samples', '4'))
    for split, s in zero['splits'].items():
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert abs(s[k] - s['base_ppl']) <= 1e-12 * s['base_ppl'], (split, k, s[k], s['base_ppl'])
        ps = s['per_step']
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert np.allclose(ps[k], ps['base_ppl'], rtol=1e-12, atol=0)
        assert abs(ps['last_step_exact_ppl'] - ps['last_step_base_ppl']) < 1e-9 * ps['last_step_base_ppl']


def test_estimate_ppl_ddp_matches_single_process(lm_ckpt, eval_ckpts, tmp_path):
    argv = ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'ddp.json', '--sweep', '4', '--per_step', '--step_samples', '4')
    res = run_script(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', 'estimate_ppl.py', *argv])
    assert res.returncode == 0, res.stdout + res.stderr
    single = estimate_ppl.main(ppl_argv(lm_ckpt, eval_ckpts['bit'], tmp_path / 'one.json', '--sweep', '4', '--per_step',
                                        '--step_samples', '4'))
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


def test_estimate_ppl_bad_input(lm_ckpt, eval_ckpts, tmp_path):
    out = tmp_path / 'x.json'
    assert_clean_error(run_script(['estimate_ppl.py', *ppl_argv(lm_ckpt, eval_ckpts['bit'], out, '--num_samples', '1')]),
                       'at least 2')
    assert_clean_error(run_script(['estimate_ppl.py', *ppl_argv(lm_ckpt, eval_ckpts['bit'], out, '--sweep', '1,4')]),
                       'at least 2')
    # an energy that is the residual of another LM
    assert_clean_error(run_script(['estimate_ppl.py', *ppl_argv(eval_ckpts['lm2'], eval_ckpts['bit'], out)]),
                       'residual of another LM')
    argv = ppl_argv(lm_ckpt, eval_ckpts['bit'], out)
    argv[argv.index('--energy') + 1] = eval_ckpts['bit']  # no NAME=
    assert_clean_error(run_script(['estimate_ppl.py', *argv]), 'must be NAME=CHECKPOINT')
    assert_clean_error(run_script(['estimate_ppl.py', *ppl_argv(lm_ckpt, eval_ckpts['bit'], out, '--gen_len', '12')]),
                       'exceeds')
    assert not out.exists()


# ---- generation: joint sampling, analyses, human evaluation (issue 5) ----

class ListLM:
    """A stand-in LM whose generate() hands out one-token candidates 0, 1, 2, ... in order, the same
    for every prompt row, with given log P_LM and log q per candidate: the candidate set of
    joint_sample is then fixed and known."""

    def __init__(self, logp, logq):
        self.logp, self.logq, self.next = torch.as_tensor(logp).float(), torch.as_tensor(logq).float(), 0

    def generate(self, prefix, gen_len, num_samples=1, top_k=None, return_proposal=False, generator=None, max_rows=None):
        assert gen_len == 1
        ids = torch.arange(self.next, self.next + num_samples)
        self.next += num_samples
        B = prefix.size(0)
        out = (ids.view(1, -1, 1).expand(B, -1, 1).clone(), self.logp[ids].view(1, -1, 1).expand(B, -1, 1),
               self.logq[ids].view(1, -1, 1).expand(B, -1, 1))
        return out if return_proposal else out[:2]


class TableEnergy:
    """A stand-in energy: E(x) = table[last token of x], in float32 as Energy returns it."""

    def __init__(self, table):
        self.table = torch.as_tensor(table).float()

    def __call__(self, idx, prefix_len):
        return self.table[idx[:, -1]]


def chi_square(counts, p):
    counts, p = np.asarray(counts, dtype=np.float64), np.asarray(p, dtype=np.float64)
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize('correct_proposal', [False, True])
def test_joint_sample_resampling_frequencies(correct_proposal):
    """Algorithm 1 on a fixed set of K = 10 candidates, each of the B rows resampling one: the
    chosen candidates follow softmax(log w) (chi-square, p = 0.001), log w = -E, or -E + log P_LM
    - log q with the proposal correction. 10 candidates in chunks of 3, 3, 3, 1 exercise the
    running Gumbel-max."""
    K, B = 10, 20000
    g = torch.Generator().manual_seed(0)
    E = torch.randn(K, generator=g, dtype=torch.float64).float().double()
    logp, logq = torch.randn(K, generator=g) - 2, torch.randn(K, generator=g) - 2
    lm = ListLM(logp, logq)
    out = joint_sample(lm, TableEnergy(E), torch.zeros(B, 2, dtype=torch.long), K, 1, top_k=3,
                       correct_proposal=correct_proposal, generator=torch.Generator().manual_seed(1), max_rows=3 * B)
    assert lm.next == K  # all K candidates drawn, in chunks
    log_w = -E + (logp.double() - logq.double() if correct_proposal else 0)
    p = torch.softmax(log_w, 0).numpy()
    counts = np.bincount(out['joint'][:, 0].numpy(), minlength=K)
    stat = chi_square(counts, p)
    assert stat < CHI2_999[K - 1], (stat, counts, p * B)
    for wrong in (torch.softmax(-log_w, 0), torch.full((K,), 1.0 / K), torch.softmax(-E if correct_proposal else log_w + logp.double(), 0)):
        assert chi_square(counts, wrong.numpy()) > 10 * CHI2_999[K - 1]  # the test sees a wrong target
    assert (out['joint_energy'].double() - E[out['joint'][:, 0]]).abs().max() < 1e-6
    assert torch.equal(out['worst'][:, 0], torch.full((B,), int(E.argmax())))
    assert (out['worst_energy'].double() - E.max()).abs().max() < 1e-6
    assert torch.equal(out['base'][:, 0], torch.zeros(B, dtype=torch.long))  # the first LM sample
    assert (out['base_energy'].double() - E[0]).abs().max() < 1e-6
    w = np.exp(log_w.numpy() - log_w.numpy().max())
    assert (out['ess'] - w.sum() ** 2 / (w ** 2).sum()).abs().max() < 1e-6
    assert out['joint'].shape == out['worst'].shape == out['base'].shape == (B, 1) and out['ess'].shape == (B,)


def test_joint_sample_ess_extremes():
    # equal energies (the zero-head energy): every weight the same, ESS = n exactly
    V = 6
    lm = tiny_gpt(vocab_size=V, block_size=16, seed=2)
    torch.manual_seed(0)
    e0 = Energy(GPTConfig(block_size=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16, causal=False)).eval()
    prefix = torch.randint(V, (3, 4), generator=torch.Generator().manual_seed(0))
    out = joint_sample(lm, e0, prefix, 10, 5, top_k=4, generator=torch.Generator().manual_seed(0), max_rows=9)
    assert (out['ess'] - 10).abs().max() < 1e-9 and (out['joint_energy'] == 0).all()
    assert out['joint'].shape == (3, 5) and out['base'].shape == (3, 5)
    # one energy far below the others: ESS 1, and that sample is always the one chosen
    table = torch.zeros(12)
    table[7] = -40.0
    out = joint_sample(ListLM(torch.zeros(12), torch.zeros(12)), TableEnergy(table), torch.zeros(500, 2, dtype=torch.long), 12, 1,
                       generator=torch.Generator().manual_seed(0), max_rows=2500)
    assert (out['ess'] - 1).abs().max() < 1e-12
    assert (out['joint'][:, 0] == 7).all() and (out['joint_energy'] == -40).all()
    # two of them: ESS 2, each chosen half the time
    table[3] = -40.0
    out = joint_sample(ListLM(torch.zeros(12), torch.zeros(12)), TableEnergy(table), torch.zeros(4000, 2, dtype=torch.long), 12, 1,
                       generator=torch.Generator().manual_seed(0), max_rows=20000)
    assert (out['ess'] - 2).abs().max() < 1e-9
    assert set(out['joint'][:, 0].tolist()) == {3, 7} and abs((out['joint'][:, 0] == 3).double().mean().item() - 0.5) < 0.04


def joint_tables(lm, e, prefix, L, V, top_k):
    """Exact distributions over the V**L continuations of prefix: the joint model P_LM exp(-E)/Z,
    the same restricted to the support of the top-k proposal q, the joint model of the top-k
    LM q exp(-E)/Z_q, and P_LM itself."""
    conts, lp, E, _ = enumerate_joint(lm, e, prefix, L, V, prefix.numel())
    _, q = enumerate_continuations(lm, prefix.view(1, -1), L, V, top_k=top_k)
    joint = torch.softmax(lp - E, 0)
    in_q = q > 0
    restricted = torch.softmax(torch.where(in_q, lp - E, torch.tensor(float('-inf'), dtype=torch.float64)), 0)
    truncated = torch.softmax(q.log() - E, 0)
    return conts, joint, restricted, truncated, lp.exp()


def empirical(tokens, V):
    L = tokens.size(1)
    code = (tokens * (V ** torch.arange(L - 1, -1, -1))).sum(1)
    return torch.bincount(code, minlength=V ** L).double() / tokens.size(0)


def bigram_gpt(table, block_size=8):
    """A GPT that is exactly the bigram model P(v | ..., a) = softmax(table[a])_v: blocks that add
    nothing (zero output projections), no position embedding, one-hot token embeddings and an
    untied head whose columns sum to zero, so that ln_f's centring cancels: logits = table[a]."""
    table = torch.as_tensor(table, dtype=torch.float32)
    V = table.size(0)
    C = V + 1
    model = GPT(GPTConfig(block_size=block_size, vocab_size=V, n_layer=1, n_head=1, n_embd=C))
    s = math.sqrt((1 / C) * (1 - 1 / C) + model.transformer.ln_f.eps)  # ln_f's scale for a one-hot row
    W = torch.zeros(V, C)
    W[:, :V] = table.t() * s
    W[:, V] = -W[:, :V].sum(1)
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_proj.weight.zero_()
            blk.mlp.c_proj.weight.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.wte.weight = torch.nn.Parameter(torch.eye(V, C))
        model.lm_head.weight = torch.nn.Parameter(W)
    return model.eval()


# peaked after token 0, flat after tokens 1 and 3: the top-2 mass depends on the previous token
BIGRAM = [[3.0, 2.0, -2.0, -3.0], [0.3, 0.0, 0.2, 0.1], [-1.0, 0.5, 1.5, 0.2], [0.25, 0.2, -0.1, 0.3]]


def test_joint_sample_distribution_exact():
    """On an enumerable toy (4 tokens, 2 steps) the output of joint_sample converges to the
    exact joint distribution as n grows (untruncated proposal); with a top-2 proposal, to the
    joint model of the top-2 LM, or with the proposal correction to the untruncated joint model
    on the proposal's support (all the correction can reach: top-k never proposes the rest)."""
    V, L = 4, 2
    lm, e = toy_lm(V), rand_energy(V, head_std=3.0)
    prefix = torch.tensor([1, 2])
    conts, joint, _, _, p_lm = joint_tables(lm, e, prefix, L, V, top_k=2)
    assert (conts == torch.tensor(list(itertools.product(range(V), repeat=L)))).all()
    assert tv(p_lm, joint) > 0.3  # the target is far from the proposal: the test has power
    B = 6000
    rows = prefix.expand(B, -1).contiguous()
    dist = {}
    for n in (1, 4, 32):
        out = joint_sample(lm, e, rows, n, L, top_k=None, generator=torch.Generator().manual_seed(n), max_rows=64000)
        dist[n] = tv(empirical(out['joint'], V), joint)
    # n = 1 is P_LM itself; then the distance to the joint model shrinks
    assert abs(dist[1] - tv(p_lm, joint)) < 0.04 and dist[1] > dist[4] + 0.1 > dist[32] + 0.15 and dist[32] < 0.05, dist
    # top-2 proposals from an exact bigram GPT whose top-2 mass at step 2 depends on step 1
    lm, e, prefix = bigram_gpt(BIGRAM), rand_energy(V, seed=6, head_std=0.7), torch.tensor([0, 3])
    with torch.no_grad():
        assert (lm(prefix[None])[0][0] - torch.tensor(BIGRAM)[prefix]).abs().max() < 1e-5
    _, joint, restricted, truncated, p_lm = joint_tables(lm, e, prefix, L, V, top_k=2)
    assert tv(truncated, restricted) > 0.12 and tv(p_lm, joint) > 0.2
    rows = prefix.expand(B, -1).contiguous()
    for correct, target, other in ((False, truncated, restricted), (True, restricted, truncated)):
        out = joint_sample(lm, e, rows, 32, L, top_k=2, correct_proposal=correct, generator=torch.Generator().manual_seed(5),
                           max_rows=64000)
        emp = empirical(out['joint'], V)
        assert emp[~(restricted > 0)].sum() == 0  # never outside the top-2 support
        assert tv(emp, target) < 0.04 and tv(emp, other) > 0.09, (correct, tv(emp, target), tv(emp, other))


def rel_var(lp, E):
    """Var(w) / E[w]^2 of w = exp(-E) under the (enumerated) LM probabilities exp(lp): m samples
    give log Z to about sqrt(rel_var / m) (delta method); 0 when nothing is left to sample."""
    p, w = lp.exp(), (-E).exp()
    mu = (p * w).sum()
    return ((p * (w - mu) ** 2).sum() / mu ** 2).item()


def test_next_token_table_exact():
    """Table 3's next-token probabilities under the joint model, P_LM(v|x) Z(x, v) / Z(x), vs
    exact enumeration; tolerances from the delta-method standard error of the two log Z."""
    V, P, m = 4, 2, 6000
    lm, e = toy_lm(V), rand_energy(V)
    prefix = torch.tensor([[2, 3], [3, 1], [0, 3]])
    for gen_len in (1, 2):
        top_v, p_lm, p_joint = next_token_table(lm, e, prefix, gen_len, 3, m, NULL, torch.Generator().manual_seed(0),
                                                max_rows=8192)
        assert top_v.shape == p_lm.shape == p_joint.shape == (3, 3)
        for b in range(3):
            lp = logprobs64(lm, prefix[b:b + 1])[0, -1]
            assert torch.equal(top_v[b], lp.topk(3).indices)
            assert (p_lm[b] - lp.exp()[top_v[b]]).abs().max() < 1e-6
            _, lp_rest, E_rest, logz = enumerate_joint(lm, e, prefix[b], gen_len, V, P)
            for j, v in enumerate(top_v[b]):
                _, lp_c, E_c, logz_c = enumerate_joint(lm, e, torch.cat([prefix[b], v.view(1)]), gen_len - 1, V, P)
                exact = (lp[v] + logz_c - logz).exp().item()
                se = math.sqrt((rel_var(lp_c, E_c) + rel_var(lp_rest, E_rest)) / m)
                assert abs(p_joint[b, j].item() / exact - 1) < 4 * se + 0.005, (gen_len, b, j, p_joint[b, j].item(), exact, se)
                if b < 2 and j == 0:  # the joint next-token distribution is far from the LM's here
                    assert abs(exact - p_lm[b, j].item()) > 0.1


def test_topk_autoregressive_distribution():
    """With k = V (no truncation) Appendix A.1's token-by-token sampler approaches the exact joint
    model; with k = 2 it stays inside the LM's top-2 at every step."""
    V, L = 4, 2
    lm, e = toy_lm(V), rand_energy(V, head_std=3.0)
    prefix = torch.tensor([1, 2])
    _, joint, _, _, p_lm = joint_tables(lm, e, prefix, L, V, top_k=2)
    B = 3000
    rows = prefix.expand(B, -1).contiguous()
    toks = topk_autoregressive(lm, e, rows, L, V, 48, NULL, torch.Generator().manual_seed(0), max_rows=200000)
    assert toks.shape == (B, L)
    d = tv(empirical(toks, V), joint)
    assert d < 0.05 and tv(p_lm, joint) > 0.3, d
    toks = topk_autoregressive(lm, e, rows[:200], L, 2, 8, NULL, torch.Generator().manual_seed(1), max_rows=200000)
    seqs = torch.cat([rows[:200], toks], 1)
    lp = logprobs64(lm, seqs)[:, 1:-1]
    rank = (lp > lp.gather(-1, toks[..., None])).sum(-1)
    assert rank.max() < 2


def test_unique_ngrams_and_analyses():
    texts = ["a b a b", "a b c"]
    assert unique_ngrams(texts, 1) == 100 * 3 / 7  # a b a b a b c: 3 distinct of 7
    assert unique_ngrams(texts, 2) == 100 * 3 / 5  # ab ba ab | ab bc
    assert unique_ngrams(texts, 3) == 100 * 3 / 3  # aba bab | abc
    assert unique_ngrams(texts, 4) == 100.0 and math.isnan(unique_ngrams(texts, 5))
    assert unique_ngrams(["x y", "z w"], 2) == 100.0  # no n-gram across texts
    assert unique_ngrams(["  the the\nthe  "], 1) == 100 / 3  # whitespace-split words
    results = [dict(gold="a b c d", base="a a a a", joint="a b a b", lm_logp=dict(gold=-4.0, base=-1.0, joint=-2.5)),
               dict(gold="e f", base="a a", joint="c d", lm_logp=dict(gold=-6.0, base=-2.0, joint=-3.5))]
    rep = sample.analyses(results)
    assert rep['unique_ngrams']['gold'] == [100.0, 100.0, 100.0, 100.0]
    assert rep['unique_ngrams']['base'][:3] == [100 / 6, 100 / 4, 100 / 2] and rep['unique_ngrams']['base'][3] == 100.0
    assert rep['unique_ngrams']['joint'][:3] == [100 * 4 / 6, 100 * 3 / 4, 100.0]  # ab ba ab | cd
    assert rep['mean_lm_logp'] == dict(gold=-5.0, base=-1.5, joint=-3.0)
    assert rep['mean_lm_logp_diff'] == {'base-gold': 3.5, 'joint-gold': 2.0}


def binom_tail_exact(wins, losses):
    """P(X >= wins), X ~ Binomial(wins + losses, 1/2), as an exact fraction from Pascal's triangle."""
    row = [1]
    for _ in range(wins + losses):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return Fraction(sum(row[wins:]), 2 ** (wins + losses))


def test_binomial_p_value():
    assert human_eval.binomial_p_value(9, 1) == 11 / 1024
    assert human_eval.binomial_p_value(10, 0) == 1 / 1024 and human_eval.binomial_p_value(0, 10) == 1.0
    assert human_eval.binomial_p_value(0, 0) == 1.0 and human_eval.binomial_p_value(1, 0) == 0.5
    for w, l in [(5, 5), (3, 7), (20, 13), (60, 40), (7, 0), (1, 1)]:
        p = human_eval.binomial_p_value(w, l)
        assert abs(p - float(binom_tail_exact(w, l))) < 1e-15
        # complement: P(X >= w) + P(X >= l + 1) = 1 for X ~ Binomial(w + l, 1/2)
        assert abs(p + human_eval.binomial_p_value(l + 1, w - 1) - 1) < 1e-12


HE_SAMPLES = [dict(prefix=f'prefix {i}', base=f'base {i}', joint=f'joint {i}', worst=f'worst {i}', gold=f'gold {i}')
              for i in range(8)]


def simulate_votes(items, rater_prefs):
    """Raters read the texts: rater_prefs[rater](i, sides) -> the system name they pick or 'equal'."""
    votes = []
    for rater, pref in rater_prefs.items():
        for it in items:
            sides = {it['A'].split()[0]: 'A', it['B'].split()[0]: 'B'}
            pick = pref(int(it['prefix'].split()[1]), sides)
            votes.append((rater, str(it['item']), 'equal' if pick == 'equal' else sides[pick]))
    return votes


def prefs_good(i, sides):  # joint on prefixes 0-4, equal on 5, base on 6-7; the real text on checks
    if 'gold' in sides:
        return 'gold'
    return 'joint' if i < 5 else 'equal' if i == 5 else 'base'


def prefs_bad(i, sides):  # always the joint model, even over real text: fails the attention checks
    return 'joint'


def prefs_half(i, sides):  # the real text on checks; else joint on even prefixes, base on odd ones
    return 'gold' if 'gold' in sides else 'joint' if i % 2 == 0 else 'base'


def test_human_eval_roundtrip():
    items, key = human_eval.export(HE_SAMPLES, ['joint', 'base'], 3, seed=0)
    assert len(items) == 11 and [it['item'] for it in items] == list(range(11))
    assert key['systems'] == ['joint', 'base'] and sorted(key['items']) == sorted(str(i) for i in range(11))
    checks = [it for it in items if key['items'][str(it['item'])]['check']]
    assert len(checks) == 3
    for it in items:
        k = key['items'][str(it['item'])]
        i = int(it['prefix'].split()[1])
        assert it['A'] == f"{k['A']} {i}" and it['B'] == f"{k['B']} {i}"  # the key unblinds A/B
        assert {k['A'], k['B']} == ({'joint', 'gold'} if k['check'] else {'joint', 'base'})
    assert {key['items'][str(it['item'])]['A'] for it in items} >= {'joint', 'base'}  # both orders occur
    regular = [it for it in items if not key['items'][str(it['item'])]['check']]
    assert sorted(int(it['prefix'].split()[1]) for it in regular) == list(range(8))
    votes = simulate_votes(items, dict(r1=prefs_good, r2=prefs_bad, r3=prefs_half))
    rep = human_eval.score(key, votes)
    # r2 dropped; r1: 5 wins, 1 tie, 2 losses; r3: 4 wins, 4 losses
    assert rep['dropped_raters'] == ['r2']
    assert (rep['votes'], rep['wins'], rep['losses'], rep['ties']) == (16, 9, 6, 1)
    assert rep['preferred'] == 9 / 16 and rep['not_worse'] == 10 / 16
    assert rep['p_value'] == float(binom_tail_exact(9, 6))
    # tolerated failures keep r2: its 8 wins count
    rep = human_eval.score(key, votes, max_failed_checks=3)
    assert rep['dropped_raters'] == [] and (rep['wins'], rep['losses'], rep['ties']) == (17, 6, 1)
    rep = human_eval.score(key, votes, max_failed_checks=2)
    assert rep['dropped_raters'] == ['r2']
    # the same items with the systems swapped: wins and losses swap
    items2, key2 = human_eval.export(HE_SAMPLES, ['base', 'joint'], 0, seed=0)
    rep = human_eval.score(key2, simulate_votes(items2, dict(r1=prefs_good)))
    assert (rep['wins'], rep['losses'], rep['ties'], rep['votes']) == (2, 5, 1, 8)
    assert human_eval.export(HE_SAMPLES, ['joint', 'base'], 3, seed=0) == (items, key)  # seeded


def write_samples(path, samples=HE_SAMPLES):
    path.write_text(json.dumps(dict(samples=samples)))
    return str(path)


def test_human_eval_cli(tmp_path):
    samples = write_samples(tmp_path / 'samples.json')
    out_dir = tmp_path / 'he'
    res = run_script(['human_eval.py', 'export', '--samples', samples, '--systems', 'joint,base', '--checks', '3',
                      '--out_dir', str(out_dir)])
    assert res.returncode == 0, res.stderr
    with open(out_dir / 'items.csv', newline='') as f:
        items = list(csv.DictReader(f))
    jsonl = [json.loads(l) for l in (out_dir / 'items.jsonl').read_text().splitlines()]
    assert len(items) == len(jsonl) == 11 and [it['A'] for it in items] == [it['A'] for it in jsonl]
    key = json.loads((out_dir / 'key.json').read_text())
    assert 'joint' not in (out_dir / 'items.csv').read_text().split('\n')[0]  # raters do not see system names
    for it in jsonl:
        it['item'] = int(it['item'])
    votes = simulate_votes(jsonl, dict(r1=prefs_good, r2=prefs_bad, r3=prefs_half))
    with open(tmp_path / 'votes.csv', 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['rater', 'item', 'choice'])
        w.writerows(votes)
    res = run_script(['human_eval.py', 'score', '--key', str(out_dir / 'key.json'), '--votes', str(tmp_path / 'votes.csv')])
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / 'votes_report.json').read_text())
    assert rep == human_eval.score(key, votes) and rep['dropped_raters'] == ['r2'] and rep['wins'] == 9
    assert 'preferred 56.2%' in res.stdout
    # votes naming an item the key does not have, or a bad choice: one clear error
    for bad in (['r1', '99', 'A'], ['r1', '0', 'C']):
        with open(tmp_path / 'bad.csv', 'w', newline='') as f:
            w = csv.writer(f)
            w.writerow(['rater', 'item', 'choice'])
            w.writerows(votes[:3] + [bad])
        assert_clean_error(run_script(['human_eval.py', 'score', '--key', str(out_dir / 'key.json'), '--votes',
                                       str(tmp_path / 'bad.csv')]), 'bad vote')
    assert_clean_error(run_script(['human_eval.py', 'export', '--samples', samples, '--systems', 'joint,nope',
                                   '--out_dir', str(tmp_path / 'x')]), '--systems')
    no_gold = write_samples(tmp_path / 'nogold.json', [{k: v for k, v in s.items() if k != 'gold'} for s in HE_SAMPLES])
    assert_clean_error(run_script(['human_eval.py', 'export', '--samples', no_gold, '--out_dir', str(tmp_path / 'y')]),
                       'attention checks need real continuations')


def char_ids(tok, text):
    """Ids of a decoded char-tokenizer text, end-of-text tokens included (they decode to EOT)."""
    ids = []
    for i, piece in enumerate(text.split(EOT)):
        ids += ([tok.eot_id] if i else []) + tok.encode(piece)
    return ids


def test_sample_cli(lm_corpus, lm_ckpt, eval_ckpts, tmp_path):
    out = tmp_path / 's.json'
    argv = ['--lm', lm_ckpt, '--energy', eval_ckpts['bit'], '--split', 'test', '--num_prefixes', '3',
            '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--n', '6', '--top_k', '5', '--m', '3',
            '--table_k', '3', '--autoregressive', '--device', 'cpu', '--dtype', 'float32', '--quiet', '--out', str(out)]
    rep = sample.main(argv)
    assert json.dumps(json.loads(out.read_text())) == json.dumps(rep)
    meta = load_meta(lm_corpus)
    tok = load_tokenizer(meta)
    lm = load_lm(lm_ckpt)[0]
    energy = load_energy(eval_ckpts['bit'], lm_ckpt)[0]
    data = load_split(lm_corpus, 'test', meta)
    x = window_tokens(data, windows(data, meta['eot_id'], EVAL_P, EVAL_L, max_windows=3), EVAL_P + EVAL_L)
    assert len(rep['samples']) == 3
    for b, r in enumerate(rep['samples']):
        assert r['prefix'] == tok.decode(x[b, :EVAL_P].tolist()) and r['gold'] == tok.decode(x[b, EVAL_P:].tolist())
        assert r['n'] == 6 and 1 - 1e-9 <= r['ess'] <= 6 + 1e-9
        seqs = {k: torch.tensor([x[b, :EVAL_P].tolist() + char_ids(tok, r[k])])
                for k in ('base', 'joint', 'worst', 'gold', 'autoregressive')}
        assert all(s.shape == (1, EVAL_P + EVAL_L) for s in seqs.values())
        for k in ('base', 'joint', 'worst', 'gold'):
            ref = energies(energy, seqs[k], EVAL_P).item()
            assert abs(r[f'{k}_energy'] - ref) < 1e-5 * max(1, abs(ref))
        assert r['worst_energy'] >= max(r['base_energy'], r['joint_energy'])  # the worst of n includes both
        for k in ('base', 'joint', 'gold', 'autoregressive'):
            s = seqs[k]
            ref = logprobs64(lm, s)[0, EVAL_P - 1:-1].gather(-1, s[0, EVAL_P:, None]).sum().item()
            assert abs(r['lm_logp'][k] - ref) < 1e-4
        assert len(r['next_tokens']) == 3
        lp = logprobs64(lm, x[b:b + 1, :EVAL_P])[0, -1]
        assert [t['token'] for t in r['next_tokens']] == [tok.decode([v]) for v in lp.topk(3).indices.tolist()]
        assert np.allclose([t['p_lm'] for t in r['next_tokens']], lp.exp().topk(3).values.numpy(), atol=1e-6)
    assert json.dumps(rep['unique_ngrams']) == json.dumps(sample.analyses(rep['samples'])['unique_ngrams'])  # NaN-aware
    assert sorted(rep['unique_ngrams']) == ['autoregressive', 'base', 'gold', 'joint']
    assert rep['mean_lm_logp']['gold'] == np.mean([r['lm_logp']['gold'] for r in rep['samples']])
    # a prompt instead of data prefixes: no gold
    rep = sample.main(['--lm', lm_ckpt, '--energy', eval_ckpts['bit'], '--prompt', 'the quick', '--gen_len', '4',
                       '--n', '4', '--table_k', '0', '--quiet', '--device', 'cpu', '--out', str(tmp_path / 'p.json')])
    r = rep['samples'][0]
    assert r['prefix'] == 'the quick' and 'gold' not in r and 'next_tokens' not in r
    assert len(char_ids(tok, r['joint'])) == len(char_ids(tok, r['base'])) == 4
    # then human_eval on sample.py's output
    res = run_script(['human_eval.py', 'export', '--samples', str(out), '--checks', '1', '--out_dir', str(tmp_path / 'he')])
    assert res.returncode == 0, res.stderr
    assert len(json.loads((tmp_path / 'he' / 'key.json').read_text())['items']) == 4
    # bad input
    assert_clean_error(run_script(['sample.py', *argv[:-1], str(tmp_path / 'bad.json'), '--n', '0']), 'at least 1')
    assert_clean_error(run_script(['sample.py', '--lm', eval_ckpts['lm2'], '--energy', eval_ckpts['bit'], '--n', '2',
                                   '--out', str(tmp_path / 'bad.json')]), 'residual of another LM')

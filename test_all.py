"""The method's tests to read first: each equation against an exact reference (float64 brute force,
exact enumeration or a closed form), CPU only, tiny models (their time on an idle machine: README):

    python -m pytest -q test_all.py            # the learner's command: these tests
    python -m pytest -q test_all.py tests      # every test (CI's and the README's command)

This file opens with the eleven tests that teach the method (below), then the helpers they share
with tests/, then the estimators' own tests ('# ==== estimation'). tests/ holds the rest, a file a
concept or a concern, each section of the method under the '# ====' banner it had here:
    tests/test_data.py        the tokenizers and prepare.py: round-trips, each document once, windows
    tests/test_model.py       the GPT LM: attention, KV cache, shared-prompt decoding, log-probs,
                              sampling and q, training, early stopping, DDP
    tests/test_energy.py      E(x): padding, pooling, context, UNIT/BIT bodies, MLM masks, checkpoints
    tests/test_negatives.py   negatives.py: the LM's samples with log P_LM and log q
    tests/test_nce.py         nce_train.py (Eq. 3): log ratios, truncated noise, DDP, best on select
    tests/test_estimation.py  estimate_ppl.py from the command line (the estimators are here)
    tests/test_sampling.py    Algorithm 1's frequencies and ESS, Table 3, top-k sampling, sample.py
    tests/test_baselines.py   RALM (Eq. 6), BALM, the paper's presets
    tests/test_bad_input.py   bad input: one clear line each (the CLI table)
    tests/cli_files.py        the files the CLI table's rows point at (broken, odd, one defect each)
    tests/test_interruptions.py  memory, Ctrl-C, SIGTERM and kill -9, each one line
    tests/test_full_disk.py   a full disk in one line, and writes that land whole
    tests/test_script_refusals.py  each script's refusals, case by case
    tests/test_flags.py       every script's flags: one vocabulary, help and defaults, declared bounds
    tests/test_resume.py      resume, locks, DDP and torchrun, fp16, finite checkpoints
    tests/test_hardware.py    precision and threads from the hardware, the wait policy
    tests/test_job.py         the main job end to end (job/reproduce.py --quick), the lesson, figures,
                              bench
    tests/test_pipeline.py    the job's scheduler (job/pipeline.py): --jobs, failures, its lock
    tests/test_recipe.py      the settings the job's flags choose (--recipe gpu, the addition job's
                              sizes) and the prepared data it reuses
    tests/test_claims.py      the claims and their statistics (job/claims.py, job/stats.py)
    tests/test_seeds.py       the addition table over seeds (job/seeds.py)
    tests/test_human_eval.py  Table 2's protocol (job/human_eval.py)
    tests/test_metric_ebm.py  the talk's metric energy and TaiLr
    tests/test_exo.py         EXO's objective against exact enumeration (Ji et al., ICML 2024)
    tests/test_addition.py    the addition task, its decoders and P(correct sum)
    tests/test_exo_runs.py    exo.py's runs on it: resume, precision, bad input
    tests/test_exo_budget.py  EXO's budget curve from the runs kept in assets (job/exo_budget.py)
    tests/test_carry.py       the lookahead (extensions/carry.py) by enumeration; job/lookahead.py
    tests/test_provenance.py  the main job's provenance.json
    tests/test_checkpoints.py  a checkpoint checked before use, --resume by content
    tests/test_exact_logz.py  exact log Z on 2- and 3-digit addition (exact_logz.py, enumeration.py)
    tests/test_docs.py        the numbers and flag values of README.md and docs/ against the code
    tests/test_doc_results.py  the docs' numbers from committed runs against assets/*.json
    tests/test_doc_times.py   the same for the docs' times: stage times, probes, bench ratios
    tests/test_doc_probes.py  the same for the lookahead table and EXO's probes
    tests/test_doc_seeds.py    the same for docs/addition.md's tables over seeds
    tests/test_doc_commands.py  docs/using.md's step-by-step commands against the job's own
    tests/test_layout.py      the files' roles, the import graph, line and function lengths, the
                              README's numbers, every documented command, length checks before zips
    tests/common.py           the helpers several files share (tiny models, exact references, flags),
                              imported by name (this file imports its own from there too)
    tests/conftest.py         the fixtures tests/ shares (the tiny trained checkpoints, each trained
                              once a run), served by pytest to every file under tests/; this file
                              takes none
    tests/scripts/            the child scripts the tests run (wrappers of a trainer, a CLI runner)

Read these first:
    test_cached_decoding_matches_full_forward   the KV cache is the plain forward (model.py)
    test_generate_plain_and_cached_draw_the_same  nanoGPT's sampling loop and the fast generate agree
    test_generate_distribution_exact            samples follow P_LM and its top-k/top-p proposal
    test_nce_loss_brute_force                   Eq. 3, binary and ranking, in float64
    test_logz_bounds_brute_force                Eq. 4's two bounds, and their bias (Theorem 2)
    test_logz_bounds_exact_enumeration          log Z against every continuation of a 4-token LM
    test_logz_enumerate_is_unbiased_exactly     log Z where Eq. 4 fails: E[Z_hat] = Z over every n-tuple
    test_per_step_exact                         Eq. 5 telescopes to the joint log-probability
    test_algorithm_1_and_joint_sample_agree     Algorithm 1, plain and chunked
    test_joint_ppl_end_to_end_on_the_copy_task  NCE learns what the LM cannot; the PPL range holds it
    test_moment_matching_is_the_kl_projection   the talk's metric energy: KL projection, Pythagoras
"""

import contextlib
import copy
from dataclasses import asdict
import itertools
import math
import random
import types

import numpy as np
import pytest
import torch

from data import load_meta, load_split, window_tokens, windows
from energy import (Energy, MIN_ESS, joint_sample, kish_ess, kl_to_lm, leave_one_out_lse, load_energy,
                    logz_bounds, logz_diagnostics, logz_enumerate, sample_log_weights, score)
from estimate_ppl import (calibrate, evaluate_prefixes, last_step_logz, mc_se, per_step, per_step_report,
                          summarize)
import estimate_ppl
from extensions import metrics
from model import GPT, GPTConfig, RALM
import model as model_module
import nce_train
import negatives
from plumbing import rng, save_checkpoint
import sample

from tests.common import CPU, FP32, enumerable_problem, logprobs64, prepare_corpus, rand_energy, tiny_gpt


# =============================================================================
# ==== read these first: the method, each piece against an exact reference (the helpers they use
#      are defined below them or in tests/common.py; the rest of each piece's tests are in tests/) ====

@pytest.mark.parametrize('p', [1, 2, 5, 17, 31])  # ragged prompt lengths up to block_size - 1
@pytest.mark.parametrize('alibi', [False, True])
def test_cached_decoding_matches_full_forward(alibi, p):
    model, idx = decoding_case(alibi)
    B, T = idx.shape
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache(B, T)
        got = [model(idx[:, :p], cache=cache, pos=0)[0]]
        pos = p
        if pos + 4 <= T:  # a multi-token chunk at pos > 0: the explicit-mask branch
            got.append(model(idx[:, pos:pos + 4], cache=cache, pos=pos)[0])
            pos += 4
        for t in range(pos, T):  # then one token at a time
            got.append(model(idx[:, t:t + 1], cache=cache, pos=t)[0])
        got = torch.cat(got, dim=1)
    assert got.shape == full.shape
    assert (got - full).abs().max().item() < 1e-5


@pytest.mark.parametrize('alibi', [False, True])
@pytest.mark.parametrize('kw', [dict(), dict(top_k=3), dict(top_p=0.8, temperature=0.7)])
def test_generate_plain_and_cached_draw_the_same(alibi, kw, monkeypatch):
    """model.generate (one pass over each prompt, its K/V shared by the samples' rows) draws the very
    tokens of generate_plain (nanoGPT's loop: every row's whole sequence at every step) from the same
    generator, in float64. A decode step that forgot the shared prompt (a mutation) is caught."""
    model, _ = decoding_case(alibi)
    model = copy.deepcopy(model).double()
    prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))

    def cached():
        return model.generate(prompts, 8, num_samples=4, generator=torch.Generator().manual_seed(1), **kw)[0]
    plain = model.generate_plain(prompts, 8, num_samples=4, generator=torch.Generator().manual_seed(1), **kw)
    assert plain.shape == (3, 4, 8) and torch.equal(cached(), plain)
    def without_prompt(q, k, v, prompt_k, prompt_v, mask=None, prompt_rows=None):
        return model_module.attention(q, k, v, None if mask is None else mask[..., prompt_k.size(2):])
    monkeypatch.setattr(model_module, 'shared_prompt_attention', without_prompt)
    assert not torch.equal(cached(), plain)


@pytest.mark.parametrize('top_k,top_p,temperature', [(None, None, 1.0), (3, None, 0.7), (None, 0.8, 1.5)])
def test_generate_distribution_exact(top_k, top_p, temperature):
    V, n_new, N = 4, 3, 20000
    model = tiny_gpt(vocab_size=V, block_size=8, std=0.5, seed=3)
    prompt = torch.tensor([[1, 3]])
    tok_lp, q_seq = enumerate_continuations(model, prompt, n_new, V, top_k, top_p, temperature)
    assert abs(q_seq.sum().item() - 1) < 1e-9
    assert 0.5 * (q_seq - 1 / V ** n_new).abs().sum().item() > 0.2  # far from uniform: the test has power
    g = torch.Generator().manual_seed(0)
    # max_rows 6000: four chunks, the last one ragged
    tokens, logp, logq = model.generate(prompt, n_new, num_samples=N, top_k=top_k, top_p=top_p,
                                        temperature=temperature, return_proposal=True, generator=g,
                                        max_rows=6000)
    assert tokens.shape == logp.shape == logq.shape == (1, N, n_new)
    code = (tokens[0] * torch.tensor([V * V, V, 1])).sum(1)
    emp = torch.bincount(code, minlength=V ** n_new).double() / N
    tv = 0.5 * (emp - q_seq).abs().sum().item()
    assert tv < 0.03, tv
    # logprobs: the exact untruncated per-token log-probs of the sampled tokens
    assert (logp[0].double() - tok_lp[code]).abs().max().item() < 1e-5
    # logq: the float64 log-probs of the distribution actually sampled from
    seqs = torch.cat([prompt.expand(N, -1), tokens[0]], dim=1)
    lp = logprobs64(model, seqs)[:, 1:-1]
    ref_q = torch.from_numpy(brute_proposal64(lp.numpy(), top_k, top_p, temperature)).view_as(lp)
    ref_q = ref_q.gather(-1, tokens[0][..., None]).squeeze(-1)
    assert torch.isfinite(ref_q).all()  # never a token outside the proposal's support
    assert (logq[0].double() - ref_q).abs().max().item() < 1e-5


@pytest.mark.parametrize('B,M', [(1, 1), (7, 1), (5, 4)])
def test_nce_loss_brute_force(B, M):
    g = torch.Generator().manual_seed(0)
    e_pos = torch.randn(B, generator=g, dtype=torch.float64) * 6
    e_neg = torch.randn(B, M, generator=g, dtype=torch.float64) * 6
    e_neg[0, 0] = e_pos[0]  # a tie counts as a mistake: accuracy is E+ < E- strictly
    e_pos[-1] = 40.0  # far in the tails: no overflow
    p, n = e_pos.tolist(), e_neg.tolist()
    ref_bin = sum(softplus64(p[b]) + sum(softplus64(-x) for x in n[b]) / M for b in range(B)) / B
    ref_rank = 0.0
    for b in range(B):
        s = [-p[b]] + [-x for x in n[b]]
        m = max(s)
        ref_rank += -(s[0] - (m + math.log(sum(math.exp(v - m) for v in s)))) / B
    ref_acc = sum(p[b] < x for b in range(B) for x in n[b]) / (B * M)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for kind, ref in (('binary', ref_bin), ('ranking', ref_rank)):
            loss, acc = nce_train.nce_loss(e_pos.to(dtype), e_neg.to(dtype), kind)
            assert abs(loss.item() - ref) <= tol * max(1.0, abs(ref)), (kind, dtype)
            assert abs(acc.item() - ref_acc) < 1e-6  # accuracy is a float32 mean
    if M == 1:  # with one negative, the ranking loss is the binary loss of E+ - E- (softmax of two)
        ref_pair = sum(softplus64(p[b] - n[b][0]) for b in range(B)) / B
        assert abs(nce_train.nce_loss(e_pos, e_neg, 'ranking')[0].item() - ref_pair) < 1e-12
    else:
        assert 0 < ref_acc < 1  # the accuracy check can see a wrong count


@pytest.mark.parametrize('n', [2, 3, 10, 64])
def test_logz_bounds_brute_force(n):
    # float32 in, float64 out
    lw = (torch.randn(2, 3, n, generator=torch.Generator().manual_seed(1)) * 3).float()
    lo, hi = logz_bounds(lw)
    assert lo.shape == hi.shape == (2, 3) and lo.dtype == hi.dtype == torch.float64
    for i, j in itertools.product(range(2), range(3)):
        ref_lo, ref_hi = ref_bounds(lw[i, j].double().numpy())
        assert abs(lo[i, j].item() - ref_lo) < 1e-12 and abs(hi[i, j].item() - ref_hi) < 1e-9, (i, j)
    assert (hi - lo >= -1e-12).all()  # Jensen: T_n >= mean_i T_{n-1}^(-i), so lower <= upper always
    # shift invariance at |E| ~ 1e4: bounds(log w + c) = bounds(log w) + c, finite
    lo_s, hi_s = logz_bounds(lw.double() - 1e4)
    assert torch.isfinite(lo_s).all() and torch.isfinite(hi_s).all()
    assert (lo_s - (lo - 1e4)).abs().max() < 1e-9 and (hi_s - (hi - 1e4)).abs().max() < 1e-8
    ref = ref_bounds(lw[0, 0].double().numpy() - 1e4)
    assert abs(lo_s[0, 0].item() - ref[0]) < 1e-9 and abs(hi_s[0, 0].item() - ref[1]) < 1e-8


def test_logz_bounds_exact_enumeration():
    """log Z(prefix) of a random tiny LM and energy, exactly over all 4^3 continuations; the
    weights from sample_log_weights are unbiased for Z, and the bounds bracket log Z on average
    over independent groups of n samples and close in on it as n grows."""
    V, L, P = 4, 3, 2
    lm, e = toy_lm(V), rand_energy(V)
    prefixes = torch.tensor([[0, 0], [1, 2], [3, 1]])
    exact = torch.stack([enumerate_joint(lm, e, p, L, V, P)[3] for p in prefixes])
    N = 16384
    lw2 = sample_log_weights(lm, [e, rand_energy(V, seed=5)], prefixes, L, N, FP32,
                             torch.Generator().manual_seed(0), max_rows=8192)
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


def test_logz_enumerate_is_unbiased_exactly():
    """energy.logz_enumerate's Z_hat (the exact part over the distinct continuations seen, the rest by
    leave-one-out) has expectation exactly Z: the mean over every ordered n-tuple of draws from P_LM,
    weighted by its probability, in float64; with or without a known set. Its sure part never
    exceeds log Z. Dropping the (1 - P_LM(x_i)) factor of the rest would be off by a lot here."""
    g = torch.Generator().manual_seed(0)
    V, L, n = 2, 2, 3  # 4 continuations, 64 ordered triples
    conts = torch.tensor(list(itertools.product(range(V), repeat=L)))
    log_p = torch.log_softmax(torch.randn(len(conts), generator=g, dtype=torch.float64) * 1.5, 0)
    log_w = torch.randn(len(conts), generator=g, dtype=torch.float64) * 2
    log_z = torch.logsumexp(log_p + log_w, 0)
    tuples = torch.tensor(list(itertools.product(range(len(conts)), repeat=n)))  # (64, n)
    prob = log_p[tuples].sum(1).exp()  # each tuple's probability
    assert abs(prob.sum().item() - 1) < 1e-12
    for known in ([], [2], [0, 3, 0]):  # none, one, and a repeated known continuation
        idx = torch.cat([torch.tensor(known, dtype=torch.long).expand(len(tuples), -1), tuples], 1)
        z = logz_enumerate(conts[idx], log_p[idx], log_w[idx], known=len(known))
        assert abs((prob * z['estimate'].exp()).sum().item() - log_z.exp().item()) < 1e-12, known
        assert (z['sure'] <= log_z + 1e-12).all() and (z['estimate'] >= z['sure']).all()
        seen = [set(r.tolist()) for r in idx]
        mass = torch.tensor([log_p[list(s)].exp().sum().item() for s in seen], dtype=torch.float64)
        assert torch.allclose(z['mass'], mass, atol=1e-12)
    # leading dims of log_w (several energies) are kept
    z2 = logz_enumerate(conts[tuples], log_p[tuples], torch.stack([log_w, -log_w])[:, tuples])
    assert z2['estimate'].shape == (2, len(tuples))


def test_per_step_exact(monkeypatch):
    """per_step with many samples: bounds close to the exact Z, the last column exactly -E(x); the
    sum of the per-step log-probs at exact Z is the sequence-level joint log-prob, and the per_step
    estimates of it are close. Each sampled Z's sure lower bound (what its diagnostics flag against)
    is the real rest's own term, log P_LM(x_>P+k | x_<=P+k) - E(x) in float64, and lies below Z."""
    V, P, L = 4, 2, 3
    lm, e = toy_lm(V), rand_energy(V)
    x = torch.tensor([[0, 0, 1, 3, 2], [3, 1, 0, 0, 1]])
    Z = exact_step_logz(lm, e, x, P, V)
    lp_ref = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1)
    E = energies(e, x, P)
    sures, diagnostics = [], estimate_ppl.logz_diagnostics
    spy = lambda log_w, logz_sure=None: (sures.append(logz_sure), diagnostics(log_w, logz_sure))[1]
    monkeypatch.setattr(estimate_ppl, 'logz_diagnostics', spy)
    lp, ks, lo, hi = per_step(lm, e, x, P, 4000, FP32, torch.Generator().manual_seed(0), max_rows=8192)[:4]
    monkeypatch.undo()
    assert len(sures) == L
    for k, sure in enumerate(sures):
        assert (sure - (lp_ref[:, k:].sum(1) - E)).abs().max() < 1e-5, k
        assert (sure <= Z[:, k] + 1e-6).all(), k
    assert ks == list(range(L + 1)) and lp.shape == (2, L) and lo.shape == hi.shape == (2, L + 1)
    assert (lp - lp_ref).abs().max() < 1e-5
    assert (lo[:, L] - (-E)).abs().max() < 1e-6 and torch.equal(lo[:, L], hi[:, L])
    assert (hi >= lo - 1e-12).all()
    assert (lo - Z).abs().max() < 0.1 and (hi - Z).abs().max() < 0.1, (lo - Z, hi - Z)
    joint_steps = lp + lo[:, 1:] - hi[:, :-1]
    assert ((joint_steps.sum(1) - (lp_ref.sum(1) - E - Z[:, 0])).abs() < 0.2).all()


def test_algorithm_1_and_joint_sample_agree():
    """sample.algorithm_1 (the paper's Algorithm 1, one prefix at a time) and joint_sample (rows
    and candidates in chunks, a running Gumbel-max) draw from the same distribution: n = 8
    candidates of 2 tokens over V = 3 from the untruncated LM (top_k = V), the 9 outcomes'
    empirical frequencies within TV 0.06; both far from P_LM (n = 1), so the check has power. It
    compares the two with each other; each against the distribution it must draw from (softmax of
    log w over known candidates, chi-square): tests/test_sampling.py's resampling-frequency tests."""
    V, L, n = 3, 2, 8
    lm, e = tiny_gpt(vocab_size=V, block_size=8, n_layer=1, std=0.5, seed=3), rand_energy(V, head_std=3.0)
    prefix = torch.tensor([[1, 0, 2]])
    g = torch.Generator().manual_seed(0)
    a1 = torch.stack([sample.algorithm_1(lm, e, prefix, n, L, top_k=V, generator=g)[0][0]
                      for _ in range(1500)])
    rows = prefix.expand(6000, -1).contiguous()
    js = joint_sample(lm, e, rows, n, L, top_k=None, generator=torch.Generator().manual_seed(1))['joint']
    assert a1.shape == (1500, L) and js.shape == (6000, L)
    p_a1, p_js = empirical(a1, V), empirical(js, V)
    _, p_lm = enumerate_continuations(lm, prefix, L, V)
    assert tv(p_a1, p_js) < 0.06, (p_a1, p_js)
    assert tv(p_a1, p_lm) > 0.15 and tv(p_js, p_lm) > 0.15, (tv(p_a1, p_lm), tv(p_js, p_lm))


def test_joint_ppl_end_to_end_on_the_copy_task(tmp_path):
    """The whole chain where the answer is known. Real text is random 2-letter words each followed
    by its copy; the base LM is the exact unigram model; NCE (early-stopped on the selection
    split) trains an energy that learns the copy; estimate_ppl.py's joint PPL range, from LM
    samples, contains the exact joint PPL (log Z by summing P_LM exp(-E) over all V^2
    continuations) and lies far below the base LM's."""
    rng_ = random.Random(1)
    words = lambda n: ''.join(w + w for w in (''.join(rng_.choice('abcd') for _ in range(2))
                                              for _ in range(n)))
    # 99 characters + end-of-text: every document is 100 tokens, so 4-token windows stay aligned
    data_dir = prepare_corpus(tmp_path, {f'doc{i:03d}.txt': words(25)[:-1] for i in range(60)},
                              extra=['--val_frac', '0.1', '--test_frac', '0.1'])
    lm_path = str(tmp_path / 'unigram.pt')
    logp_uni = unigram_lm(data_dir, lm_path).double()
    for split in ('train', 'select'):
        negatives.main(['--lm', lm_path, '--split', split, '--out_dir', str(tmp_path / split),
                        '--prefix_len', '2', '--gen_len', '2', '--num_samples', '4', '--chunk', '256', *CPU])
    nce_train.main(['--lm', lm_path, '--negatives', str(tmp_path / 'train'),
                    '--held_out_negatives', str(tmp_path / 'select'), '--out_dir', str(tmp_path / 'bit'),
                    '--body', 'bit', '--n_layer', '2', '--n_head', '2', '--n_embd', '32',
                    '--batch_size', '32', '--max_iters', '300', '--eval_interval', '100', '--lr', '3e-3',
                    '--min_lr', '3e-4', '--warmup_iters', '20', *CPU])
    best = str(tmp_path / 'bit' / 'best.pt')
    out = estimate_ppl.main(['--lm', lm_path, '--energy', f'BIT={best}', '--split', 'test',
                             '--prefix_len', '2', '--gen_len', '2', '--num_prefixes', '0',
                             '--num_samples', '1024', '--calib_prefixes', '0',
                             '--out', str(tmp_path / 'ppl.json'), *CPU])
    rows = {r['model']: r for r in out['rows']}
    meta = load_meta(data_dir)
    test = load_split(data_dir, 'test', meta)
    x = window_tokens(test, windows(test, 2, 2), 4)
    V = meta['vocab_size']
    energy, _ = load_energy(best, lm_path)
    cont = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # all V^2 continuations
    with torch.no_grad():
        e_all = energy(torch.cat([x[:, None, :2].expand(-1, V * V, -1), cont.expand(len(x), -1, -1)],
                                 2).flatten(0, 1), 2)
        e_real = energy(x, 2).double()
    log_z = torch.logsumexp(logp_uni[cont].sum(1) - e_all.double().view(len(x), -1), 1)
    lp_real = logp_uni[x[:, 2:]].sum(1)
    exact_ppl = math.exp(-(lp_real - e_real - log_z).sum().item() / x[:, 2:].numel())
    base_ppl = math.exp(-lp_real.sum().item() / x[:, 2:].numel())
    assert abs(rows['BASE LM']['ppl'] - base_ppl) < 1e-4 * base_ppl
    joint = rows['JOINT BIT']
    assert joint['ppl_low'] * 0.99 <= exact_ppl <= joint['ppl_high'] * 1.01, (joint, exact_ppl)
    assert exact_ppl < 0.7 * base_ppl and joint['ppl_high'] < 0.7 * base_ppl, (exact_ppl, base_ppl)


def test_moment_matching_is_the_kl_projection():
    """Exact enumeration (vocabulary 3, length 3): the fitted p* meets the data's moments to 1e-9;
    it is the KL projection (no feasible perturbation lowers KL(p || P_LM), checked by brute
    force along random directions that keep the constraints and the normalisation); and the
    Pythagorean identity H(p_data, p*) = H(p_data, P_LM) - KL(p* || P_LM) holds exactly."""
    log_p, p_data, f = enumerable_problem()
    target = torch.einsum('bn,bnk->bk', p_data, f)  # E_data[f | x]
    mu, _ = metrics.fit_mu(target, f, log_p0=log_p)
    p_star = torch.softmax(log_p - f @ mu, -1)
    gap = torch.einsum('bn,bnk->k', p_star, f) / 2 - target.mean(0)
    assert gap.abs().max() < 1e-9
    kl = lambda p: (p * (p.log() - log_p)).sum(-1).mean()
    B, N, K = f.shape
    A = torch.cat([f.permute(2, 0, 1).reshape(K, -1), torch.kron(torch.eye(B), torch.ones(1, N)).double()])
    null = torch.linalg.svd(A).Vh[A.size(0):]  # directions that keep the moments and sum(p_x) = 1
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        d = (torch.randn(null.size(0), generator=g, dtype=torch.float64) @ null).view(B, N)
        for eps in (1e-3, -1e-3):
            assert kl(p_star + eps * d / d.abs().max() * p_star.min()) > kl(p_star)
    cross = lambda q: -(p_data * q).sum(-1).mean()
    assert cross(p_star.log()).item() == pytest.approx((cross(log_p) - kl(p_star)).item(), abs=1e-12)
    assert kl(p_star) > 0.05  # the constraints move p* well away from P_LM: the identity is not 0 = 0


def brute_proposal64(logits, top_k=None, top_p=None, temperature=1.0):
    """Reference for proposal_logprobs, row by row in float64 numpy: temperature, then the k
    largest logits, then the smallest set of most likely tokens whose mass reaches top_p."""
    logits = np.asarray(logits, dtype=np.float64).reshape(-1, np.shape(logits)[-1])
    out = np.full_like(logits, -np.inf)
    for r, row in enumerate(logits / temperature):
        order = np.argsort(-row)
        keep = order[:top_k] if top_k is not None else order
        p = np.exp(row[keep] - row[keep].max())
        p /= p.sum()
        if top_p is not None:
            n = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # first prefix whose mass >= top_p
            keep = keep[:min(n, len(keep))]
        z = row[keep].max() + np.log(np.exp(row[keep] - row[keep].max()).sum())
        out[r, keep] = row[keep] - z
    return out


def enumerate_continuations(model, prompt, n_new, V, top_k=None, top_p=None, temperature=1.0):
    """All V**n_new continuations, their exact float64 per-token log-probs under the LM and
    their exact probabilities under the proposal (top-k/top-p/temperature)."""
    conts = torch.tensor(list(itertools.product(range(V), repeat=n_new)))
    seqs = torch.cat([prompt.expand(len(conts), -1), conts], dim=1)
    P = prompt.size(1)
    logp = logprobs64(model, seqs)[:, P - 1:-1]  # positions predicting the new tokens
    tok_lp = logp.gather(-1, conts[..., None]).squeeze(-1)
    logq = torch.from_numpy(brute_proposal64(logp.numpy(), top_k, top_p, temperature)).view_as(logp) \
        if (top_k, top_p, temperature) != (None, None, 1.0) else logp
    q_seq = logq.gather(-1, conts[..., None]).squeeze(-1).sum(1).exp()
    return tok_lp, q_seq


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


def toy_lm(V=4):
    return tiny_gpt(vocab_size=V, block_size=8, std=0.5, seed=3)


def tv(p, q):
    return 0.5 * float((torch.as_tensor(p, dtype=torch.float64)
                        - torch.as_tensor(q, dtype=torch.float64)).abs().sum())

def decoding_case(alibi):
    """A tiny GPT with block_size 32 and 3 random rows that fill its block."""
    return (tiny_gpt(block_size=32, alibi=alibi),
            torch.randint(11, (3, 32), generator=torch.Generator().manual_seed(1)))

def softplus64(x):
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def unigram_lm(data_dir, path):
    """Save an LM checkpoint that ignores its context: every next-token distribution is the
    unigram distribution of the train split (blocks are identities, the final LayerNorm outputs
    a constant that the tied head maps to the unigram log-probs). Returns those log-probs."""
    meta = load_meta(data_dir)
    V = meta['vocab_size']
    counts = np.bincount(np.asarray(load_split(data_dir, 'train', meta)), minlength=V)
    logp = torch.from_numpy(np.log(counts / counts.sum())).float()
    cfg = GPTConfig(block_size=16, vocab_size=V, n_layer=1, n_head=1, n_embd=8, bias=True)
    torch.manual_seed(0)
    lm = GPT(cfg)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if 'c_proj' in name:
                p.zero_()
        lm.transformer.ln_f.weight.zero_()
        lm.transformer.ln_f.bias.zero_()
        lm.transformer.ln_f.bias[0] = 1.0
        lm.transformer.wte.weight[:, 0] = logp
    save_checkpoint(dict(kind='lm', model=lm.state_dict(), config=asdict(cfg),
                         meta=dict(meta, data_dir=data_dir)), path)
    return logp


def empirical(tokens, V):
    L = tokens.size(1)
    code = (tokens * (V ** torch.arange(L - 1, -1, -1))).sum(1)
    return torch.bincount(code, minlength=V ** L).double() / tokens.size(0)


# =============================================================================
# ==== estimation: log Z bounds (Eq. 4) and their calibration, joint and per-step PPL (Eq. 5)
#      vs exact enumeration (estimate_ppl.py's command line: tests/test_estimation.py) ====

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


@pytest.mark.parametrize('n', [2, 3, 9])
def test_leave_one_out_lse_brute_force(n):
    lw = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    got = leave_one_out_lse(lw)
    assert got.shape == lw.shape
    for idx in itertools.product(range(3), range(5)):
        a = lw[idx].numpy()
        ref = [lme(np.delete(a, i)) + math.log(n - 1) for i in range(n)]
        assert np.abs(got[idx].numpy() - ref).max() < 1e-12


def test_leave_one_out_lse_dominant_weight_e50():
    """One weight dominating by e^50 (and by e^10000, below): what is left after removing it is exact."""
    got = leave_one_out_lse(torch.tensor([50.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert (abs(got[0].item() - math.log(3)) < 1e-12
            and abs(got[1].item() - (50 + math.log1p(2 * math.exp(-50)))) < 1e-12)


def test_leave_one_out_lse_dominant_weight_e10000():
    got = leave_one_out_lse(torch.tensor([0.0, -1e4, -1e4], dtype=torch.float64))
    assert abs(got[0].item() - (-1e4 + math.log(2))) < 1e-9 and got[1].item() == got[2].item() == 0.0


def test_logz_bounds_closed_form_n2():
    """n = 2: T_1 without x_i is log w_j, so upper = 3 T_2 - 2 mean(log w)."""
    lw = torch.tensor([[0.3, -1.2], [5.0, 5.0]], dtype=torch.float64)
    lo, hi = logz_bounds(lw)
    T2 = torch.log((lw.exp()).mean(1))
    assert (lo - T2).abs().max() < 1e-14 and (hi - (3 * T2 - 2 * lw.mean(1))).abs().max() < 1e-13


def test_logz_bounds_equal_weights():
    """Equal weights: both bounds are exact."""
    lo, hi = logz_bounds(torch.full((7,), 3.25))
    assert abs(lo.item() - 3.25) < 1e-12 and abs(hi.item() - 3.25) < 1e-12


@pytest.mark.parametrize('lw', [[50.0, 0.0, 0.0, 0.0], [0.0] + [-1e4] * 4, [1e4, 0.0, -3.0, 2.0, 1.0]],
                         ids=['e50', 'e10000_below', 'e10000_above'])
def test_logz_bounds_dominant_weight(lw):
    """One dominant weight, where log(S - w_i) cancels catastrophically."""
    lo, hi = logz_bounds(torch.tensor(lw, dtype=torch.float64))
    ref_lo, ref_hi = ref_bounds(lw)
    assert math.isfinite(lo.item()) and math.isfinite(hi.item())
    assert (abs(lo.item() - ref_lo) < 1e-9 * max(1, abs(ref_lo))
            and abs(hi.item() - ref_hi) < 1e-9 * max(1, abs(ref_hi)))
    # the naive formula would be wrong here
    with np.errstate(divide='ignore', over='ignore', invalid='ignore'):
        w = np.exp(np.array(lw))
        naive_loo = np.log(w.sum() - w) - math.log(len(lw) - 1)
    assert not np.isfinite(naive_loo[0]) or abs(naive_loo[0] - lme(np.delete(lw, 0))) > 1


@pytest.mark.parametrize('n', [0, 1])
def test_logz_bounds_too_few_samples(n):
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
        (m_lo, m_hi), (se_lo, se_hi) = ((lo.mean().item(), hi.mean().item()),
                                        (lo.std().item() / R ** .5, hi.std().item() / R ** .5))
        assert m_lo + 4 * se_lo < truth < m_hi - 4 * se_hi, (n, m_lo, truth, m_hi)
        bias[n] = (truth - m_lo, m_hi - truth, se_lo, se_hi)
        if n >= 16:  # first-order theory: both biases ~ c / n
            assert abs((truth - m_lo) - c / n) < 4 * se_lo + 0.25 * c / n, (n, truth - m_lo, c / n)
            assert abs((m_hi - truth) - c / n) < 4 * se_hi + 0.25 * c / n, (n, m_hi - truth, c / n)
    for a, b in ((4, 16), (16, 64)):  # both gaps shrink as n grows
        for k in (0, 1):
            assert bias[b][k] + 4 * bias[b][k + 2] < bias[a][k] - 4 * bias[a][k + 2], (a, b, k, bias)


def test_kl_to_lm_closed_form():
    """KL(p* || P_LM) from a pool that lists each continuation as often as P_LM draws it (uniform
    P_LM over 4 continuations, each once) equals sum p* log(p*/P_LM) computed directly."""
    e = torch.tensor([[0.3, -1.0, 2.0, 0.5]], dtype=torch.float64)
    p_star = torch.softmax(-e, -1)
    ref = (p_star * (p_star / 0.25).log()).sum()
    assert kl_to_lm(-e).item() == pytest.approx(ref.item(), abs=1e-12)
    assert kl_to_lm(torch.zeros(1, 7)).item() == pytest.approx(0, abs=1e-12)


def test_mc_se_matches_spread_of_T_n():
    """mc_se (delta method) against the spread of T_n over many independent draws of n log-normal
    weights, and against the closed form sqrt((e^{sigma^2} - 1) / n) of its large-n limit."""
    sigma, n, R = 0.5, 256, 4000
    lw = sigma * torch.randn(R, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    T_n = logz_bounds(lw)[0]
    se = mc_se(lw)
    closed = math.sqrt((math.exp(sigma ** 2) - 1) / n)
    assert abs(se.mean().item() / T_n.std().item() - 1) < 0.05, (se.mean().item(), T_n.std().item())
    assert abs(se.mean().item() / closed - 1) < 0.03
    assert torch.allclose(mc_se(lw + 7.0), se)  # the same for any scale of the weights


def test_calibrate_matches_exact_bias():
    """calibrate() measures the bias of the n-sample bounds from many samples; on weights with
    three possible values the exact expectation of each bound is a finite sum over the
    multinomial counts of n draws, and the two agree (as does the fraction of bracketing ranges)."""
    log_vals, p, n, L = (torch.tensor([0.0, -1.5, 2.5], dtype=torch.float64),
                         torch.tensor([0.6, 0.3, 0.1]), 4, 2)
    log_z = torch.logsumexp(log_vals + p.double().log(), 0).item()
    exact = dict(lo=0.0, hi=0.0, bracketed=0.0)
    for c in itertools.product(range(n + 1), repeat=3):
        if sum(c) != n:
            continue
        prob = (math.factorial(n) / math.prod(math.factorial(k) for k in c)
                * math.prod(float(q) ** k for q, k in zip(p, c)))
        lo, hi = (t.item() for t in logz_bounds(log_vals.repeat_interleave(torch.tensor(c))))
        exact['lo'] += prob * lo
        exact['hi'] += prob * hi
        exact['bracketed'] += prob * (lo <= log_z <= hi)
    B, N = 2, 200_000
    draws, ref = (torch.multinomial(p, B * N, replacement=True, generator=torch.Generator().manual_seed(s))
                  for s in (0, 1))
    c = calibrate(log_vals[draws].view(1, B, N), log_vals[ref].view(1, B, N), n, L)
    assert exact['lo'] - log_z < -0.1 and abs(exact['hi'] - log_z) > 0.05  # both biased at this small n
    assert abs(c['bias_lower'][0] - (exact['lo'] - log_z) / L) < 0.005
    assert abs(c['bias_upper'][0] - (exact['hi'] - log_z) / L) < 0.005
    assert abs(c['bracketed'][0] - exact['bracketed']) < 0.01 and c['reference_width'][0] < 0.01
    for side in ('lower', 'upper'):  # the per-prefix biases (claims.py's calibration claim) average to it
        per = c[f'bias_{side}_per_prefix'][0]
        assert len(per) == B and abs(sum(per) / B - c[f'bias_{side}'][0]) < 1e-12
        assert all(abs(b - (exact['lo' if side == 'lower' else 'hi'] - log_z) / L) < 0.01 for b in per)


def test_sample_log_weights_matches_per_chunk_reference():
    """sample_log_weights (the prompts through the LM once, energies in blocks) against drawing
    the samples with generate and scoring every sequence on its own: same log-weights from the same
    generator, for several max_rows (chunks of samples) and a block that splits prefixes."""
    lm = tiny_gpt(vocab_size=13, block_size=24, seed=1)
    torch.manual_seed(3)
    energy = Energy(GPTConfig(block_size=24, vocab_size=14, n_layer=1, n_head=2, n_embd=16, causal=False,
                              alibi=True)).eval()
    with torch.no_grad():
        energy.head.weight.normal_(0, 1.0)
    B, P, L, n = 3, 8, 5, 6
    prefixes = torch.randint(13, (B, P), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for max_rows in (6, 7, 1000):  # 2 samples per prefix per chunk, 2 again, all in one chunk
            tokens, _ = lm.generate(prefixes, L, num_samples=n, generator=torch.Generator().manual_seed(9),
                                    max_rows=max_rows)
            x = torch.cat([prefixes[:, None].expand(-1, n, -1), tokens], 2)
            ref = torch.tensor([[-energy(x[b, i:i + 1], P).item() for i in range(n)] for b in range(B)],
                               dtype=torch.float64)
            got = estimate_ppl.sample_log_weights(lm, [energy, energy], prefixes, L, n,
                                                  FP32, torch.Generator().manual_seed(9),
                                                  max_rows=max_rows)
            assert got.shape == (2, B, n)
            assert (got - ref).abs().max().item() < 1e-5
        blocks = score(energy, x.flatten(0, 1), P, contextlib.nullcontext(), max_tokens=2 * (P + L))
        assert (-blocks.view(B, n) - ref).abs().max().item() < 1e-5
        assert ref.std() > 0.1  # the energies differ, so a mix-up of rows would be seen


def toy_split(V, P, L, n_windows, seed=0):
    """A token stream of n_windows back-to-back windows with no end-of-text token (id V)."""
    data = torch.randint(V, (n_windows * (P + L),),
                         generator=torch.Generator().manual_seed(seed)).numpy().astype(np.uint16)
    offsets = windows(data, P, L)
    assert len(offsets) == n_windows
    return data, offsets


def test_summarize_closed_form_and_exact_joint_ppl():
    V, L, P = 4, 3, 2
    lm, e = toy_lm(V), rand_energy(V)
    data, offsets = toy_split(V, P, L, 5)
    x = window_tokens(data, offsets, P + L)
    exact_joint_lp, lp_ref, e_ref, logz_ref = [], [], [], []
    for b in range(len(x)):
        conts, lp, E, logz = enumerate_joint(lm, e, x[b, :P], L, V, P)
        i = int((conts == x[b, P:]).all(1).nonzero())
        joint = lp - E
        joint_lp = joint[i] - torch.logsumexp(joint, 0)  # log of the normalised joint table at x_b
        assert abs((joint - torch.logsumexp(joint, 0)).exp().sum().item() - 1) < 1e-12
        exact_joint_lp.append(joint_lp.item())
        lp_ref.append(lp[i].item())
        e_ref.append(E[i].item())
        logz_ref.append(logz.item())
    logz_ref, shift = np.array(logz_ref), np.arange(len(x))
    cols = dict(lm_logp=np.array(lp_ref), extra_logp={'LM2': np.array(lp_ref) - 0.25},
                energy={'E': np.array(e_ref)},
                logz={'E': {7: dict(low=logz_ref, high=logz_ref),
                            9: dict(low=logz_ref - 0.1 * shift, high=logz_ref + 0.2)}})
    N = len(x) * L
    exact_ppl = math.exp(-sum(exact_joint_lp) / N)
    rows = summarize(cols, N, 7)
    assert [r['model'] for r in rows] == ['BASE LM', 'LM2', 'JOINT E']
    assert abs(rows[0]['ppl'] - math.exp(-sum(lp_ref) / N)) < 1e-12 * rows[0]['ppl']
    assert abs(rows[1]['ppl'] - math.exp(-(sum(lp_ref) - 0.25 * len(x)) / N)) < 1e-12 * rows[1]['ppl']
    assert (abs(rows[2]['ppl_low'] - exact_ppl) < 1e-9 * exact_ppl
            and abs(rows[2]['ppl_high'] - exact_ppl) < 1e-9 * exact_ppl)
    # the joint model is not the LM here
    assert np.abs(np.array(exact_joint_lp) - np.array(lp_ref)).max() > 0.3
    # the range: the low end of the PPL comes from the low end of log Z
    rows = summarize(dict(cols, extra_logp={}), N, 9, num_chars=40)
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
    cols = evaluate_prefixes(lm, {'E': e}, {'LM2': lm2}, data, offsets, args, FP32, 'cpu', 0, 1, 'test')
    assert len(cols['lm_logp']) == 5
    lp_ref = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1).sum(1)
    lp2_ref = logprobs64(lm2, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1).sum(1)
    E_ref = energies(e, x, P)
    exact = torch.stack([enumerate_joint(lm, e, x[b, :P], L, V, P)[3] for b in range(5)])
    assert sorted(cols['logz']['E']) == [4, 4096]
    kls = []
    for b in range(5):  # log Z by enumeration of what was seen, and KL(P_joint || P_LM), against exact ones
        _, lp_all, E_all, logz = enumerate_joint(lm, e, x[b, :P], L, V, P)
        kls.append((torch.exp(lp_all - E_all - logz) * (-E_all - logz)).sum().item())
        assert abs(cols['kl']['E'][b] - kls[-1]) < 0.06, (b, cols['kl']['E'][b], kls[-1])  # 4,096 samples
        enum = {k: float(v[b]) for k, v in cols['enum']['E'].items()}
        assert enum['sure'] <= logz.item() + 1e-6 and abs(enum['estimate'] - logz.item()) < 0.02, (b, enum)
    for b in range(5):
        assert (abs(cols['lm_logp'][b] - lp_ref[b].item()) < 1e-4
                and abs(cols['extra_logp']['LM2'][b] - lp2_ref[b].item()) < 1e-4)
        # float32 energies
        assert abs(cols['energy']['E'][b] - E_ref[b].item()) < 1e-6 * max(1, abs(E_ref[b].item()))
        for n in (4, 4096):
            assert cols['logz']['E'][n]['low'][b] <= cols['logz']['E'][n]['high'][b] + 1e-12
        lo, hi = cols['logz']['E'][4096]['low'][b], cols['logz']['E'][4096]['high'][b]
        assert abs(lo - exact[b].item()) < 0.15 and abs(hi - exact[b].item()) < 0.15
    exact_lp = lp_ref - E_ref - exact
    N = 5 * L
    exact_ppl = math.exp(-exact_lp.sum().item() / N)
    row = summarize(cols, N, 4096)[2]
    assert row['ppl_low'] <= row['ppl_high']
    assert abs(row['predicted_gain'] - np.mean(kls) / L) < 0.02  # the Pythagorean prediction, per token
    for k in ('ppl_low', 'ppl_high'):
        assert abs(math.log(row[k]) - math.log(exact_ppl)) < 0.03, (k, row[k], exact_ppl)


def test_enumerated_knows_the_real_continuation():
    """estimate_ppl.enumerated, the enum columns of Table 1's records: logz_enumerate with the real
    continuation known and the first --num_samples LM samples drawn, against ref_enumerate (its
    definition in float64 loops) on hand-made samples that repeat the real continuation and one another."""
    V, P, L = 4, 2, 3
    lm, e = toy_lm(V), rand_energy(V)
    x = torch.tensor([[0, 1, 2, 3, 1], [3, 3, 0, 0, 2]])
    samples = torch.tensor([[[2, 3, 1], [0, 0, 0], [2, 3, 1], [1, 2, 3]],
                            [[0, 0, 2], [1, 1, 1], [1, 1, 1], [3, 2, 1]]])  # (B, 4, L); row 0: the real twice
    with torch.no_grad():
        lm_logp = lm.sequence_logprob(x, P).double()
        e_real = {'E': e(x, P)}
        seqs = [torch.cat([x[:, :P], samples[:, j]], 1) for j in range(4)]
        samples_logp = torch.stack([lm.sequence_logprob(q, P).double() for q in seqs], 1)
        log_w = -torch.stack([e(q, P) for q in seqs], 1)[None]  # (energies, B, 4)
    args = types.SimpleNamespace(num_samples=3)  # the first 3 of the 4 samples
    got = estimate_ppl.enumerated(lm, {'E': e}, x, P, lm_logp, e_real, samples, samples_logp, log_w, args,
                                  FP32)
    for b in range(2):
        conts = [tuple(x[b, P:].tolist())] + [tuple(c) for c in samples[b, :3].tolist()]
        log_p = [lm_logp[b].item()] + samples_logp[b, :3].tolist()
        lw = [-e_real['E'][b].item()] + log_w[0, b, :3].double().tolist()
        estimate, sure = ref_enumerate(conts, log_p, lw, 1)
        assert abs(got['E']['estimate'][b].item() - estimate) < 1e-9
        assert abs(got['E']['sure'][b].item() - sure) < 1e-9


def ref_enumerate(conts, log_p, log_w, known):
    """logz_enumerate by its definition, in float64 Python loops: the mean over the samples i of
    A(S_-i) + [x_i not in S_-i] w_i, S_-i the distinct continuations among the known ones and the
    samples other than i; and log A(S) of all of them. conts: hashable continuations."""
    n = len(conts) - known
    A = lambda idx: sum(math.exp(log_p[j] + log_w[j]) for j in {conts[j]: j for j in idx}.values())
    terms = []
    for i in range(known, len(conts)):
        rest = [j for j in range(len(conts)) if j != i]
        terms.append(A(rest) + (math.exp(log_w[i]) if conts[i] not in {conts[j] for j in rest} else 0.0))
    return math.log(sum(terms) / n), math.log(A(range(len(conts))))


@pytest.mark.parametrize('known', [0, 1, 3])
def test_logz_enumerate_brute_force(known):
    g = torch.Generator().manual_seed(known)
    x = torch.randint(3, (4, 12, 2), generator=g)  # 9 continuations: many repeats among 12
    code = x[..., 0] * 3 + x[..., 1]  # each continuation's own P_LM and weight
    log_p = (-torch.randn(9, generator=g, dtype=torch.float64).abs() - 1)[code]  # each P_LM below 1/e
    log_w = (torch.randn(9, generator=g, dtype=torch.float64) * 3)[code]
    z = logz_enumerate(x, log_p, log_w, known=known)
    for b in range(4):
        conts = [tuple(c) for c in x[b].tolist()]
        est, sure = ref_enumerate(conts, log_p[b].tolist(), log_w[b].tolist(), known)
        assert abs(z['estimate'][b].item() - est) < 1e-12 and abs(z['sure'][b].item() - sure) < 1e-12


def test_kish_ess_and_diagnostics_closed_form():
    """Kish's ESS (sum w)^2 / sum w^2: n for equal weights, (1 + r)^2 / (1 + r^2) for two weights in ratio
    r, near 1 for one dominant weight; flagged below MIN_ESS, or where Eq. 4's upper end is below a sure
    lower bound of log Z (whatever the ESS)."""
    lw = torch.zeros(3, 16, dtype=torch.float64)
    lw[1, 0] = 30.0  # one weight e^30 among ones
    lw[2, :8] = math.log(3.0)
    ess = kish_ess(lw)
    assert abs(ess[0].item() - 16) < 1e-12 and abs(ess[1].item() - 1) < 1e-10
    assert abs(ess[2].item() - (8 * 3 + 8) ** 2 / (8 * 9 + 8)) < 1e-12
    two = torch.tensor([0.0, math.log(0.25)], dtype=torch.float64)
    assert abs(kish_ess(two).item() - 1.25 ** 2 / (1 + 0.25 ** 2)) < 1e-12
    d = logz_diagnostics(lw)
    assert d['flagged'].tolist() == [False, True, False] and 16 >= MIN_ESS > 1
    assert abs(d['max_share'][0].item() - 1 / 16) < 1e-12 and d['max_share'][1].item() > 1 - 1e-9
    upper = logz_bounds(lw)[1]
    sure = torch.stack([upper[0] + 1.0, upper[1], upper[2] - 1.0])  # above, at, below the upper end
    assert logz_diagnostics(lw, sure)['flagged'].tolist() == [True, True, False]


class SpikeEnergy(torch.nn.Module):
    """A tiny random energy, set to -depth on one continuation: sharp where that continuation is rare
    under the LM, as the addition energy is on a correct sum the LM seldom writes."""

    def __init__(self, base, target, depth):
        super().__init__()
        self.base, self.target, self.depth = base, target, depth

    def forward(self, x, prefix_len):
        hit = (x[:, prefix_len:] == self.target).all(1)
        return torch.where(hit, -self.depth, self.base(x, prefix_len))


def test_sharp_energy_eq4_fails_and_enumeration_holds():
    """Where exp(-E) is e^10 on a continuation P_LM gives < 1% (e^-6 elsewhere), Eq. 4 from n = 8 misses it:
    both ends far below log Z, and flagged; logz_enumerate with that continuation known (the real one,
    or the LM's beam) is within 1e-3 nats of the exact log Z, and its sure part is below it."""
    V, L, P = 4, 3, 2
    lm, prefixes = toy_lm(V), torch.tensor([[0, 0], [1, 2], [3, 1]])
    conts, lp, _, _ = enumerate_joint(lm, rand_energy(V), prefixes[0], L, V, P)
    target = conts[(lp - math.log(2e-3)).abs().argmin()]  # one the LM gives ~0.2%
    e = SpikeEnergy(rand_energy(V), target, 10.0)
    exact = torch.stack([enumerate_joint(lm, e, p, L, V, P)[3] for p in prefixes])
    assert 1e-3 < lp[(conts == target).all(1)].exp() < 1e-2
    log_w, x, x_logp = sample_log_weights(lm, [e], prefixes, L, 8 * 64, FP32,
                                          torch.Generator().manual_seed(0), return_samples=True)
    log_w = log_w[0].view(3, 64, 8)[0]  # 64 draws of n = 8 for the first prefix
    x, x_logp = x[0].view(64, 8, L), x_logp[0].view(64, 8)
    lo, hi = logz_bounds(log_w)
    assert (hi < exact[0] - 3).float().mean() > 0.9  # Eq. 4's "upper" end, 3 nats and more below log Z
    known = target.expand(64, 1, L)
    with torch.no_grad():
        known_lp = lm.sequence_logprob(torch.cat([prefixes[0], target])[None], P).double().expand(64, 1)
    known_w = -energies(e, torch.cat([prefixes[0], target])[None], P).expand(64, 1)
    z = logz_enumerate(torch.cat([known, x], 1), torch.cat([known_lp, x_logp], 1),
                       torch.cat([known_w, log_w], 1), known=1)
    assert ((z['estimate'] - exact[0]).abs() < 1e-3).all()
    assert (z['sure'] <= exact[0] + 1e-5).all()  # the samples' log P_LM in float32
    assert logz_diagnostics(log_w, z['sure'])['flagged'].float().mean() > 0.9
    # a flat energy (E constant): nothing flagged, every estimate exact
    flat = torch.full((64, 8), -0.7, dtype=torch.float64)
    assert not logz_diagnostics(flat)['flagged'].any()
    zf = logz_enumerate(x, x_logp, flat)['estimate'].exp()  # unbiased, not exact: Eq. 4 is exact here
    assert (zf.mean() - math.exp(-0.7)).abs() < 4 * zf.std() / 8 and zf.std() > 0


def test_beam_search_finds_the_most_likely_continuations():
    """GPT.beam_search with a beam as wide as every continuation is the exact top list; narrower,
    its log-probs are those of its continuations, in order."""
    V, L, P = 4, 3, 2
    lm = toy_lm(V)
    prefixes = torch.tensor([[0, 0], [1, 2]])
    tokens, logp = lm.beam_search(prefixes, L, V ** L)
    assert tokens.shape == (2, V ** L, L) and logp.dtype == torch.float64
    for b in range(2):
        conts, lp, _, _ = enumerate_joint(lm, rand_energy(V), prefixes[b], L, V, P)
        assert torch.allclose(logp[b], lp.sort(descending=True).values, atol=1e-6)
    tokens, logp = lm.beam_search(prefixes, L, 3)
    seqs = torch.cat([prefixes[:, None].expand(-1, 3, -1), tokens], 2).flatten(0, 1)
    assert torch.allclose(lm.sequence_logprob(seqs, P).double().view(2, 3), logp, atol=1e-5)
    assert (logp[:, :-1] >= logp[:, 1:]).all()


@pytest.mark.parametrize('alibi', [False, True])
def test_beam_search_plain_and_cached_agree(alibi, monkeypatch):
    """GPT.beam_search (each prompt run once, each beam's new tokens cached, its cache rows copied
    from its parent's) finds beam_search_plain's beams with its log-probs, in float64, for a GPT and
    a RALM, beams narrower and wider than the vocabulary. A beam that reads another beam's cache is
    caught (a mutation: each prompt's parent rows taken in sorted order)."""
    model = copy.deepcopy(decoding_case(alibi)[0]).double()
    ralm = RALM(model.config, copy.deepcopy(model)).double().eval()
    prompts = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))
    for lm, width in ((model, 1), (model, 4), (model, 30), (ralm, 4)):
        plain, cached = lm.beam_search_plain(prompts, 6, width), lm.beam_search(prompts, 6, width)
        assert torch.equal(plain[0], cached[0]), width
        assert plain[1].dtype == torch.float64 and torch.allclose(plain[1], cached[1], atol=1e-10, rtol=0)
    follow = model_module.follow_parents
    monkeypatch.setattr(model_module, 'follow_parents', lambda cache, rows: follow(cache, rows.sort().values))
    assert not torch.equal(model.beam_search(prompts, 6, 4)[0], model.beam_search_plain(prompts, 6, 4)[0])


@pytest.mark.parametrize('pool', ['continuation', 'all'])
def test_last_step_logz_exact(pool):
    V, P, L = 4, 2, 3
    lm = toy_lm(V)
    x = torch.randint(V, (4, P + L), generator=torch.Generator().manual_seed(4))
    e = rand_energy(V, pool=pool)
    got = last_step_logz(lm, e, x, P, FP32)
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


def test_exact_step_logz_reference():
    """The reference itself (no rebm code but the LM and the energy): Eq. 5 with exact Z, each
    step's distribution sums to 1 over the vocabulary, and log Z(prefix) is the log-sum over all
    V^L continuations c of P_LM(c) exp(-E(c)), each sequence scored on its own. (That the steps
    then telescope to log P_LM(x) - E(x) - log Z(prefix) is an identity, not checked.)"""
    V, P, L = 4, 2, 3
    lm, e = toy_lm(V), rand_energy(V)
    x = torch.tensor([[0, 0, 1, 3, 2], [3, 1, 0, 0, 1]])
    Z = exact_step_logz(lm, e, x, P, V)
    for b in range(2):
        for k in range(L):
            step_lp = logprobs64(lm, x[b:b + 1, :P + k])[0, -1]
            z_next = torch.tensor([enumerate_joint(lm, e, torch.cat([x[b, :P + k], torch.tensor([v])]),
                                                   L - k - 1, V, P)[3].item()
                                   for v in range(V)], dtype=torch.float64)
            assert abs((step_lp + z_next - Z[b, k]).exp().sum().item() - 1) < 1e-5  # float32 energies
        seqs = torch.tensor([x[b, :P].tolist() + list(c) for c in itertools.product(range(V), repeat=L)])
        log_joint = [logprobs64(lm, s[None])[0, P - 1:-1].gather(-1, s[P:, None]).sum().item()
                     - energies(e, s[None], P)[0].item() for s in seqs]
        assert abs(torch.tensor(log_joint, dtype=torch.float64).logsumexp(0).item() - Z[b, 0].item()) < 1e-5


def per_step_case():
    """A toy LM and energy, 4 windows of a random split and per_step_report's arguments."""
    V, P, L = 4, 2, 3
    data, offsets = toy_split(V, P, L, 4, seed=2)
    args = types.SimpleNamespace(prefix_len=P, gen_len=L, step_prefixes=3, step_samples=4000, seed=1,
                                 max_rows=8192, last_step_samples=20000)
    return toy_lm(V), rand_energy(V), data, offsets, args


def test_per_step_report_exact():
    V, P, L = 4, 2, 3
    lm, e, data, offsets, args = per_step_case()
    rep = per_step_report(lm, e, data, offsets, args, FP32, 'cpu', 'test')
    x = window_tokens(data, offsets[[0, 2, 3]], P + L)  # 3 evenly spaced of the 4 windows
    Z = exact_step_logz(lm, e, x, P, V)
    lp = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1)
    exact_step = lp + Z[:, 1:] - Z[:, :-1]  # (3, L) exact log P(x_t | x_<t) of the joint model
    assert rep['num_prefixes'] == 3 and rep['position'] == [1, 2, 3] and rep['step_samples'] == 4000
    assert np.allclose(rep['base_ppl'], torch.exp(-lp.mean(0)).numpy(), rtol=1e-5)
    assert (abs(rep['last_step_base_ppl'] - math.exp(-lp[:, -1].mean().item()))
            < 1e-5 * rep['last_step_base_ppl'])
    assert (abs(rep['last_step_exact_ppl'] - math.exp(-exact_step[:, -1].mean().item()))
            < 1e-5 * rep['last_step_exact_ppl'])
    # the last step estimated again from many samples is within a few Monte-Carlo SE of the exact
    # value (a draw's range need not contain it: its noise can exceed the range's width)
    assert rep['last_step_ppl_low'] <= rep['last_step_ppl_high']
    assert abs(math.log(rep['last_step_ppl_high'] / rep['last_step_ppl_low'])) < 0.01
    gap = math.log(math.sqrt(rep['last_step_ppl_low'] * rep['last_step_ppl_high'])
                   / rep['last_step_exact_ppl'])
    assert (0 < rep['last_step_mc_se'] < 0.01
            and abs(gap) < 4 * rep['last_step_mc_se']), (gap, rep['last_step_mc_se'])
    # per prefix, the last step's exact gain over the LM (claims.py's C4): -E(x) - log Z(x_<T)
    assert np.allclose(rep['per_prefix_last_step_gain_exact'], (Z[:, L] - Z[:, L - 1]).numpy(), atol=1e-5)
    exact_ppl = torch.exp(-exact_step.mean(0)).numpy()
    # the joint model differs from the LM at the last step
    assert abs(exact_ppl[-1] - rep['base_ppl'][-1]) > 0.05
    for t in range(L):
        assert rep['joint_ppl_low'][t] <= rep['joint_ppl_high'][t]
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert abs(math.log(rep[k][t]) - math.log(exact_ppl[t])) < 0.05, (k, t, rep[k][t], exact_ppl[t])


def test_per_step_report_by_segments_exact():
    """--step_every 2 (Fig. 1 on a coarser grid: positions 0, 2, 3 of L = 3): each segment's base and
    joint PPL per token, and the gain over the LM, against the exact per-step log-probs summed over
    the segment's tokens and divided by its width."""
    V, P, L = 4, 2, 3
    lm, e, data, offsets, args = per_step_case()
    args.step_every = 2
    rep = per_step_report(lm, e, data, offsets, args, FP32, 'cpu', 'test')
    x = window_tokens(data, offsets[[0, 2, 3]], P + L)
    Z = exact_step_logz(lm, e, x, P, V)
    lp = logprobs64(lm, x)[:, P - 1:-1].gather(-1, x[:, P:, None]).squeeze(-1)
    segments = [(0, 2), (2, 3)]
    assert rep['position'] == [2, 3]
    for s, (k1, k2) in enumerate(segments):
        width, seg_lp = k2 - k1, lp[:, k1:k2].sum(1)
        exact = seg_lp + Z[:, k2] - Z[:, k1]  # the segment's exact joint log-prob
        assert abs(rep['base_ppl'][s] - math.exp(-(seg_lp / width).mean().item())) < 1e-5 * rep['base_ppl'][s]
        for k in ('joint_ppl_low', 'joint_ppl_high'):
            assert abs(math.log(rep[k][s]) + (exact / width).mean().item()) < 0.05, (k, s)
        assert abs(rep['gain'][s] - ((Z[:, k2] - Z[:, k1]) / width).mean().item()) < 0.05


def test_per_step_report_combines_the_bounds():
    """With few samples the range is wide; its ends combine the bounds of Z as Eq. 5 needs: the
    low end of log P(x_t | x_<t) is the low numerator Z(x_<=t) over the high denominator Z(x_<t)."""
    P, L = 2, 3
    lm, e, data, offsets, args = per_step_case()
    x = window_tokens(data, offsets, P + L)  # all 4 windows: 4 prefixes, 3 positions, axes apart
    args.step_samples, args.step_prefixes = 4, 4
    rep = per_step_report(lm, e, data, offsets, args, FP32, 'cpu', 'test')
    lp, _, lo, hi = per_step(lm, e, x, P, 4, FP32, rng(args.seed, 'per_step', 'test', 0), args.max_rows)[:4]
    assert (hi - lo).max() > 0.1  # the two bounds differ: mixing them up would show
    mid = (lo + hi) / 2
    gain = mid[:, 1:] - mid[:, :-1]  # per prefix and position, at the bounds' midpoint
    assert np.allclose(rep['gain'], gain.mean(0).numpy(), rtol=1e-12)
    assert np.allclose(rep['gain_se'], (gain.std(0) / 2).numpy(), rtol=1e-12)  # SE over the 4 prefixes
    assert np.allclose(rep['joint_ppl_high'], torch.exp(-(lp + lo[:, 1:] - hi[:, :-1]).mean(0)).numpy(),
                       rtol=1e-12)
    assert np.allclose(rep['joint_ppl_low'], torch.exp(-(lp + hi[:, 1:] - lo[:, :-1]).mean(0)).numpy(),
                       rtol=1e-12)
    # per prefix, the gain's range over the LM (claims.py's C4): low numerator over high denominator
    assert np.allclose(rep['per_prefix_gain_low'], (lo[:, 1:] - hi[:, :-1]).numpy(), rtol=0, atol=1e-12)
    assert np.allclose(rep['per_prefix_gain_high'], (hi[:, 1:] - lo[:, :-1]).numpy(), rtol=0, atol=1e-12)
    assert np.all(np.array(rep['per_prefix_gain_low']) <= np.array(rep['per_prefix_gain'])) and np.all(
        np.array(rep['per_prefix_gain']) <= np.array(rep['per_prefix_gain_high']))

"""Sampling (sample.py, energy.joint_sample): Algorithm 1's resampling frequencies and ESS, the joint
distribution exactly, Table 3, top-k auto-regressive sampling, the analyses, the command line.
The tests to read first are in test_all.py."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

from data import load_meta, load_split, window_tokens, windows
from data.tokenizer import EOT, load_tokenizer
from energy import Energy, joint_sample, load_energy
from model import GPT, GPTConfig, load_lm
from plumbing import rng
from sample import next_token_table, topk_autoregressive, unique_ngrams
import sample

from test_all import empirical, energies, enumerate_continuations, enumerate_joint, toy_lm, tv
from tests.common import BIGRAM, EVAL_L, EVAL_P, FP32, logprobs64, rand_energy, tiny_gpt


# =============================================================================
# ==== sampling: Algorithm 1, Table 3, top-k auto-regressive, analyses (sample.py) ====

class ListLM:
    """A stand-in LM whose generate() hands out one-token candidates 0, 1, 2, ... in order, the same
    for every prompt row, with given log P_LM and log q per candidate: the candidate set of
    joint_sample is then fixed and known."""

    def __init__(self, logp, logq):
        self.logp, self.logq, self.next = torch.as_tensor(logp).float(), torch.as_tensor(logq).float(), 0

    def generate(self, prefix, gen_len, num_samples=1, top_k=None, return_proposal=False, generator=None,
                 max_rows=None):
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


CHI2_999 = {9: 27.877}  # chi-square critical value at p = 0.001, by degrees of freedom


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
                       correct_proposal=correct_proposal, generator=torch.Generator().manual_seed(1),
                       max_rows=3 * B)
    assert lm.next == K  # all K candidates drawn, in chunks
    log_w = -E + (logp.double() - logq.double() if correct_proposal else 0)
    p = torch.softmax(log_w, 0).numpy()
    counts = np.bincount(out['joint'][:, 0].numpy(), minlength=K)
    stat = chi_square(counts, p)
    assert stat < CHI2_999[K - 1], (stat, counts, p * B)
    for wrong in (torch.softmax(-log_w, 0), torch.full((K,), 1.0 / K),
                  torch.softmax(-E if correct_proposal else log_w + logp.double(), 0)):
        assert chi_square(counts, wrong.numpy()) > 10 * CHI2_999[K - 1]  # the test sees a wrong target
    assert (out['joint_energy'].double() - E[out['joint'][:, 0]]).abs().max() < 1e-6
    assert torch.equal(out['worst'][:, 0], torch.full((B,), int(E.argmax())))
    assert (out['worst_energy'].double() - E.max()).abs().max() < 1e-6
    assert torch.equal(out['base'][:, 0], torch.zeros(B, dtype=torch.long))  # the first LM sample
    assert (out['base_energy'].double() - E[0]).abs().max() < 1e-6
    w = np.exp(log_w.numpy() - log_w.numpy().max())
    assert (out['ess'] - w.sum() ** 2 / (w ** 2).sum()).abs().max() < 1e-6
    assert (out['joint'].shape == out['worst'].shape == out['base'].shape == (B, 1)
            and out['ess'].shape == (B,))


@pytest.mark.parametrize('correct_proposal', [False, True])
def test_algorithm_1_resampling_frequencies(correct_proposal):
    """sample.algorithm_1 (its n samples in memory) on the fixed K = 10 candidates: the chosen one follows
    softmax(log w) (chi-square, p = 0.001), log w = -E, or -E + log P_LM - log q with the proposal
    correction; a target that leaves out a candidate, or weighs the wrong way, is rejected."""
    K, B = 10, 20000
    g = torch.Generator().manual_seed(0)
    E = torch.randn(K, generator=g, dtype=torch.float64).float().double()
    logp, logq = torch.randn(K, generator=g) - 2, torch.randn(K, generator=g) - 2
    prefix, g1 = torch.zeros(B, 2, dtype=torch.long), torch.Generator().manual_seed(1)
    x, i, _, _, log_w_out = sample.algorithm_1(ListLM(logp, logq), TableEnergy(E), prefix, K, 1, top_k=3,
                                               generator=g1, correct_proposal=correct_proposal)
    log_w = -E + (logp.double() - logq.double() if correct_proposal else 0)
    assert torch.equal(x[:, 0], i) and (log_w_out[0] - log_w).abs().max() < 1e-6
    counts = np.bincount(i.numpy(), minlength=K)
    p = torch.softmax(log_w, 0)
    assert chi_square(counts, p.numpy()) < CHI2_999[K - 1], (counts, p * B)
    other = -E if correct_proposal else log_w + logp.double()  # the correction left out, or added unasked
    for wrong in (torch.softmax(-log_w, 0), torch.softmax(other, 0),
                  torch.cat([torch.softmax(log_w[:-1], 0), torch.zeros(1, dtype=torch.float64)])):
        assert chi_square(counts, wrong.numpy() + 1e-12) > 10 * CHI2_999[K - 1]


def test_joint_sample_ess_equal_energies():
    """Equal energies (the zero-head energy): every weight the same, ESS = n exactly."""
    V = 6
    lm = tiny_gpt(vocab_size=V, block_size=16, seed=2)
    torch.manual_seed(0)
    e0 = Energy(GPTConfig(block_size=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16, causal=False)).eval()
    prefix = torch.randint(V, (3, 4), generator=torch.Generator().manual_seed(0))
    out = joint_sample(lm, e0, prefix, 10, 5, top_k=4, generator=torch.Generator().manual_seed(0), max_rows=9)
    assert (out['ess'] - 10).abs().max() < 1e-9 and (out['joint_energy'] == 0).all()
    assert out['joint'].shape == (3, 5) and out['base'].shape == (3, 5)


def test_joint_sample_ess_one_dominant_energy():
    """One energy far below the others: ESS 1, and that sample is always the one chosen."""
    table = torch.zeros(12)
    table[7] = -40.0
    out = joint_sample(ListLM(torch.zeros(12), torch.zeros(12)), TableEnergy(table),
                       torch.zeros(500, 2, dtype=torch.long), 12, 1,
                       generator=torch.Generator().manual_seed(0), max_rows=2500)
    assert (out['ess'] - 1).abs().max() < 1e-12
    assert (out['joint'][:, 0] == 7).all() and (out['joint_energy'] == -40).all()


def test_joint_sample_ess_two_dominant_energies():
    """Two of them: ESS 2, each chosen half the time."""
    table = torch.zeros(12)
    table[7] = table[3] = -40.0
    out = joint_sample(ListLM(torch.zeros(12), torch.zeros(12)), TableEnergy(table),
                       torch.zeros(4000, 2, dtype=torch.long), 12, 1,
                       generator=torch.Generator().manual_seed(0), max_rows=20000)
    assert (out['ess'] - 2).abs().max() < 1e-9
    assert (set(out['joint'][:, 0].tolist()) == {3, 7}
            and abs((out['joint'][:, 0] == 3).double().mean().item() - 0.5) < 0.04)


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


def test_joint_sample_distribution_exact():
    """On an enumerable toy (4 tokens, 2 steps) the output of joint_sample converges to the
    exact joint distribution as n grows (untruncated proposal)."""
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
        out = joint_sample(lm, e, rows, n, L, top_k=None, generator=torch.Generator().manual_seed(n),
                           max_rows=64000)
        dist[n] = tv(empirical(out['joint'], V), joint)
    # n = 1 is P_LM itself; then the distance to the joint model shrinks
    assert (abs(dist[1] - tv(p_lm, joint)) < 0.04 and dist[1] > dist[4] + 0.1 > dist[32] + 0.15
            and dist[32] < 0.05), dist


@pytest.mark.parametrize('correct', [False, True], ids=['top_k_joint', 'proposal_corrected'])
def test_joint_sample_top_k_distribution(correct):
    """Top-2 proposals from an exact bigram GPT whose top-2 mass at step 2 depends on step 1: the
    output follows the joint model of the top-2 LM, or with the proposal correction the untruncated
    joint model on the proposal's support (all the correction can reach: top-k never proposes the rest)."""
    V, L, B = 4, 2, 6000
    lm, e, prefix = bigram_gpt(BIGRAM), rand_energy(V, seed=6, head_std=0.7), torch.tensor([0, 3])
    with torch.no_grad():
        assert (lm(prefix[None])[0][0] - torch.tensor(BIGRAM)[prefix]).abs().max() < 1e-5
    _, joint, restricted, truncated, p_lm = joint_tables(lm, e, prefix, L, V, top_k=2)
    assert tv(truncated, restricted) > 0.12 and tv(p_lm, joint) > 0.2
    rows = prefix.expand(B, -1).contiguous()
    target, other = (restricted, truncated) if correct else (truncated, restricted)
    out = joint_sample(lm, e, rows, 32, L, top_k=2, correct_proposal=correct,
                       generator=torch.Generator().manual_seed(5), max_rows=64000)
    emp = empirical(out['joint'], V)
    assert emp[~(restricted > 0)].sum() == 0  # never outside the top-2 support
    assert tv(emp, target) < 0.04 and tv(emp, other) > 0.09, (tv(emp, target), tv(emp, other))


def rel_var(lp, E):
    """Var(w) / E[w]^2 of w = exp(-E) under the (enumerated) LM probabilities exp(lp): m samples
    give log Z to about sqrt(rel_var / m) (delta method); 0 when nothing is left to sample."""
    p, w = lp.exp(), (-E).exp()
    mu = (p * w).sum()
    return ((p * (w - mu) ** 2).sum() / mu ** 2).item()


@pytest.mark.parametrize('gen_len', [1, 2])
def test_next_token_table_exact(gen_len):
    """Table 3's next-token probabilities under the joint model, P_LM(v|x) Z(x, v) / Z(x) over the
    LM's top 3, renormalised (Appendix A.1 with 3 candidates, all 3 kept), vs exact enumeration;
    tolerances from the delta-method standard error of the estimated log Z(x, v)."""
    V, P, m = 4, 2, 6000
    lm, e = toy_lm(V), rand_energy(V)
    prefix = torch.tensor([[2, 3], [3, 1], [0, 3]])
    top_v, p_lm, p_joint = next_token_table(lm, e, prefix, gen_len, 3, 3, m, FP32,
                                            torch.Generator().manual_seed(0), max_rows=8192)
    assert top_v.shape == p_lm.shape == p_joint.shape == (3, 3)
    assert (p_joint.sum(1) - 1).abs().max() < 1e-12 and (p_joint[:, :-1] >= p_joint[:, 1:]).all()
    for b in range(3):
        lp = logprobs64(lm, prefix[b:b + 1])[0, -1]
        assert sorted(top_v[b].tolist()) == sorted(lp.topk(3).indices.tolist())
        assert (p_lm[b] - lp.exp()[top_v[b]]).abs().max() < 1e-6
        logz, rv = [], []
        for v in top_v[b]:
            _, lp_c, E_c, logz_c = enumerate_joint(lm, e, torch.cat([prefix[b], v.view(1)]),
                                                   gen_len - 1, V, P)
            logz.append(logz_c)
            rv.append(rel_var(lp_c, E_c))
        exact = torch.softmax(lp[top_v[b]] + torch.stack(logz), 0)
        for j in range(3):  # Var log p_j <~ (rv_j + sum_u p_u^2 rv_u) / m
            se = math.sqrt((rv[j] + sum(exact[u].item() ** 2 * rv[u] for u in range(3))) / m)
            assert abs(p_joint[b, j].item() / exact[j].item() - 1) < 4 * se + 0.005, (
                b, j, p_joint[b, j].item(), exact[j].item(), se)
        if b < 2:  # the joint next-token distribution is far from the LM's here
            assert tv(exact, torch.softmax(lp[top_v[b]], 0)) > 0.1


def exact_next_token(lm, e, prefix, gen_len, V):
    """Exact log P_LM(v|x) and log P_LM(v|x) Z(x, v) (float64, all V tokens), and the relative
    variance of the weights behind each Z(x, v), by enumerating every continuation."""
    lp = logprobs64(lm, prefix[None])[0, -1]
    score, rv = [], []
    for v in range(V):
        _, lp_c, E_c, logz_c = enumerate_joint(lm, e, torch.cat([prefix, torch.tensor([v])]), gen_len - 1,
                                               V, prefix.numel())
        score.append(lp[v] + logz_c)
        rv.append(rel_var(lp_c, E_c))
    return lp, torch.stack(score), torch.tensor(rv, dtype=torch.float64)


def test_next_token_table_a1_exact():
    """Appendix A.1 on an enumerable toy (V = 6): the LM's top 4 candidates, Z of each from m
    completions, the top 3 kept and renormalised. The kept tokens are the exact top 3 of
    P_LM(v|x) Z(x, v) among the candidates (a token outside them is never kept, even where the
    exact joint model ranks it in its top 3), their probabilities sum to 1 and match the exact
    joint next-token probabilities restricted to them within 4 delta-method SE + 0.5% (exact to
    float32 rounding when Z is exp(-E), gen_len 1), and memory stays within max_rows."""
    V, C, K, m = 6, 4, 3, 4000
    lm, e = toy_lm(V), rand_energy(V, seed=2, head_std=1.5)
    prefix = torch.tensor([[2, 1], [0, 3], [5, 5]])
    outside_kept = 0
    for gen_len in (1, 2, 3):
        v, p_lm, p_joint = next_token_table(lm, e, prefix, gen_len, C, K, m, FP32,
                                            torch.Generator().manual_seed(gen_len), max_rows=512)
        assert v.shape == p_lm.shape == p_joint.shape == (3, K)
        assert (p_joint.sum(1) - 1).abs().max() < 1e-12
        for b in range(3):
            lp, score, rv = exact_next_token(lm, e, prefix[b], gen_len, V)
            cand = lp.topk(C).indices
            ranked = cand[score[cand].argsort(descending=True)]
            s = score[ranked]
            se_boundary = math.sqrt((rv[ranked[K - 1]] + rv[ranked[K]]).item() / m)
            assert s[K - 1] - s[K] > 6 * se_boundary + 0.05  # the kept set is well determined: no flaky test
            assert v[b].tolist() == ranked[:K].tolist()
            outside_kept += len(set(score.topk(K).indices.tolist()) - set(cand.tolist()))
            exact = torch.softmax(score[v[b]], 0)  # the joint P(v|x) restricted to the kept tokens
            assert (p_lm[b] - lp[v[b]].exp()).abs().max() < 1e-6
            if gen_len == 1:
                assert (p_joint[b] - exact).abs().max() < 1e-6
            for j in range(K):
                se = math.sqrt((rv[v[b, j]] + (exact ** 2 * rv[v[b]]).sum()).item() / m)
                assert abs(p_joint[b, j].item() / exact[j].item() - 1) < 4 * se + 0.005, (
                    gen_len, b, j, p_joint[b, j].item(), exact[j].item(), se)
            assert tv(exact, torch.softmax(lp[v[b]], 0)) > 0.05 or b > 0  # the test sees the energy
    assert outside_kept >= 2  # the exact top 3 of the joint model reaches outside the LM's top 4 here
    # bounded memory: no generate call holds more than max_rows sequences
    rows, orig = [], lm.generate

    def recorded(idx, n_new, num_samples=1, max_rows=512, **kw):
        rows.append((idx.size(0) * num_samples, max_rows))
        return orig(idx, n_new, num_samples=num_samples, max_rows=max_rows, **kw)

    lm.generate = recorded  # generate itself decodes at most max_rows rows at a time
    next_token_table(lm, e, prefix, 3, C, K, 40, FP32, torch.Generator().manual_seed(0), max_rows=16)
    assert max(m for _, m in rows) <= 16 and sum(n for n, _ in rows) == 3 * C * 40
    with pytest.raises(ValueError, match='keep'):
        next_token_table(lm, e, prefix, 3, 2, 3, 4, FP32, torch.Generator())


def test_topk_autoregressive_distribution():
    """With all V candidates kept (no truncation) Appendix A.1's token-by-token sampler approaches
    the exact joint model."""
    V, L = 4, 2
    lm, e = toy_lm(V), rand_energy(V, head_std=3.0)
    prefix = torch.tensor([1, 2])
    _, joint, _, _, p_lm = joint_tables(lm, e, prefix, L, V, top_k=2)
    B = 3000
    rows = prefix.expand(B, -1).contiguous()
    toks = topk_autoregressive(lm, e, rows, L, V, V, 48, FP32, torch.Generator().manual_seed(0),
                               max_rows=200000)
    assert toks.shape == (B, L)
    d = tv(empirical(toks, V), joint)
    assert d < 0.05 and tv(p_lm, joint) > 0.3, d


def test_topk_autoregressive_stays_in_the_top_k():
    """With 2 candidates it stays inside the LM's top-2 at every step."""
    V, L = 4, 2
    lm, e = toy_lm(V), rand_energy(V, head_std=3.0)
    rows = torch.tensor([1, 2]).expand(200, -1).contiguous()
    toks = topk_autoregressive(lm, e, rows, L, 2, 2, 8, FP32, torch.Generator().manual_seed(1),
                               max_rows=200000)
    seqs = torch.cat([rows, toks], 1)
    lp = logprobs64(lm, seqs)[:, 1:-1]
    rank = (lp > lp.gather(-1, toks[..., None])).sum(-1)
    assert rank.max() < 2


def test_unique_ngrams():
    texts = ["a b a b", "a b c"]
    assert unique_ngrams(texts, 1) == 100 * 3 / 7  # a b a b a b c: 3 distinct of 7
    assert unique_ngrams(texts, 2) == 100 * 3 / 5  # ab ba ab | ab bc
    assert unique_ngrams(texts, 3) == 100 * 3 / 3  # aba bab | abc
    assert unique_ngrams(texts, 4) == 100.0 and unique_ngrams(texts, 5) is None
    assert unique_ngrams(["x y", "z w"], 2) == 100.0  # no n-gram across texts
    assert unique_ngrams(["  the the\nthe  "], 1) == 100 / 3  # whitespace-split words


def test_analyses():
    results = [dict(gold="a b c d", base="a a a a", joint="a b a b",
                    lm_logp=dict(gold=-4.0, base=-1.0, joint=-2.5)),
               dict(gold="e f", base="a a", joint="c d", lm_logp=dict(gold=-6.0, base=-2.0, joint=-3.5))]
    rep = sample.analyses(results)
    assert rep['unique_ngrams']['gold'] == [100.0, 100.0, 100.0, 100.0]
    assert (rep['unique_ngrams']['base'][:3] == [100 / 6, 100 / 4, 100 / 2]
            and rep['unique_ngrams']['base'][3] == 100.0)
    assert rep['unique_ngrams']['joint'][:3] == [100 * 4 / 6, 100 * 3 / 4, 100.0]  # ab ba ab | cd
    assert rep['mean_lm_logp'] == dict(gold=-5.0, base=-1.5, joint=-3.0)
    assert rep['mean_lm_logp_diff'] == {'base-gold': 3.5, 'joint-gold': 2.0}


def char_ids(tok, text):
    """Ids of a decoded char-tokenizer text, end-of-text tokens included (they decode to EOT)."""
    ids = []
    for i, piece in enumerate(text.split(EOT)):
        ids += ([tok.eot_id] if i else []) + tok.encode(piece)
    return ids


def test_sample_cli(lm_corpus, lm_ckpt, eval_ckpts, sample_run):
    out, rep = sample_run
    assert json.dumps(json.loads(out.read_text())) == json.dumps(rep)
    meta = load_meta(lm_corpus)
    tok = load_tokenizer(meta)
    lm = load_lm(lm_ckpt)[0]
    energy = load_energy(eval_ckpts['bit'], lm_ckpt)[0]
    data = load_split(lm_corpus, 'test', meta)
    x = window_tokens(data, windows(data, EVAL_P, EVAL_L, max_windows=3), EVAL_P + EVAL_L)
    assert len(rep['samples']) == 3 and rep['dtype'] == dict(sample='float32', score='float32')
    for b, r in enumerate(rep['samples']):
        assert (r['prefix'] == tok.decode(x[b, :EVAL_P].tolist())
                and r['gold'] == tok.decode(x[b, EVAL_P:].tolist()))
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
        assert len(r['next_tokens']) == 3  # the first 3 of the 4 kept of the LM's top 6, by joint probability
        lp = logprobs64(lm, x[b:b + 1, :EVAL_P])[0, -1]
        top6 = {tok.decode([v]): p
                for v, p in zip(lp.topk(6).indices.tolist(), lp.exp().topk(6).values.tolist())}
        assert all(t['token'] in top6 and abs(t['p_lm'] - top6[t['token']]) < 1e-6 for t in r['next_tokens'])
        p_joint = [t['p_joint'] for t in r['next_tokens']]
        assert (p_joint == sorted(p_joint, reverse=True)
                and sum(p_joint) < 1 <= sum(p_joint) + p_joint[-1] + 1e-6)  # the 4th is at most the 3rd
    assert (json.dumps(rep['unique_ngrams'])
            == json.dumps(sample.analyses(rep['samples'])['unique_ngrams']))  # NaN-aware
    assert sorted(rep['unique_ngrams']) == ['autoregressive', 'base', 'gold', 'joint']
    assert rep['mean_lm_logp']['gold'] == np.mean([r['lm_logp']['gold'] for r in rep['samples']])


def test_sample_cli_prompt(lm_corpus, lm_ckpt, eval_ckpts, tmp_path):
    """A prompt instead of data prefixes: no gold."""
    tok = load_tokenizer(load_meta(lm_corpus))
    rep = sample.main(['--lm', lm_ckpt, '--energy', eval_ckpts['bit'], '--prompt', 'the quick',
                       '--gen_len', '4', '--num_samples', '4', '--table_k', '0', '--quiet', '--device', 'cpu',
                       '--out', str(tmp_path / 'p.json')])
    r = rep['samples'][0]
    assert r['prefix'] == 'the quick' and 'gold' not in r and 'next_tokens' not in r
    assert len(char_ids(tok, r['joint'])) == len(char_ids(tok, r['base'])) == 4


def test_sample_cli_hands_over_to_joint_sample(lm_corpus, lm_ckpt, eval_ckpts, tmp_path, capsys):
    """3 prefixes x n = 6 samples: within --max_rows 512 main runs algorithm_1, over --max_rows 10
    it says so in one line and hands over to energy.joint_sample. Either way its samples are
    joint_sample's own from the same generator (in one chunk: algorithm_1 draws exactly as it does),
    with --correct_proposal too (weights exp(-E) P_LM / q, a sign of its own in each)."""
    argv = ['--lm', lm_ckpt, '--energy', eval_ckpts['bit'], '--split', 'test', '--num_prefixes', '3',
            '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--num_samples', '6', '--top_k', '5',
            '--table_k', '0', '--device', 'cpu', '--dtype', 'float32', '--quiet']
    line = ("n = 6 samples x 3 prefixes do not fit in --max_rows 10: "
            "Algorithm 1 in chunks (energy.joint_sample, tested equal to algorithm_1)")
    meta = load_meta(lm_corpus)
    tok, lm, energy = load_tokenizer(meta), load_lm(lm_ckpt)[0], load_energy(eval_ckpts['bit'], lm_ckpt)[0]
    data = load_split(lm_corpus, 'test', meta)
    prefixes = window_tokens(data, windows(data, EVAL_P, EVAL_L, max_windows=3), EVAL_P + EVAL_L)[:, :EVAL_P]
    for max_rows, hands_over, correct in ((512, False, False), (10, True, False), (512, False, True),
                                          (10, True, True)):
        flags = ['--max_rows', str(max_rows), '--out', str(tmp_path / f'{max_rows}{correct}.json')]
        rep = sample.main(argv + flags + ['--correct_proposal'] * correct)
        assert capsys.readouterr().err.count(line) == hands_over
        g = rng(1337, 'joint_samples', 'test', 0, 'cpu')  # main's generator
        out = joint_sample(lm, energy, prefixes, 6, EVAL_L, 5, correct, generator=g, max_rows=max_rows)
        for b, r in enumerate(rep['samples']):
            for k in ('joint', 'worst', 'base'):
                assert r[k] == tok.decode(out[k][b].tolist())
                assert abs(r[f'{k}_energy'] - out[f'{k}_energy'][b].item()) < 1e-9
            assert abs(r['ess'] - out['ess'][b].item()) < 1e-9

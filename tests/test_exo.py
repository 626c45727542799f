"""EXO's objective (Ji et al., ICML 2024) against exact enumeration on a toy: its K-sample gradient
tends to the reverse KL's, its minimiser is the joint model, its step loss and KL estimates match
float64 references. exo.py's runs on addition (resume, guards): test_exo_runs.py."""

import copy
import itertools
import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from energy import Energy, score_continuations
from extensions import exo
from model import GPTConfig
from tests.common import NULL, logprobs64, tiny_gpt


def exo_toy(V=3):
    """An enumerable toy: continuations of length 2 over V tokens (V^2 of them), pi_sft and a
    tabular autoregressive pi_theta (trainable), a fixed random energy; float64."""
    g = torch.Generator().manual_seed(1)
    draw = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    logpi = lambda t1, t2: (F.log_softmax(t1, -1)[:, None] + F.log_softmax(t2, -1)).flatten()
    lsft, E = logpi(draw(V), draw(V, V)), draw(V * V)
    theta = (draw(V).requires_grad_(), draw(V, V).requires_grad_())
    return lsft, E, theta, logpi


def flat_grad(loss, theta):
    return torch.cat([t.flatten() for t in torch.autograd.grad(loss, theta)])


@pytest.mark.parametrize('loss,on_policy', [('exo', False), ('dpo', False), ('exo', True), ('dpo', True)])
def test_exo_gradient_tends_to_the_kl_gradient(loss, on_policy):
    """The talk's analysis of EXO (Ji et al., ICML 2024): with K samples of pi_sft per prefix, the
    gradient of L_exo tends to that of the reverse KL(pi_theta || pi*), pi* ∝ pi_sft exp(-E)
    (the joint model, beta_pi = beta_r = 1), and L_dpo-rw's to the forward KL(pi* || pi_theta)'s, as
    K grows; so do they from pi_theta's own samples weighted by pi_sft / pi_theta (--on_policy).
    Exact gradients by enumeration in float64, K-sample ones averaged over 2^16 samples."""
    lsft, E, theta, logpi = exo_toy()
    lt, lstar = logpi(*theta), F.log_softmax(lsft - E, -1)
    kl = (lt.exp() * (lt - lstar)).sum() if loss == 'exo' else (lstar.exp() * (lstar - lt)).sum()
    exact = flat_grad(kl, theta)
    errors = []
    for K in (4, 64, 4096):
        lt = logpi(*theta)
        proposal = (lt if on_policy else lsft).detach().exp()
        idx = torch.multinomial(proposal.expand(2 ** 16 // K, -1), K, replacement=True,
                                generator=torch.Generator().manual_seed(K))
        log_w = (lsft - lt.detach())[idx] if on_policy else None
        est = flat_grad(exo.exo_loss(lt[idx], lsft[idx], -E[idx], loss=loss, log_w=log_w).mean(), theta)
        errors.append(((est - exact).norm() / exact.norm()).item())
    # biased at small K (off-policy 1.0 at K = 4 for exo; on-policy 0.25: the proposal is pi_theta)
    assert errors[0] > (0.1 if on_policy else 0.3) and errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.03, errors


@pytest.mark.parametrize('loss,beta_pi,beta_r', [('exo', 1, 1), ('exo', 2, 1), ('exo', 1, 0.5),
                                                 ('dpo', 1, 1), ('dpo', 2, 0.5)])
def test_exo_minimiser_is_the_joint_model(loss, beta_pi, beta_r):
    """The K -> infinity limit of the loss (every continuation, weighted by pi_sft: exo_loss's
    log_w) is KL(pi_theta^beta_pi || pi*_beta_r) exactly (forward for dpo), and minimising it over a
    free tabular policy reaches pi_theta ∝ pi_sft exp(-E / (beta_pi beta_r)): the joint model of
    Deng et al. at beta_pi = beta_r = 1."""
    lsft, E, theta, logpi = exo_toy()
    limit = lambda: exo.exo_loss(logpi(*theta), lsft, -E, beta_pi, beta_r, loss, log_w=lsft)
    lp = F.log_softmax(beta_pi * logpi(*theta) + (1 - beta_pi) * lsft, -1).detach()  # pi_theta^beta_pi
    lr = F.log_softmax(lsft - E / beta_r, -1)
    ref = (lp.exp() * (lp - lr)).sum() if loss == 'exo' else -(lr.exp() * lp).sum()
    assert abs(limit().item() - ref.item()) < 1e-12
    opt = torch.optim.LBFGS(theta, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn='strong_wolfe')

    def closure():
        opt.zero_grad()
        value = limit()
        value.backward()
        return value
    opt.step(closure)
    target = F.softmax(lsft - E / (beta_pi * beta_r), -1)
    assert (logpi(*theta).exp() - target).abs().max().item() < 1e-6


@pytest.mark.parametrize('on_policy', [False, True])
def test_exo_step_loss_float64_reference(on_policy):
    """exo_step_loss on a GPT: K samples per prefix of pi_sft, or of pi_theta with --on_policy
    (redrawn from the same generator), their log-probs under both LMs and energies recomputed in
    float64, the loss by the formula (on-policy: both softmaxes weighted by pi_sft / pi_theta)."""
    sft = tiny_gpt(vocab_size=7, block_size=16, seed=2)
    policy = copy.deepcopy(sft)
    with torch.no_grad():
        policy.lm_head.weight.add_(0.1 * torch.randn_like(policy.lm_head.weight))
    torch.manual_seed(3)
    energy = Energy(GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=2, n_embd=16,
                              causal=False)).eval()
    with torch.no_grad():
        energy.head.weight.normal_(0, 1.0)
    prefix = torch.randint(7, (3, 5), generator=torch.Generator().manual_seed(4))
    args = types.SimpleNamespace(beta_pi=1.5, beta_r=0.7, loss='exo', on_policy=on_policy)
    got = exo.exo_step_loss(policy, sft, energy, prefix, 4, 6, args, torch.Generator().manual_seed(5))
    proposal = policy if on_policy else sft
    y = proposal.generate(prefix, 6, num_samples=4, generator=torch.Generator().manual_seed(5))[0]
    x = torch.cat([prefix[:, None].expand(-1, 4, -1), y], 2).flatten(0, 1)
    lp = lambda m: logprobs64(m, x[:, :-1])[:, 4:].gather(-1, x[:, 5:, None]).squeeze(-1).sum(1).view(3, 4)
    with torch.no_grad():
        r = -energy(x, 5).double().view(3, 4)  # E itself is float32 (Energy.project)
    w = np.asarray(lp(sft) - lp(policy)) if on_policy else 0.0
    f, g = np.asarray(1.5 * (lp(policy) - lp(sft))) + w, np.asarray(r / 0.7) + w
    pf, pr = (np.exp(v - v.max(1, keepdims=True)) for v in (f, g))
    pf, pr = pf / pf.sum(1, keepdims=True), pr / pr.sum(1, keepdims=True)
    assert abs(got.item() - (pf * np.log(pf / pr)).sum(1).mean()) < 1e-5


def set_case():
    """A GPT pi_sft over 5 tokens, a perturbed copy as pi_theta, a random bidirectional energy and 2
    prefixes; continuations of 2 tokens: 25 of them, every one enumerable."""
    sft = tiny_gpt(vocab_size=5, block_size=8, seed=2)
    policy = copy.deepcopy(sft)
    with torch.no_grad():
        policy.lm_head.weight.add_(0.3 * torch.randn_like(policy.lm_head.weight))
    torch.manual_seed(3)
    config = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=16, causal=False)
    energy = Energy(config).eval()
    with torch.no_grad():
        energy.head.weight.normal_(0, 1.0)
    return sft, policy, energy, torch.randint(5, (2, 4), generator=torch.Generator().manual_seed(4))


def every_pair(prefix, V=5):
    """(B, V^2, P + 2): each prefix followed by every continuation of 2 tokens."""
    y = torch.tensor(list(itertools.product(range(V), repeat=2)))
    return torch.cat([prefix[:, None].expand(-1, len(y), -1), y.expand(len(prefix), -1, -1)], 2)


@pytest.mark.parametrize('on_policy', [False, True])
def test_set_step_loss_float64_reference(on_policy):
    """--beam W: the loss over the distinct continuations among P_LM's beam and the K samples
    (redrawn from the same generator), each once, against the restricted KL written out in float64:
    p_f ∝ pi_sft (pi_theta / pi_sft)^beta_pi and p_r ∝ pi_sft exp(-E / beta_r) on that set."""
    sft, policy, energy, prefix = set_case()
    args = types.SimpleNamespace(beta_pi=1.5, beta_r=0.7, loss='exo', on_policy=on_policy, beam=3,
                                 beam_mass=0.0)
    got = exo.set_step_loss(policy, sft, energy, prefix, 4, 2, args, torch.Generator().manual_seed(5))
    beam = sft.beam_search(prefix, 2, 3)[0]
    proposal = policy if on_policy else sft
    y = proposal.generate(prefix, 2, num_samples=4, generator=torch.Generator().manual_seed(5))[0]
    kls = []
    for b in range(2):
        S = sorted({tuple(t) for t in torch.cat([beam[b], y[b]]).tolist()})
        x = torch.tensor([prefix[b].tolist() + list(t) for t in S])
        lp = lambda m: logprobs64(m, x[:, :-1])[:, 3:].gather(-1, x[:, 4:, None]).squeeze(-1).sum(1).numpy()
        with torch.no_grad():
            e = energy(x, 4).double().numpy()
        f, g = 1.5 * (lp(policy) - lp(sft)) + lp(sft), -e / 0.7 + lp(sft)
        pf, pr = (np.exp(v - v.max()) / np.exp(v - v.max()).sum() for v in (f, g))
        kls.append((pf * np.log(pf / pr)).sum())
    assert len(S) < 7  # repeats were dropped: a set, not the 7 draws
    assert abs(got.item() - np.mean(kls)) < 1e-5


def test_set_step_loss_on_every_continuation_is_the_reverse_kl():
    """With a beam wide enough to hold every continuation (25), the set loss is the exact reverse
    KL(pi_theta || pi*), pi* ∝ pi_sft exp(-E), by enumeration in float64, and its gradient is the
    KL's (the K -> infinity limit reached on the set, whatever the K samples)."""
    sft, policy, energy, prefix = set_case()
    args = types.SimpleNamespace(beta_pi=1.0, beta_r=1.0, loss='exo', on_policy=True, beam=25, beam_mass=0.0)
    got = exo.set_step_loss(policy, sft, energy, prefix, 2, 2, args, torch.Generator().manual_seed(6))
    grad = torch.autograd.grad(got, policy.lm_head.weight)[0]
    x = every_pair(prefix).flatten(0, 1)
    p64 = copy.deepcopy(policy).double()
    lt = F.log_softmax(p64(x[:, :-1])[0], -1)[:, 3:].gather(-1, x[:, 4:, None]).squeeze(-1)
    lt = lt.sum(1).view(2, 25)
    with torch.no_grad():
        ls = logprobs64(sft, x[:, :-1])[:, 3:].gather(-1, x[:, 4:, None]).squeeze(-1).sum(1).view(2, 25)
        lstar = F.log_softmax(ls - energy(x, 4).double().view(2, 25), -1)
    kl = (lt.exp() * (lt - lstar)).sum(1).mean()
    ref = torch.autograd.grad(kl, p64.lm_head.weight)[0]
    assert abs(got.item() - kl.item()) < 1e-5
    assert (grad.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item() + 1e-7


def test_beam_mass_adds_minus_log_pi_theta_of_the_beam():
    """--beam_mass lambda adds lambda (-log pi_theta(B)), B the LM's beam of W counted once, by
    enumeration of every continuation in float64; its gradient raises pi_theta(B)."""
    sft, policy, energy, prefix = set_case()
    flags = lambda lam: types.SimpleNamespace(beta_pi=1.0, beta_r=1.0, loss='exo', on_policy=True, beam=3,
                                              beam_mass=lam)
    loss = lambda lam: exo.set_step_loss(policy, sft, energy, prefix, 4, 2, flags(lam),
                                         torch.Generator().manual_seed(7))
    beam = sft.beam_search(prefix, 2, 3)[0]
    x = every_pair(prefix)
    in_beam = (x[:, :, None, 4:] == beam[:, None]).all(-1).any(-1)
    assert in_beam.sum(1).tolist() == [3, 3]

    @torch.no_grad()
    def minus_log_pi_beam():  # -log pi_theta(B), mean over the prefixes, every continuation in float64
        x_ = x.flatten(0, 1)
        p = logprobs64(policy, x_[:, :-1])[:, 3:].gather(-1, x_[:, 4:, None]).squeeze(-1).sum(1).exp()
        return -torch.log((p.view(2, 25) * in_beam).sum(1)).mean().item()
    want = minus_log_pi_beam()
    assert abs((loss(2.5) - loss(0.0)).item() - 2.5 * want) < 1e-5
    (g,) = torch.autograd.grad(loss(1.0) - loss(0.0), policy.lm_head.weight)
    with torch.no_grad():
        policy.lm_head.weight.sub_(0.1 * g)
    assert minus_log_pi_beam() < want


def exo_kl_case(dropout=0.0):
    """A tiny LM (3 tokens), a perturbed copy as pi_theta and a random energy; continuations of 3
    tokens after 2 prefixes of 2, so every one of the 27 can be enumerated."""
    sft = tiny_gpt(vocab_size=3, block_size=8, seed=4, dropout=dropout)
    policy = copy.deepcopy(sft)
    with torch.no_grad():
        policy.lm_head.weight.add_(0.2 * torch.randn(policy.lm_head.weight.shape,
                                                     generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(6)
    energy = Energy(GPTConfig(block_size=8, vocab_size=4, n_layer=1, n_head=2, n_embd=16,
                              causal=False)).eval()
    with torch.no_grad():
        energy.head.weight.normal_(0, 1.0)
    return sft, policy, energy, torch.tensor([[0, 1], [2, 2]])


def test_exo_kl_estimates_match_enumeration():
    """kl_estimates against every continuation enumerated in float64: KL(pi_theta || P_LM), and the
    reverse KL(pi_theta || pi*) and forward KL(pi* || pi_theta) to the joint model pi* ∝ P_LM exp(-E),
    each within Monte-Carlo error of the exact value at both ends of log Z's range (log Z from
    logz_table's own LM samples, the same whatever the policy), low <= high."""
    sft, policy, energy, prefix = exo_kl_case()
    y = torch.tensor(list(itertools.product(range(3), repeat=3)))[None].expand(2, -1, -1)  # (2, 27, 3)
    with torch.no_grad():
        lsft, lpi = (exo.continuation_logprob(m, prefix, y).double() for m in (sft, policy))
        E = score_continuations(energy, prefix, y, 2, NULL).double()
    assert torch.allclose(lsft.exp().sum(1), torch.ones(2, dtype=torch.float64), atol=1e-5)
    log_z = torch.logsumexp(lsft - E, 1)
    joint = lsft - E - log_z[:, None]
    exact = dict(kl_to_base=(lpi.exp() * (lpi - lsft)).sum(1).mean().item(),
                 kl_reverse=(lpi.exp() * (lpi - joint)).sum(1).mean().item(),
                 kl_forward=(joint.exp() * (joint - lpi)).sum(1).mean().item())
    assert min(exact.values()) > 0.05
    table = exo.logz_table(sft, energy, prefix, 3, 8192, 8192, torch.Generator().manual_seed(7))
    assert table['logz_samples'] == 8192 and torch.all(table['low'] <= table['high'])
    assert torch.allclose(table['low'], log_z, atol=0.01) and torch.allclose(table['high'], log_z, atol=0.01)
    got = exo.kl_estimates(policy, sft, energy, table, 3, 8192, torch.Generator().manual_seed(8))
    assert abs(got['kl_to_base'] - exact['kl_to_base']) < 0.02, (got, exact)
    pw = torch.exp(-E - (-E).amax(1, keepdim=True)) * lsft.exp()  # P_LM(y) w(y), exactly, up to a constant
    ess = pw.sum(1) ** 2 / (pw ** 2 / lsft.exp()).sum(1)  # Kish's ESS of n draws: about n (E w)^2 / E w^2
    assert got['logz_flagged'] == 0 and abs(got['logz_ess'] / (8192 * ess.mean().item()) - 1) < 0.1
    for kl in ('kl_reverse', 'kl_forward'):
        assert got[f'{kl}_low'] <= got[f'{kl}_high']
        for end in ('low', 'high'):
            assert abs(got[f'{kl}_{end}'] - exact[kl]) < 0.02, (kl, got, exact)


def test_logz_table_keeps_its_first_m_samples_and_bounds_from_all_n():
    """logz_table with m = 16 < n = 64: log Z's range and its diagnostics from all n LM samples, the
    first m kept aligned (tokens, -E, log P_LM), each against the same draws redone by hand; and the
    KL ranges of kl_estimates are as wide as log Z's (mean high - low), for the reverse and the
    forward KL alike."""
    from energy import logz_bounds, logz_diagnostics
    sft, policy, energy, prefix = exo_kl_case()
    n, m = 64, 16
    table = exo.logz_table(sft, energy, prefix, 3, n, m, torch.Generator().manual_seed(7))
    with torch.no_grad():
        y = sft.generate(prefix, 3, num_samples=n, generator=torch.Generator().manual_seed(7))[0]
        neg_e = -score_continuations(energy, prefix, y, 2, NULL).double()
        logp = exo.continuation_logprob(sft, prefix, y[:, :m]).double()
    low, high = logz_bounds(neg_e)
    assert (table['low'] - low).abs().max() < 1e-9 and (table['high'] - high).abs().max() < 1e-9
    assert torch.allclose(table['ess'], logz_diagnostics(neg_e)['ess'].double(), rtol=1e-9)
    assert torch.equal(table['y'], y[:, :m]) and torch.allclose(table['neg_e'], neg_e[:, :m], atol=1e-9)
    assert torch.allclose(table['logp_sft'], logp, atol=1e-9)
    width = (table['high'] - table['low']).mean().item()
    assert width > 1e-3  # 64 samples: a range, not a point
    got = exo.kl_estimates(policy, sft, energy, table, 3, m, torch.Generator().manual_seed(8))
    for kl in ('kl_reverse', 'kl_forward'):
        assert abs(got[f'{kl}_high'] - got[f'{kl}_low'] - width) < 1e-9, (kl, got, width)


def test_exo_policy_forward_in_eval_mode():
    """With dropout in the LM, pi_theta's forward runs in eval mode in the loss and the estimates:
    at step 0 (pi_theta = pi_sft) p_f is uniform, so L_exo = KL(uniform || p_r) exactly (float64
    reference), and the KL to the base LM is 0; the policy's mode is restored after each."""
    sft, _, energy, prefix = exo_kl_case(dropout=0.5)
    policy = copy.deepcopy(sft).train()
    args = types.SimpleNamespace(beta_pi=1.0, beta_r=1.0, loss='exo', on_policy=False)
    got = exo.exo_step_loss(policy, sft, energy, prefix, 6, 3, args, torch.Generator().manual_seed(1))
    y = sft.generate(prefix, 3, num_samples=6, generator=torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        log_pr = torch.log_softmax(-score_continuations(energy, prefix, y, 2, NULL).double(), 1)
    assert abs(got.item() - (math.log(1 / 6) - log_pr).mean(1).mean().item()) < 1e-5
    assert policy.training
    table = exo.logz_table(sft, energy, prefix, 3, 16, 8, torch.Generator().manual_seed(2))
    kl = exo.kl_estimates(policy, sft, energy, table, 3, 8, torch.Generator().manual_seed(3))
    assert kl['kl_to_base'] == 0
    assert policy.training


def test_greedy_exact_against_stepwise_argmax():
    """kl_estimates' greedy_exact against greedy decoding by hand (the argmax of a full forward, one
    token at a time): 1 where both prefixes' real continuations are pi_theta's greedy ones, 1/2 where
    the second's last token differs, and absent where the table has no real continuations."""
    sft, policy, energy, prefix = exo_kl_case()
    x = prefix
    with torch.no_grad():
        for _ in range(3):
            x = torch.cat([x, policy.logits(x)[:, -1].argmax(-1, keepdim=True)], 1)
    greedy = x[:, 2:]
    table = exo.logz_table(sft, energy, prefix, 3, 16, 8, torch.Generator().manual_seed(2))
    assert 'greedy_exact' not in exo.kl_estimates(policy, sft, energy, table, 3, 4, torch.Generator())
    wrong = greedy.clone()
    wrong[1, -1] = (wrong[1, -1] + 1) % 3
    for gold, want in ((greedy, 1.0), (wrong, 0.5)):
        got = exo.kl_estimates(policy, sft, energy, dict(table, gold=gold), 3, 4, torch.Generator())
        assert got['greedy_exact'] == want


def test_select_ranks_by_the_kl_or_by_greedy_exact():
    """best.pt's order (rank, lower is better): by the KL the loss minimises (the reverse KL for exo,
    the forward for dpo), or with --select greedy_exact by the greedy exact match, ties to the lower KL."""
    a = dict(kl_reverse_high=1.0, kl_forward_high=0.1, greedy_exact=0.9)
    b = dict(kl_reverse_high=0.5, kl_forward_high=0.2, greedy_exact=0.8)
    c = dict(b, greedy_exact=0.9)
    args = lambda select, loss='exo': types.SimpleNamespace(select=select, loss=loss)
    assert exo.rank(b, args('kl')) < exo.rank(a, args('kl'))
    assert exo.rank(a, args('kl', 'dpo')) < exo.rank(b, args('kl', 'dpo'))
    assert exo.rank(a, args('greedy_exact')) < exo.rank(b, args('greedy_exact'))
    assert exo.rank(c, args('greedy_exact')) < exo.rank(a, args('greedy_exact'))
    prefixed = {f'select_{k}': v for k, v in a.items()}
    assert exo.rank(prefixed, args('greedy_exact'), 'select_') == exo.rank(a, args('greedy_exact'))
    assert exo.selected_by(args('kl', 'dpo')) == 'kl_forward_high'
    assert exo.selected_by(args('greedy_exact')) == 'greedy_exact'

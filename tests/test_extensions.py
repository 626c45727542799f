"""The extensions: the talk's metric EBM and TaiLr (extensions/metrics.py, metric_ebm.py, TaiLr's
loss), EXO and the addition task (extensions/exo.py, addition_eval.py, data/addition). The method's
tests are in test_all.py.
"""

import collections
import contextlib
import copy
import importlib.util
import itertools
import json
import math
import os
import re
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import estimate_ppl
from extensions import metric_ebm, metrics
import sample
import train_lm
from data import load_meta, load_split, window_tokens, windows
from energy import (Energy, build_energy, energy_state, load_any_energy, logz_bounds, sample_log_weights,
                    score, score_continuations, share_energies)
from model import GPTConfig, load_checkpoint, load_lm
from plumbing import save_checkpoint
from data.tokenizer import EOT, load_tokenizer
from extensions import addition_eval, exo
from data.addition import prepare as addition_prepare
from tests.common import (CPU, EVAL_L, EVAL_P, NULL, TRAIN_FLAGS, UNWRITABLE, enumerable_problem, logprobs64,
                          rand_energy, sample_argv, tiny_gpt)

pytest_plugins = ['tests.common']  # the fixtures several test files share, defined once there


# =============================================================================
# ==== metric EBM and TaiLr (Ji et al.): metrics on hand-made text, moment matching vs exact enumeration,
#      Pythagoras, metric_ebm.py, TaiLr's loss ====

def rep_brute(y, n):
    grams = [tuple(y[i:i + n]) for i in range(len(y) - n + 1)]
    return 1 - len(set(grams)) / len(grams)


def test_metrics_on_hand_made_sequences():
    """rep-n, tr-w and div against values worked out by hand, then against a python-set reference."""
    y = torch.tensor([[0, 1, 0, 1, 0], [2, 2, 2, 2, 2], [0, 1, 2, 3, 4]])
    assert metrics.repetition(y, 2, 5).tolist() == [0.5, 0.75, 0.0]  # (01,10,01,10): 2 distinct of 4
    assert metrics.repetition(y, 1, 5).tolist() == pytest.approx([1 - 2 / 5, 1 - 1 / 5, 0.0])
    x = torch.tensor([[5, 1, 2, 1, 3, 3]])  # prefix (5, 1): 2 no, 1 yes (in 1,2), 3 no, 3 yes (in 1,3)
    assert metrics.token_repetition(x, 2, 2).tolist() == [0.5]
    assert metrics.token_repetition(x, 2, 4).tolist() == [0.5]  # 2 is not among 5,1 either
    # the first has no past
    assert metrics.token_repetition(torch.tensor([[7, 7, 7]]), 0, 1).tolist() == [2 / 3]
    assert metrics.token_repetition(x, 2, 32).tolist() == [0.5]  # a window longer than the sequence
    g = torch.Generator().manual_seed(0)
    ys = torch.randint(0, 3, (20, 9), generator=g)
    for n in (1, 2, 3, 4):
        assert metrics.repetition(ys, n, 3).tolist() == pytest.approx([rep_brute(r, n) for r in ys.tolist()])
    me = metrics.MetricEnergy(['div'], tiny_gpt(vocab_size=3))
    div = me.features(torch.cat([ys[:, :2], ys], 1), 2)[:, 0]
    ref = [math.prod(1 - rep_brute(r, n) for n in (2, 3, 4)) for r in ys.tolist()]
    assert div.tolist() == pytest.approx(ref)


def test_lm_metrics_float64_reference():
    """coh and logp against a float64 forward written out here."""
    lm = tiny_gpt()
    x = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(1))
    coh, logp = metrics.lm_metrics(lm, x, 5)
    m64 = copy.deepcopy(lm).double()
    with torch.no_grad():
        h = m64.hidden(x)
        lp = F.log_softmax(m64.lm_head(h), -1)[:, 4:-1].gather(-1, x[:, 5:, None]).squeeze(-1)
    ref_coh = F.cosine_similarity(h[:, :5].mean(1), h[:, 5:].mean(1), dim=-1)
    torch.testing.assert_close(coh, ref_coh, atol=1e-5, rtol=0)
    torch.testing.assert_close(logp, lp.mean(1), atol=1e-5, rtol=0)


def parse_cases():
    return [('rep-4,foo', 'unknown metric'), ('rep-0', 'unknown metric'), ('rep-9', 'at least 9 tokens'),
            ('div,div', 'twice'), ('', 'empty')]


@pytest.mark.parametrize('spec,match', parse_cases())
def test_parse_metrics_refuses(spec, match):
    with pytest.raises(ValueError, match=match):
        metrics.parse_metrics(spec, 11, 8)
    with pytest.raises(ValueError, match='overflow'):
        metrics.parse_metrics('rep-5', 50257, 8)
    assert (metrics.parse_metrics('rep-4,tr-32,div,coh,logp', 50257, 8)
            == ['rep-4', 'tr-32', 'div', 'coh', 'logp'])


def test_moment_matching_by_sampling_converges():
    """Fitted from n samples of P_LM per prefix (self-normalised importance sampling), mu tends to
    the exact projection's as n grows."""
    log_p, p_data, f = enumerable_problem()
    target = torch.einsum('bn,bnk->bk', p_data, f)
    mu_exact, _ = metrics.fit_mu(target, f, log_p0=log_p)
    errors = []
    for n in (1000, 30000, 400000):
        idx = torch.multinomial(log_p.exp(), n, replacement=True, generator=torch.Generator().manual_seed(n))
        mu_n, _ = metrics.fit_mu(target, torch.stack([f[b, idx[b]] for b in range(2)]))
        errors.append((mu_n - mu_exact).norm().item())
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02 * mu_exact.norm().item(), errors


def test_fit_refuses_unreachable_or_constant_metrics():
    log_p, p_data, f = enumerable_problem()
    target = torch.einsum('bn,bnk->bk', p_data, f)
    with pytest.raises(ValueError, match='outside what the LM samples reach'):
        metrics.fit_mu(target + torch.tensor([0.0, 0.0, 10.0]), f, ['a', 'b', 'c'], log_p0=log_p)
    flat = f.clone()
    flat[..., 1] = 0.5
    with pytest.raises(ValueError, match='metric b does not vary'):
        metrics.fit_mu(target, flat, ['a', 'b', 'c'], log_p0=log_p)


def moment_gap(mu, target, f, log_p):
    """max_k |E_data[f_k] - E_p*[f_k]| / (1 + |E_data[f_k]|), p* ~ P_LM exp(-mu . f) summed out by hand."""
    t = target.double().mean(0)
    gaps = [0.0] * len(t)
    for b in range(f.size(0)):
        w = [math.exp(log_p[b, j].item() - sum(mu[k].item() * f[b, j, k].item() for k in range(len(t))))
             for j in range(f.size(1))]
        for k in range(len(t)):
            gaps[k] += sum(wj * f[b, j, k].item() for j, wj in enumerate(w)) / sum(w) / f.size(0)
    return max(abs(t[k].item() - gaps[k]) / (1 + abs(t[k].item())) for k in range(len(t)))


def test_fit_mu_out_of_steps_judges_the_returned_mu():
    """Out of Newton steps, fit_mu accepts or refuses on the moment gaps at the mu it returns, not
    at the mu before its last step."""
    log_p, p_data, f = enumerable_problem()
    target = torch.einsum('bn,bnk->bk', p_data, f)
    mu1, steps1 = metrics.fit_mu(target, f, log_p0=log_p, max_steps=1, accept=math.inf)
    mu2, steps2 = metrics.fit_mu(target, f, log_p0=log_p, max_steps=2, accept=math.inf)
    gap1, gap2 = moment_gap(mu1, target, f, log_p), moment_gap(mu2, target, f, log_p)
    assert (steps1, steps2) == (1, 2) and 1e-9 < gap2 < gap1 / 4, (gap1, gap2)  # 2 gap2 < gap1 below
    mu, steps = metrics.fit_mu(target, f, log_p0=log_p, max_steps=2, accept=2 * gap2)
    assert steps == 2 and torch.equal(mu, mu2)
    with pytest.raises(ValueError, match=f'did not converge in 2 Newton steps .largest gap {gap2:.2e}.'):
        metrics.fit_mu(target, f, log_p0=log_p, max_steps=2, accept=gap2 / 2)


def metrics_by_hand(lm, energy, row, P):
    """rep-2, tr-3, div, coh, logp and the energy of one sequence (a list of ids, P of prefix), from
    their definitions (Ji et al., ICLR 2024) in float64, the LM and the energy run on that row alone."""
    y = row[P:]

    def rep(n):  # the share of y's n-grams that repeat an earlier one: 1 - distinct / all
        grams = [tuple(y[i:i + n]) for i in range(len(y) - n + 1)]
        return 1 - len(set(grams)) / len(grams)
    tr = sum(row[t] in row[max(0, t - 3):t] for t in range(P, len(row))) / len(y)
    lm64, ids = copy.deepcopy(lm).double(), torch.tensor([row])
    h = lm64.hidden(ids)[0]
    coh = F.cosine_similarity(h[:P].mean(0), h[P:].mean(0), dim=0).item()
    logp = torch.log_softmax(lm64(ids)[0][0], -1)
    logp = sum(logp[t - 1, row[t]].item() for t in range(P, len(row))) / len(y)
    div = (1 - rep(2)) * (1 - rep(3)) * (1 - rep(4))
    return [rep(2), tr, div, coh, logp, energy(ids, P).item()]  # the energy computes in float32


def test_metric_energy_scores_like_an_energy():
    """E = mu . f row by row, f as metrics_by_hand computes it; score_continuations (the LM's prompt
    states computed once, shared by the continuations, also with a prompt longer than the prefix as
    Eq. 5 has) gives the numbers of scoring each whole sequence."""
    lm, mu = tiny_gpt(), [0.5, -1.0, 0.7, 2.0, 0.3, 0.9]
    me = metrics.MetricEnergy(['rep-2', 'tr-3', 'div', 'coh', 'logp'], lm,
                              {'B': rand_energy(11, block_size=32)}, mu=torch.tensor(mu)).eval()
    rows = [[1, 2, 3, 4, 5, 6, 5, 2, 1, 2, 1, 2, 7, 8],  # repeated 2- and 3-grams; tr hits the prefix
            [0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3],
            [9, 8, 7, 6, 5, 4, 10, 0, 1, 2, 10, 3, 8, 7],  # a token 4 back: outside tr-3's window
            [5, 5, 1, 1, 2, 2, 4, 6, 4, 6, 8, 4, 6, 8]]
    f = [metrics_by_hand(lm, me.energies['B'], row, 6) for row in rows]
    assert len({tuple(r[:3]) for r in f}) == 4  # the token metrics tell the rows apart
    ref = torch.tensor([sum(m * v for m, v in zip(mu, r)) for r in f], dtype=torch.float64)
    torch.testing.assert_close(me(torch.tensor(rows), 6), ref, atol=1e-5, rtol=0)
    g = torch.Generator().manual_seed(3)
    for prompt_len, prefix_len in ((6, 6), (8, 5)):
        prompts, tokens = (torch.randint(0, 11, (3, prompt_len), generator=g),
                           torch.randint(0, 11, (3, 5, 6), generator=g))
        full = torch.cat([prompts[:, None].expand(-1, 5, -1), tokens], 2).flatten(0, 1)
        shared = score_continuations(me, prompts, tokens, prefix_len, NULL, max_rows=4)
        torch.testing.assert_close(shared, score(me, full, prefix_len, NULL).view(3, 5), atol=1e-5, rtol=0)
        torch.testing.assert_close(me.features_shared(prompts, tokens, prefix_len, rows=4),
                                   me.features(full, prefix_len).view(3, 5, -1), atol=1e-5, rtol=0)
    assert me.num_params() == 6 + me.energies['B'].num_params()


def test_metric_energy_lives_on_its_lm_device():
    """mu is made on the LM's device, so that a MetricEnergy built on a GPU run scores there (the
    meta device stands in for a GPU here; before, mu stayed on the CPU and the metrics stage of the
    main job failed on an H100)."""
    with torch.device('meta'):
        lm = tiny_gpt()
    assert metrics.MetricEnergy(['tr-3', 'logp'], lm).mu.device.type == 'meta'
    assert metrics.MetricEnergy(['tr-3', 'logp'], lm, mu=torch.ones(2)).mu.device.type == 'meta'


def test_sample_log_weights_scores_a_shared_energy_once():
    """share_energies gives a metric energy the module listed beside it that has the same weights
    as its energy metric (METRICS+BIT and BIT); sample_log_weights then runs it once per sequence,
    and the log-weights equal those of separate copies. An energy metric with other weights stays."""
    lm, V, L, n = tiny_gpt(), 11, 4, 6
    bit, mu = rand_energy(V, block_size=32), torch.tensor([0.5, -0.7, 1.3])
    agg = metrics.MetricEnergy(['tr-3', 'logp'], lm, {'B': rand_energy(V, block_size=32)},
                               mu=mu).eval()  # a copy
    other = metrics.MetricEnergy(['tr-3', 'logp'], lm, {'O': rand_energy(V, seed=5, block_size=32)},
                                 mu=mu).eval()
    prompts = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(1))
    draw = lambda: sample_log_weights(lm, [bit, agg, other], prompts, L, n, NULL,
                                      torch.Generator().manual_seed(0), max_rows=8)
    ref = draw()
    share_energies({'BIT': bit, 'METRICS+BIT': agg, 'OTHER': other})
    assert agg.energies['B'] is bit and other.energies['O'] is not bit
    rows = []
    bit.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].size(0)))
    torch.testing.assert_close(draw(), ref, atol=1e-6, rtol=0)
    assert sum(rows) == 3 * n


@pytest.fixture(scope='module')
def metric_run(lm_ckpt, eval_ckpts, tmp_path_factory):
    """metric_ebm.py on the fox corpus: mu fitted on the selection split, the table on test. A pool
    of 32 samples: with 16, 4 of 16 seeds (and so the GPU's random stream) drew pools whose metrics
    were collinear or could not reach real text's."""
    out = tmp_path_factory.mktemp('metric_ebm')
    res = metric_ebm.main(['--lm', lm_ckpt, '--metrics', 'tr-4,coh,logp', '--prefix_len', str(EVAL_P),
                           '--gen_len', str(EVAL_L), '--prefixes', '12', '--pool', '32',
                           '--check_prefixes', '4', '--energy_metric', f"BIT={eval_ckpts['bit']}",
                           '--table', '--table_prefixes', '4', '--compare', f"BIT={eval_ckpts['bit']}",
                           '--n', '4', '--chunk', '4', '--out_dir', str(out), *CPU])
    return out, res


def test_metric_ebm_cli(metric_run, lm_ckpt, tmp_path):
    """On the split it is fitted on, the joint moments equal real text's; the energy loads where
    any energy does and estimate_ppl.py reports its joint PPL and the predicted gain."""
    out, res = metric_run
    sel = res['energy']['splits']['select']
    assert (sel['joint'] == pytest.approx(sel['real'], abs=1e-8)
            and sel['lm'] != pytest.approx(sel['real'], abs=1e-3))
    assert (set(res['energy']['splits']) == {'select', 'val', 'test'}
            and sel['predicted_gain_nats_per_token'] > 0)
    agg = res['energy_aggregate']['splits']['select']  # the metrics and the BIT energy, from the same samples
    assert (agg['metrics'] == ['tr-4', 'coh', 'logp', 'E:BIT']
            and agg['joint'] == pytest.approx(agg['real'], abs=1e-8))
    assert agg['lm'][:3] == pytest.approx(sel['lm']) and agg['real'][:3] == pytest.approx(sel['real'])
    both, _ = load_any_energy(str(out / 'energy_aggregate.pt'), lm_ckpt)
    assert both.mu.tolist() == pytest.approx(res['energy_aggregate']['mu']) and list(both.energies) == ['BIT']
    rows = res['table']['rows']
    assert {'real', 'LM (t = 1)', 'greedy', 'JOINT BIT (n = 4)', 'JOINT METRICS (n = 4)',
            'JOINT METRICS+BIT (n = 4)'} <= set(rows)
    assert rows['real']['gap'] == [0, 0, 0] and rows['greedy']['gap'] != [0, 0, 0]
    me, _ = load_any_energy(str(out / 'energy.pt'), lm_ckpt)
    assert me.mu.tolist() == pytest.approx(res['energy']['mu'])
    ppl = estimate_ppl.main(['--lm', lm_ckpt, '--energy', f"METRICS={out / 'energy.pt'}", '--splits', 'test',
                             '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--max_prefixes', '5',
                             '--num_samples', '8', '--calib_prefixes', '0',
                             '--out', str(tmp_path / 'p.json'), *CPU])
    row = next(r for r in ppl['rows'] if r['model'] == 'JOINT METRICS')
    assert row['predicted_gain'] > 0 and 'KL(joint || LM)' in (tmp_path / 'p.txt').read_text()


def test_metric_ebm_refuses(metric_run, lm_ckpt, eval_ckpts, tmp_path):
    """A metric energy with another LM; a metric real text never moves from its floor (no repeated
    bigram in 4 characters of the fox corpus: rep-2 = 0, which no weighting of samples reaches)."""
    out, _ = metric_run
    with pytest.raises(ValueError, match='fitted to another LM'):
        load_any_energy(str(out / 'energy.pt'), eval_ckpts['lm2'])
    with pytest.raises(ValueError, match="metric rep-2: real text's mean 0 is outside"):
        metric_ebm.main(['--lm', lm_ckpt, '--metrics', 'rep-2', '--prefix_len', str(EVAL_P),
                         '--gen_len', str(EVAL_L), '--prefixes', '12', '--pool', '16',
                         '--out_dir', str(tmp_path / 'm'), *CPU])
    assert not (tmp_path / 'm').exists()


def test_an_energy_checkpoint_names_its_loader(metric_run, lm_ckpt, eval_ckpts, tmp_path):
    """energy.load_any_energy builds a metric energy through the module its checkpoint names
    (energy.py's interface), one written before that key through 'metric_energy''s, with the same
    energies; a loader outside this repo's extensions/ is refused, an LM as before."""
    out, _ = metric_run
    ckpt = load_checkpoint(str(out / 'energy_aggregate.pt'))
    assert ckpt['loader'] == 'extensions.metrics'
    new, _ = load_any_energy(str(out / 'energy_aggregate.pt'), lm_ckpt)
    del ckpt['loader']
    torch.save(ckpt, tmp_path / 'old.pt')
    old, _ = load_any_energy(str(tmp_path / 'old.pt'), lm_ckpt)
    x = torch.randint(0, new.config.vocab_size, (5, EVAL_P + EVAL_L),
                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(old(x, EVAL_P), new(x, EVAL_P)) and list(old.energies) == ['BIT']
    for loader in ('os', 'extensions.nothing', 'extensions.metrics.os', 'extensions/metrics', 'job.claims'):
        torch.save(dict(ckpt, loader=loader), tmp_path / 'bad.pt')
        with pytest.raises(ValueError, match=f"names the loader '{re.escape(loader)}', not a module of"):
            load_any_energy(str(tmp_path / 'bad.pt'), lm_ckpt)
    with pytest.raises(ValueError, match="holds a 'lm' model, not an energy"):
        load_any_energy(lm_ckpt, lm_ckpt)
    assert isinstance(load_any_energy(eval_ckpts['bit'], lm_ckpt)[0], Energy)


def test_sample_cli_with_a_metric_energy(metric_run, lm_corpus, lm_ckpt, tmp_path):
    """sample.py draws from the metric energy's joint model (Algorithm 1, Table 3, A.1) as from any
    energy: the energy it records for each real continuation is mu . f of that window."""
    out, _ = metric_run
    rep = sample.main(sample_argv(lm_ckpt, str(out / 'energy.pt'), tmp_path / 's.json'))
    me, _ = load_any_energy(str(out / 'energy.pt'), lm_ckpt)
    data = load_split(lm_corpus, 'test', load_meta(lm_corpus))
    x = window_tokens(data, windows(data, EVAL_P, EVAL_L, max_windows=3), EVAL_P + EVAL_L)
    for r, row in zip(rep['samples'], x):
        assert float(me(row[None], EVAL_P).detach()) == pytest.approx(r['gold_energy'], abs=1e-6)
        assert math.isfinite(r['joint_energy']) and len(r['next_tokens']) == 3


def test_tailr_loss_float64_reference():
    """TaiLr's loss and gradient against the closed form in float64: -mean(w log p) with w = p /
    (gamma + (1 - gamma) p) constant, so d loss / d logits = -w (onehot - softmax) / N; gamma = 0
    is cross-entropy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (2, 3), generator=g)
    for gamma in (0.0, 0.3, 1.0):
        logits.grad = None
        train_lm.tailr_loss(logits, y, gamma).backward()
        sm = torch.softmax(logits.detach().double(), -1)
        p = sm.gather(-1, y[..., None]).squeeze(-1)
        w = p / (gamma + (1 - gamma) * p)
        ref_loss = -(w * p.log()).mean()
        ref_grad = -w[..., None] * (F.one_hot(y, 5).double() - sm) / 6
        assert train_lm.tailr_loss(logits, y, gamma).item() == pytest.approx(ref_loss.item(), abs=1e-6)
        torch.testing.assert_close(logits.grad.double(), ref_grad, atol=1e-6, rtol=0)
    ce = F.cross_entropy(logits.detach().view(-1, 5), y.view(-1))
    assert train_lm.tailr_loss(logits.detach(), y, 0.0).item() == pytest.approx(ce.item(), abs=1e-6)


def record_first_step(monkeypatch):
    """Patches train_lm so that its first training step's batches (x, y) and gradients (by
    parameter name, before clipping) land in the dict returned."""
    first, batches = {}, []
    make_batch, train_step = train_lm.make_batch, train_lm.train_step

    def recording_batch(*a, **k):
        batches.append(make_batch(*a, **k))
        return batches[-1]

    def recording_step(model, *a):
        n = len(batches)
        loss = train_step(model, *a)
        if not first:
            first.update(batches=[(x.cpu(), y.cpu()) for x, y in batches[n:]],  # to compare on the CPU
                         grads={name: p.grad.cpu() for name, p in model.named_parameters()})
        return loss
    monkeypatch.setattr(train_lm, 'make_batch', recording_batch)
    monkeypatch.setattr(train_lm, 'train_step', recording_step)
    return first


def token_weighted_grads(lm, x, y, weight):
    """Gradients of -mean_t w_t log p(y_t | x_<t), w_t = weight(p) held constant, p = p(y_t | x_<t)."""
    lm.zero_grad()
    logp = torch.log_softmax(lm(x)[0].float(), -1).gather(-1, y[..., None]).squeeze(-1)
    (-(weight(logp.detach().exp()) * logp).mean()).backward()
    return {name: p.grad.clone() for name, p in lm.named_parameters()}


def test_tailr_fine_tuning_cli(lm_corpus, lm_ckpt, tmp_path, monkeypatch):
    """train_lm.py --objective tailr fine-tunes an LM into an LM checkpoint the later stages load;
    its first step's gradient is TaiLr's (Ji et al., ICLR 2023: the log-likelihood of each token
    weighted by p / (gamma + (1 - gamma) p), stop-gradient), recomputed here, and not MLE's."""
    out, first = str(tmp_path / 'tailr'), record_first_step(monkeypatch)
    res = train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--objective', 'tailr', '--gamma', '0.5',
                         '--init_from', lm_ckpt, '--max_iters', '4', '--eval_interval', '2', *TRAIN_FLAGS])
    lm, ck = load_lm(os.path.join(out, 'best.pt'))
    assert ck['objective'] == 'tailr' and ck['gamma'] == 0.5 and res['iters'] == 4
    [(x, y)] = first['batches']
    init, _ = load_lm(lm_ckpt)
    tailr = token_weighted_grads(init, x, y, lambda p: p / (0.5 + 0.5 * p))
    mle = token_weighted_grads(init, x, y, torch.ones_like)
    assert first['grads'].keys() == tailr.keys()
    for name, g in first['grads'].items():
        torch.testing.assert_close(g, tailr[name], rtol=1e-4, atol=1e-7, msg=name)
    flat = lambda grads: torch.cat([t.flatten() for t in grads.values()])
    assert (flat(tailr) - flat(mle)).norm() > 0.5 * flat(mle).norm()  # 0.93: the test tells them apart
    for bad, match in ((['--gamma', '0.5'], 'go together'),
                       (['--objective', 'tailr', '--gamma', '2'], 'gamma')):
        with pytest.raises(ValueError, match=match):
            train_lm.main(['--data_dir', lm_corpus, '--out_dir', str(tmp_path / 'x'), *bad, *TRAIN_FLAGS])


# =============================================================================
# ==== EXO and addition (Ji et al., ICML 2024; issue 31): EXO's loss against exact enumeration (its gradient
#      tends to the reverse KL's, its minimiser is the joint model), a corpus with a known answer,
#      accuracy against brute force ====

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


@pytest.mark.parametrize('loss', ['exo', 'dpo'])
def test_exo_gradient_tends_to_the_kl_gradient(loss):
    """The talk's analysis of EXO (Ji et al., ICML 2024): with K samples of pi_sft per prefix, the
    gradient of L_exo tends to that of the reverse KL(pi_theta || pi*), pi* ∝ pi_sft exp(-E)
    (the joint model, beta_pi = beta_r = 1), and L_dpo-rw's to the forward KL(pi* || pi_theta)'s, as
    K grows; exact gradients by enumeration in float64, K-sample ones averaged over 2^16 samples."""
    lsft, E, theta, logpi = exo_toy()
    lt, lstar = logpi(*theta), F.log_softmax(lsft - E, -1)
    kl = (lt.exp() * (lt - lstar)).sum() if loss == 'exo' else (lstar.exp() * (lstar - lt)).sum()
    exact = flat_grad(kl, theta)
    errors = []
    for K in (4, 64, 4096):
        idx = torch.multinomial(lsft.exp().expand(2 ** 16 // K, -1), K, replacement=True,
                                generator=torch.Generator().manual_seed(K))
        lt = logpi(*theta)
        est = flat_grad(exo.exo_loss(lt[idx], lsft[idx], -E[idx], loss=loss).mean(), theta)
        errors.append(((est - exact).norm() / exact.norm()).item())
    assert errors[0] > 0.3 and errors[0] > errors[1] > errors[2], errors  # biased at small K
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


def test_exo_step_loss_float64_reference():
    """exo_step_loss on a GPT: K samples of pi_sft per prefix (redrawn from the same generator),
    their log-probs under both LMs and energies recomputed in float64, the loss by the formula."""
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
    args = types.SimpleNamespace(beta_pi=1.5, beta_r=0.7, loss='exo')
    got = exo.exo_step_loss(policy, sft, energy, prefix, 4, 6, args, torch.Generator().manual_seed(5))
    y = sft.generate(prefix, 6, num_samples=4, generator=torch.Generator().manual_seed(5))[0]
    x = torch.cat([prefix[:, None].expand(-1, 4, -1), y], 2).flatten(0, 1)
    lp = lambda m: logprobs64(m, x[:, :-1])[:, 4:].gather(-1, x[:, 5:, None]).squeeze(-1).sum(1).view(3, 4)
    with torch.no_grad():
        r = -energy(x, 5).double().view(3, 4)  # E itself is float32 (Energy.project)
    f, g = np.asarray(1.5 * (lp(policy) - lp(sft))), np.asarray(r / 0.7)
    pf, pr = (np.exp(v - v.max(1, keepdims=True)) for v in (f, g))
    pf, pr = pf / pf.sum(1, keepdims=True), pr / pr.sum(1, keepdims=True)
    assert abs(got.item() - (pf * np.log(pf / pr)).sum(1).mean()) < 1e-5


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
    for kl in ('kl_reverse', 'kl_forward'):
        assert got[f'{kl}_low'] <= got[f'{kl}_high']
        for end in ('low', 'high'):
            assert abs(got[f'{kl}_{end}'] - exact[kl]) < 0.02, (kl, got, exact)


def test_exo_policy_forward_in_eval_mode():
    """With dropout in the LM, pi_theta's forward runs in eval mode in the loss and the estimates:
    at step 0 (pi_theta = pi_sft) p_f is uniform, so L_exo = KL(uniform || p_r) exactly (float64
    reference), and the KL to the base LM is 0; the policy's mode is restored after each."""
    sft, _, energy, prefix = exo_kl_case(dropout=0.5)
    policy = copy.deepcopy(sft).train()
    args = types.SimpleNamespace(beta_pi=1.0, beta_r=1.0, loss='exo')
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


def test_addition_problems_are_sums_in_disjoint_splits():
    """Every document is `a+b=c` with c = a + b, zero-padded to fixed widths; no problem (nor its
    mirror b+a) is in two splits or twice in one; --chain 1 makes every digit pair sum to 9."""
    docs = addition_prepare.make_problems(dict(train=3000, select=100, val=100, test=100), 3, 0.3, seed=0)
    keys = []
    for split, lines in docs.items():
        for line in lines:
            m = re.fullmatch(r'(\d{3})\+(\d{3})=(\d{4})', line)
            assert m and int(m[1]) + int(m[2]) == int(m[3]), line
            keys.append((min(int(m[1]), int(m[2])), max(int(m[1]), int(m[2]))))
    assert len(keys) == 3300 == len(set(keys))
    chain = addition_prepare.make_problems(dict(train=5, select=1, val=1, test=1), 4, 1.0, seed=0)
    assert all(line.endswith('=09999') for lines in chain.values() for line in lines)
    with pytest.raises(ValueError, match='too many'):
        addition_prepare.make_problems(dict(train=30, select=1, val=1, test=1), 1, 0.3, seed=0)


@pytest.fixture(scope='module')
def addition_run(tmp_path_factory):
    """A 3-digit addition corpus, an LM of 30 steps on it and a random BIT energy for that LM."""
    d = tmp_path_factory.mktemp('addition')
    addition_prepare.main(['--out_dir', str(d / 'data'), '--digits', '3', '--train', '3000', '--select', '64',
                           '--val', '64', '--test', '64', '--quiet'])
    train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(d / 'lm'), '--max_iters', '30',
                   '--eval_interval', '30', '--final_eval', '0', '--lr', '3e-3', *TRAIN_FLAGS])
    lm = str(d / 'lm' / 'best.pt')
    meta = dict(load_meta(str(d / 'data')), data_dir=str(d / 'data'))
    torch.manual_seed(0)
    energy = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        energy.head.weight.normal_(0.0, 2.0)
    save_checkpoint(energy_state(energy, lm, meta), str(d / 'bit.pt'))
    zero = build_energy('bit', lm, meta, sizes=dict(n_layer=1, n_head=2, n_embd=16))
    save_checkpoint(energy_state(zero, lm, meta), str(d / 'zero.pt'))
    return d, lm


def test_addition_windows_are_the_problems(addition_run):
    """The pipeline's windows (data.windows, prefix 2N+2 and continuation N+2) are exactly the
    problems: `a+b=` then the sum and the end of text; addition_eval reads that layout back."""
    d, _ = addition_run
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'test', meta)
    tok = load_tokenizer(meta)
    offsets = windows(data, 8, 5)
    assert len(offsets) == 64
    for o in offsets:
        text = tok.decode(data[o:o + 13].tolist())
        assert re.fullmatch(r'\d{3}\+\d{3}=\d{4}' + re.escape(EOT), text), text
    assert addition_eval.answer_layout(data, meta) == (8, 5)


def test_addition_eval_against_brute_force(addition_run, tmp_path):
    """The base LM's greedy answers and its probability of the correct sums, recomputed by a
    float64 forward; with E = 0 the joint model's probability is the LM's (log Z = 0 exactly) and
    Algorithm 1's scores are those of plain LM samples."""
    d, lm_path = addition_run
    out = tmp_path / 'acc.json'
    addition_eval.main(['--lm', lm_path, '--energy', str(d / 'zero.pt'), '--ns', '1,4',
                        '--num_prefixes', '16',
                        '--extra_lm', f'TWIN={lm_path}', '--out', str(out)])
    rows = {(r['model'], r['method']): r for r in json.loads(out.read_text())['rows']}
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'test', meta)
    x = window_tokens(data, windows(data, 8, 5, max_windows=16), 13)
    lm = load_lm(lm_path)[0]
    seq = x[:, :8]
    for _ in range(5):
        seq = torch.cat([seq, logprobs64(lm, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    hit = seq[:, 8:] == x[:, 8:]
    assert rows['BASE LM', 'greedy']['exact'] == pytest.approx(hit.all(1).double().mean().item())
    assert rows['BASE LM', 'greedy']['digit'] == pytest.approx(hit[:, :4].double().mean().item())
    lp = logprobs64(lm, x[:, :-1])[:, 7:].gather(-1, x[:, 8:, None]).squeeze(-1).sum(1)
    p = lp.exp().mean().item()
    assert rows['BASE LM', 'sampled']['p_correct'] == pytest.approx(p, rel=1e-5)
    assert rows['TWIN', 'greedy']['exact'] == rows['BASE LM', 'greedy']['exact']
    for n in (1, 4):
        joint = rows['JOINT', f'Algorithm 1, n = {n}']
        assert joint['p_correct_low'] == pytest.approx(p, rel=1e-5) == joint['p_correct_high']
        # E = 0: a / (a + b) = P(c) / (P(c) + the share of the 4 samples unlike c), not P(c) itself
        assert 0 < joint['p_correct'] <= 1
        assert joint['exact'] <= joint['oracle_exact'] and joint['digit'] <= joint['oracle_digit']


def test_p_correct_with_the_known_term_exact():
    """logp_correct_known against a / (a + b) by hand: b the mean of exp(-E) over the samples
    unlike the answer (0 where every sample is the answer); where Eq. 4 puts all of Z on samples
    that miss the answer and the energy is sharp, its estimate exceeds 1, this one cannot."""
    gold = torch.tensor([[1, 2], [3, 4]])
    x = torch.tensor([[[1, 2], [2, 2], [0, 2]], [[3, 4], [3, 4], [3, 4]]])  # (2 problems, 3 samples, 2)
    E = torch.tensor([[0.5, 2.0, -1.0], [0.3, 0.3, 0.3]], dtype=torch.float64)
    log_a = torch.tensor([math.log(0.6) - 0.5, math.log(0.9) - 0.3], dtype=torch.float64)
    b = (math.exp(-2.0) + math.exp(1.0)) / 3
    want = [0.6 * math.exp(-0.5) / (0.6 * math.exp(-0.5) + b), 1.0]
    got = addition_eval.logp_correct_known(log_a, x, E, gold).exp().tolist()
    assert got == pytest.approx(want, rel=1e-12)
    # a sharp energy, the answer absent from the samples: Eq. 4's T_n gives P far above 1
    x_miss, E_miss = x[:1, 1:], torch.tensor([[8.0, 9.0]], dtype=torch.float64)
    log_a = torch.tensor([math.log(0.05)], dtype=torch.float64)  # P_LM(c) = 0.05, E(c) = 0
    assert (log_a - logz_bounds(-E_miss)[0]).exp().item() > 100
    assert 0.9 < addition_eval.logp_correct_known(log_a, x_miss, E_miss, gold[:1]).exp().item() <= 1


def hand_built_decoding():
    """Two problems, continuations of 2 tokens A, B, C (the last a stand-in for the end of text),
    their log P_LM and energies chosen so that majority vote, log-prob reranking and the joint mode
    pick different continuations. gold: B, then C; (exact, digit) of A B C: (0 1) (1 1) (0 0), then
    (0 0) (0 0) (1 1)."""
    A, B, C = [1, 2], [1, 3], [4, 2]
    x = torch.tensor([[A, B, B, A, C], [C, C, B, A, B]])
    logp = torch.tensor([[-3., -1, -1, -3, -0.5], [-2., -2, -4, -1, -4]], dtype=torch.float64)
    E = torch.tensor([[-1., 0, 0, -1, 3], [-3., -3, 0, 2, 0]], dtype=torch.float64)
    return x, logp, E, torch.tensor([B, C])


def test_addition_decoders_on_hand_built_samples():
    """Each decoder's pick among the first n, known by hand (hand_built_decoding). Problem 0 at
    n = 5: majority vote A (A and B tie at 2: the first to occur), reranking C (argmax log P_LM),
    the joint mode B (argmax log P_LM - E: -2, -1, -3.5; argmax -E alone would be A), the oracle B;
    at n = 3 majority B. Problem 1: majority C (its own counts; counted over both problems B would
    win), reranking A, mode C."""
    x, logp, E, gold = hand_built_decoding()
    lm = addition_eval.lm_decoders(x, logp, gold, [1, 3, 5])
    joint = addition_eval.joint_decoders(x, logp, E, gold, [1, 3, 5], torch.Generator().manual_seed(0))
    want = {'majority_5': [(0, 1), (1, 1)], 'rerank_5': [(0, 0), (0, 0)], 'oracle_5': [(1, 1), (1, 1)],
            'majority_3': [(1, 1), (1, 1)], 'rerank_3': [(1, 1), (1, 1)], 'mode_5': [(1, 1), (1, 1)],
            'mode_3': [(1, 1), (1, 1)], 'majority_1': [(0, 1), (1, 1)], 'rerank_1': [(0, 1), (1, 1)],
            'oracle_1': [(0, 1), (1, 1)], 'mode_1': [(0, 1), (1, 1)], 'a1_1': [(0, 1), (1, 1)]}
    cols = {**lm, **joint}
    for key, pairs in want.items():
        got = list(zip(cols[f'{key}_exact'].tolist(), cols[f'{key}_digit'].tolist()))
        assert got == [(float(e), float(d)) for e, d in pairs], (key, got)
    ids, first = addition_eval.distinct(x)  # each sample's first repeat in its problem, by flat index
    assert len(first) == 6 and first[ids.flatten()].tolist() == [0, 1, 1, 0, 4, 5, 5, 7, 8, 7]


def test_addition_algorithm_1_resamples_by_energy():
    """Algorithm 1 among the first 5 of problem 0 (hand_built_decoding), over 4,000 independent
    draws: B (E = 0, twice) is picked with probability 2 / (2 e + 2 + e^-3) = 0.267 and C with
    e^-3 / (...) = 0.0067 (Deng et al. 2020, Algorithm 1: ∝ exp(-E), counted by multiplicity)."""
    x, logp, E, gold = hand_built_decoding()
    N = 4000
    cols = addition_eval.joint_decoders(x[:1].expand(N, -1, -1), logp[:1].expand(N, -1), E[:1].expand(N, -1),
                                        gold[:1].expand(N, -1), [5], torch.Generator().manual_seed(0))
    w = torch.tensor([math.e, 1, 1, math.e, math.exp(-3)])
    for got, p in ((cols['a1_5_exact'].mean().item(), (w[1] + w[2]) / w.sum()),
                   (1 - cols['a1_5_digit'].mean().item(), w[4] / w.sum())):
        assert abs(got - p) < 4 * math.sqrt(p * (1 - p) / N), (got, p)


def test_addition_decoders_against_brute_force(addition_run, tmp_path, monkeypatch):
    """The decoders' rows of addition_eval.main with a random BIT energy, recomputed from the
    samples it drew: log P_LM by a float64 forward, E of every sample (none skipped as a
    repeat), majority vote by collections.Counter (ties: first encountered), reranking, the
    joint mode and the oracle by Python loops over the first n."""
    d, lm_path = addition_run
    drawn = collections.defaultdict(list)
    lm_columns = addition_eval.lm_columns

    def record(lm, pre, gold, ns, top_k, g):
        out, samples = lm_columns(lm, pre, gold, ns, top_k, g)
        drawn[id(lm)].append((pre, gold, *samples))
        return out, samples

    monkeypatch.setattr(addition_eval, 'lm_columns', record)
    out, png = tmp_path / 'acc.json', tmp_path / 'acc.png'
    plot = ['--plot', str(png)] if importlib.util.find_spec('matplotlib') else []  # CI has no matplotlib
    addition_eval.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--ns', '1,4', '--num_prefixes', '16',
                        '--batch', '8', '--out', str(out), '--quiet'] + plot)
    rows = {(r['model'], r['method']): r for r in json.loads(out.read_text())['rows']}
    pre, gold, x, logp = (torch.cat(t) for t in zip(*next(iter(drawn.values()))))
    B, m, L = x.shape
    seq = torch.cat([pre.repeat_interleave(m, 0), x.flatten(0, 1)], 1)
    lp = logprobs64(load_lm(lm_path)[0], seq[:, :-1])[:, 7:].gather(-1, seq[:, 8:, None]).sum((1, 2))
    lp = lp.view(B, m)
    assert torch.allclose(logp, lp, atol=1e-4)
    energy = load_any_energy(str(d / 'bit.pt'), lm_path, 'cpu')[0]
    E = score_continuations(energy, pre, x, 8, contextlib.nullcontext())
    hit = x == gold[:, None]
    score = dict(exact=hit.all(-1).double(), digit=hit[..., :-1].double().mean(-1))  # (B, m) each
    for n in (1, 4):
        picks = dict(majority=[], rerank=[], mode=[])
        for b in range(B):
            cont = [tuple(c) for c in x[b, :n].tolist()]
            picks['majority'].append(cont.index(collections.Counter(cont).most_common(1)[0][0]))
            picks['rerank'].append(max(range(n), key=lambda i: lp[b, i].item()))
            picks['mode'].append(max(range(n), key=lambda i: lp[b, i].item() - E[b, i].item()))
        want = {(k, s): v[torch.arange(B), picks[k]].mean().item() for k in picks for s, v in score.items()}
        for model, method, k in (('BASE LM', 'majority vote', 'majority'),
                                 ('BASE LM', 'log-prob rerank', 'rerank'), ('JOINT', 'joint mode', 'mode')):
            for s in score:
                assert rows[model, f'{method}, n = {n}'][s] == pytest.approx(want[k, s]), (method, n, s)
        for s, v in score.items():
            oracle = v[:, :n].amax(1).mean().item()
            assert rows['BASE LM', f'oracle, n = {n}'][s] == pytest.approx(oracle)
            assert rows['JOINT', f'Algorithm 1, n = {n}'][f'oracle_{s}'] == pytest.approx(oracle)
            assert rows['JOINT', f'Algorithm 1, n = {n}'][s] <= oracle
    # the fixture's samples tell the decoders apart (per digit), so a swap of two of them fails (the
    # random energy's scale dwarfs log P_LM's here: a mode by -E alone is hand_built_decoding's case)
    assert len({want[k, 'digit'] for k in picks}) == 3, want
    assert not plot or png.stat().st_size > 0


def test_addition_and_exo_bad_input(addition_run, lm_ckpt, tmp_path):
    """Bad flags and a corpus that holds no problems stop the new scripts with one clear message."""
    d, lm_path = addition_run
    cases = [(addition_prepare.main, ['--digits', '0', '--out_dir', str(tmp_path / 'a')], '--digits 0'),
             (addition_prepare.main, ['--chain', '2', '--out_dir', str(tmp_path / 'a')], r'in \[0, 1\]'),
             (addition_eval.main, ['--lm', lm_path, '--ns', '1,x', '--out', str(tmp_path / 'e.json')],
              'comma-separated'),
             (addition_eval.main, ['--lm', lm_ckpt, '--out', str(tmp_path / 'e.json')],
              'fixed-length problems'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--K', '1'], '--K 1'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--beta_r', '0'], 'positive'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--logz_samples', '8', '--forward_samples', '9'], 'at most --logz_samples 8'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--K', '1000000'], 'at most 65,536'),
             # issue 40, items 1 and 7: sizes without a bound, --plot checked before --out is written
             (addition_prepare.main, ['--train', '1000000000', '--out_dir', str(tmp_path / 'a')],
              r'drawing 1,000,015,000 problems \(--train, --select, --val, --test\) needs .* GiB'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--plot', f'{UNWRITABLE}/a.png'],
              f'--plot {UNWRITABLE}/a.png: cannot write'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--plot', str(tmp_path)],
              f'--plot {tmp_path} is a folder'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--extra_lm', f'X={lm_path}', f'X={lm_ckpt}'],
              '--extra_lm: the name X is given twice'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'), '--ns', '1,100000000'],
              '--ns 100000000: at most 65,536'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--prefix_len', '8', '--gen_len', '5', '--batch_size', '100000000'],
              'a step of --batch_size 100000000 x --K 8 samples needs'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--resume'], '--resume: .*ckpt.pt does not exist'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--resume', '--force'], '--resume and --force contradict'),
             # issue 40: windows that cut across the 13-token problems of 3 digits
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--prefix_len', '10', '--gen_len', '5'],
              '--prefix_len 10 --gen_len 5 do not fit .* 13 tokens: pass --prefix_len 8 --gen_len 5'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x')],
              '--prefix_len 128 --gen_len 64 do not fit')]
    for main, argv, match in cases:
        with pytest.raises(ValueError, match=match):
            main(argv)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # not --out, not a folder of --out_dir


def test_exo_cli_writes_an_lm_that_every_script_loads(addition_run, tmp_path):
    """exo.py: best.pt is an LM checkpoint (load_lm), chosen on the selection split, whose exact
    PPL estimate_ppl.py reports beside the base LM's."""
    d, lm_path = addition_run
    out = tmp_path / 'exo'
    exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--prefix_len', '8', '--gen_len', '5',
              '--out_dir', str(out), '--K', '4', '--batch_size', '4', '--max_iters', '4',
              '--eval_interval', '2',
              '--eval_prefixes', '8', '--eval_samples', '4', '--logz_samples', '32', '--forward_samples', '8',
              '--lr', '1e-2', '--quiet'])
    res = json.loads((out / 'results.json').read_text())
    assert [c['iter'] for c in res['curve']] == [0, 2, 4]
    assert res['selected_by'] == 'kl_reverse_high'
    assert (res['logz_samples'], res['forward_samples']) == (32, 8)
    assert res['best']['select_kl_reverse_high'] == min(c['select_kl_reverse_high'] for c in res['curve'])
    assert res['curve'][0]['select_kl_to_base'] == 0  # pi_theta starts as the LM
    curve = [{k.removeprefix('select_'): v for k, v in c.items()} for c in res['curve']]
    for kl in curve + [*res['final'].values()]:  # both KLs to the joint model, each a range
        assert kl['kl_reverse_low'] <= kl['kl_reverse_high'] and kl['kl_forward_low'] <= kl['kl_forward_high']
    load_lm(str(out / 'best.pt'))
    kept = (out / 'best.pt').read_bytes()
    # not replaced
    with pytest.raises(ValueError, match='ckpt.pt exists: pass --resume to continue it, --force'):
        exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(out)])
    (out / 'results.json').unlink()  # best.pt without ckpt.pt or results: refused too, kept as it was
    (out / 'ckpt.pt').unlink()
    with pytest.raises(ValueError, match='best.pt already exist.*pass --force'):
        exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(out)])
    assert (out / 'best.pt').read_bytes() == kept
    hint = exo.resume_hint(['--lm', lm_path, '--energy', 'e', '--out_dir', str(out)])
    assert 'holds the best policy so far, but there is no' in hint and hint.endswith('--force')
    estimate_ppl.main(['--lm', lm_path, '--extra_lm', f"EXO={out / 'best.pt'}", '--splits', 'test',
                       '--prefix_len', '8', '--gen_len', '5', '--max_prefixes', '4', '--num_samples', '4',
                       '--calib_prefixes', '0', '--quiet', '--out', str(tmp_path / 'ppl.json')])
    rows = json.loads((tmp_path / 'ppl.json').read_text())['rows']
    assert {'BASE LM', 'EXO'} <= {r['model'] for r in rows}
    with pytest.raises(ValueError, match='unknown loss'):
        exo.exo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), loss='kl')


def test_exo_resume_is_exact_and_divergence_keeps_best(addition_run, tmp_path):
    """exo.py --resume (issue 40, item 1): 2 iterations, then resumed to 4, gives the weights, the
    curve and the results of 4 in one go; a flag that would change the run is refused, --max_iters
    left out is the checkpoint's; the Ctrl-C hint gives the command. --lr 1e30 stops with one line
    at the first non-finite loss, best.pt (iteration 0: the LM itself) intact."""
    d, lm_path = addition_run
    flags = ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--prefix_len', '8', '--gen_len', '5',
             '--K', '4', '--batch_size', '4', '--eval_interval', '2', '--eval_prefixes', '8',
             '--eval_samples', '4', '--logz_samples', '32', '--forward_samples', '8', '--lr', '1e-2',
             '--quiet']
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    exo.main([*flags, '--out_dir', one, '--max_iters', '4'])
    exo.main([*flags, '--out_dir', two, '--max_iters', '2'])
    hint = exo.resume_hint([*flags, '--out_dir', two, '--max_iters', '4'])
    assert f'{two}/ckpt.pt holds iteration 2 of 4' in hint and hint.endswith('--resume')
    for bad, match in ((['--lr', '0.5'], '--lr 0.5 contradicts .*ckpt.pt'),
                       (['--max_iters', '1'], '--max_iters 1 is below the 2 iterations')):
        with pytest.raises(ValueError, match=match):
            exo.main([*flags, '--out_dir', two, '--resume', *bad])
    exo.main([*flags, '--out_dir', two, '--max_iters', '4', '--resume'])
    a, b = (load_checkpoint(os.path.join(p, 'ckpt.pt')) for p in (one, two))
    assert a['iter_num'] == b['iter_num'] == 4
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    ra, rb = (json.loads(open(os.path.join(p, 'results.json')).read()) for p in (one, two))
    assert ra['curve'] == rb['curve'] and ra['final'] == rb['final'] and ra['best'] == rb['best']
    exo.main([*flags, '--out_dir', two, '--resume'])  # --max_iters left out: the checkpoint's 4, no step more
    assert load_checkpoint(os.path.join(two, 'ckpt.pt'))['iter_num'] == 4
    far = str(tmp_path / 'far')
    with pytest.raises(ValueError, match=r'the policy diverged at iteration 1 \(its loss nan.*lower --lr .*'
                                         r'best.pt \(iteration 0\) is intact'):
        exo.main([*flags, '--out_dir', far, '--max_iters', '4', '--lr', '1e30'])
    best, lm = load_checkpoint(os.path.join(far, 'best.pt')), load_checkpoint(lm_path)
    assert best['iter_num'] == 0 and all(torch.equal(best['model'][k], lm['model'][k]) for k in lm['model'])

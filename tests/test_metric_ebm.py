"""The talk's metric energy and TaiLr (Ji et al., ICLR 2024 and 2023): metrics on hand-made text,
moment matching against exact enumeration, the KL projection, metric_ebm.py end to end.
"""

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import estimate_ppl
from extensions import metric_ebm, metrics
import sample
import train_lm
from data import load_meta, load_split, window_tokens, windows
from energy import (ENERGY_LOADERS, Energy, load_any_energy, register_energy_loader, sample_log_weights,
                    score, score_continuations, share_energies)
from model import load_checkpoint, load_lm
from tests.common import (CPU, EVAL_L, EVAL_P, FP32, NULL, TRAIN_FLAGS, assert_clean_error,
                          enumerable_problem, rand_energy, run_scripts, sample_argv, tiny_gpt)


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


def test_moments_are_the_joint_models_in_closed_form():
    """metric_ebm.moments on a pool that is P_LM exactly (4 continuations drawn 4, 2, 1 and 1 times of 8:
    P_LM = 1/2, 1/4, 1/8, 1/8): the joint model p* ∝ P_LM exp(-mu . f) then has closed-form metric means
    and KL(p* || P_LM) (the predicted gain), which the self-normalised pool estimates equal exactly."""
    g = torch.Generator().manual_seed(0)
    f_items = torch.randn(4, 2, generator=g, dtype=torch.float64)  # 4 continuations x 2 metrics
    counts, p_lm = [4, 2, 1, 1], torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    pool = torch.cat([f_items[j].expand(c, -1) for j, c in enumerate(counts)])[None]  # (1, 8, 2)
    mu = torch.tensor([0.7, -1.3], dtype=torch.float64)
    p_star = p_lm * torch.exp(-f_items @ mu)
    p_star = p_star / p_star.sum()
    means, kl = metric_ebm.moments(torch.zeros(1, 2, dtype=torch.float64), pool, mu)
    assert abs(kl.item() - (p_star * (p_star / p_lm).log()).sum().item()) < 1e-12
    assert torch.allclose(torch.tensor(means['joint'], dtype=torch.float64), p_star @ f_items, atol=1e-12)
    assert torch.allclose(torch.tensor(means['lm'], dtype=torch.float64), p_lm @ f_items, atol=1e-12)


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
    draw = lambda: sample_log_weights(lm, [bit, agg, other], prompts, L, n, FP32,
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
                           '--gen_len', str(EVAL_L), '--num_prefixes', '12', '--fit_samples', '32',
                           '--check_prefixes', '4', '--energy_metric', f"BIT={eval_ckpts['bit']}",
                           '--table', '--table_prefixes', '4', '--compare', f"BIT={eval_ckpts['bit']}",
                           '--num_samples', '4', '--chunk', '4', '--out_dir', str(out), *CPU])
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
    ppl = estimate_ppl.main(['--lm', lm_ckpt, '--energy', f"METRICS={out / 'energy.pt'}", '--split', 'test',
                             '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--num_prefixes', '5',
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
                         '--gen_len', str(EVAL_L), '--num_prefixes', '12', '--fit_samples', '16',
                         '--out_dir', str(tmp_path / 'm'), *CPU])
    assert not (tmp_path / 'm').exists()


def test_an_energy_checkpoint_names_its_loader(metric_run, lm_ckpt, eval_ckpts, tmp_path):
    """energy.load_any_energy builds a metric energy through the loader extensions.metrics registered
    (energy.py's interface), one written before ckpt['loader'] as well, with the same energies; a
    kind nobody registered is refused with the module its checkpoint names, a second loader for a
    kind too; an LM as before."""
    out, _ = metric_run
    assert ENERGY_LOADERS['metric_energy'] is metrics.load
    ckpt = load_checkpoint(str(out / 'energy_aggregate.pt'))
    assert ckpt['loader'] == 'extensions.metrics'
    new, _ = load_any_energy(str(out / 'energy_aggregate.pt'), lm_ckpt)
    del ckpt['loader']
    torch.save(ckpt, tmp_path / 'old.pt')
    old, _ = load_any_energy(str(tmp_path / 'old.pt'), lm_ckpt)
    x = torch.randint(0, new.config.vocab_size, (5, EVAL_P + EVAL_L),
                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(old(x, EVAL_P), new(x, EVAL_P)) and list(old.energies) == ['BIT']
    torch.save(dict(ckpt, kind='other_energy', loader='extensions.other'), tmp_path / 'other.pt')
    with pytest.raises(ValueError, match="holds a 'other_energy' energy, whose loader no imported module "
                                         "registered: .* imports extensions.other"):
        load_any_energy(str(tmp_path / 'other.pt'), lm_ckpt)
    for kind in ('energy', 'metric_energy'):
        with pytest.raises(ValueError, match=f"an energy loader for kind '{kind}' is registered already"):
            register_energy_loader(kind, lambda *a: None)
    register_energy_loader('metric_energy', metrics.load)  # the same one again (a re-import): no change
    argv = ['estimate_ppl.py', '--lm', lm_ckpt, '--energy', f"METRICS={out / 'energy.pt'}", '--split',
            'test', '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--num_prefixes', '2',
            '--num_samples', '4', '--calib_prefixes', '0', *CPU]
    alone, plugged = run_scripts([[*argv, '--out', str(tmp_path / 'a.json')],
                                  ['-m', 'extensions.run', *argv, '--out', str(tmp_path / 'b.json')]])
    assert_clean_error(alone, "'metric_energy' energy", 'imports extensions.metrics')  # the method alone
    assert plugged.returncode == 0, plugged.stderr[-500:]
    assert 'JOINT METRICS' in {r['model'] for r in json.load(open(tmp_path / 'b.json'))['rows']}
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
    assert len(rep['samples']) == len(x) == 3
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

"""Training the energy (nce_train.py, Eq. 3): the losses with log ratios, truncated noise, what the LM
cannot see, DDP, the best energy on the selection split, the held-out gain.
The tests to read first are in test_all.py."""

import contextlib
import json
import math
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import load_meta, load_negatives, load_split, window_tokens
from energy import load_energy
from model import load_checkpoint, load_lm
import nce_train
import negatives

from test_all import ref_bounds, ref_enumerate, softplus64, tv, unigram_lm
from tests.common import BIGRAM, CPU, NCE_FLAGS, NEG_FLAGS, prepare_corpus, run_ddp_and_single


# =============================================================================
# ==== NCE: training the energy (nce_train.py, Eq. 3): the losses, truncated noise, what the LM cannot see,
#      DDP, resume, best on select ====


def held_out_log(out_dir):
    """{iter: the held-out evaluation's record} of an nce_train.py log.jsonl."""
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return {r['iter']: r for r in map(json.loads, f) if 'held_out_loss' in r}


def test_nce_loss_unknown_kind():
    with pytest.raises(ValueError, match="unknown NCE loss 'hinge'"):
        nce_train.nce_loss(torch.zeros(2), torch.zeros(2, 3), 'hinge')


def test_nce_loss_with_log_ratios():
    """The NCE logit -E + d, d = log P_LM - log q, in both losses vs float64 brute force; d = None
    is today's loss exactly; d_pos = +inf (a real continuation q cannot propose) is data with
    certainty: zero loss for that positive, finite gradients, no NaN."""
    g = torch.Generator().manual_seed(0)
    B, M = 5, 3
    e_pos, e_neg = (torch.randn(B, generator=g, dtype=torch.float64) * 3,
                    torch.randn(B, M, generator=g, dtype=torch.float64) * 3)
    d_pos, d_neg = (torch.randn(B, generator=g, dtype=torch.float64) * 2,
                    torch.randn(B, M, generator=g, dtype=torch.float64) * 2)
    for dtype in (torch.float64, torch.float32):
        ep, en = e_pos.to(dtype), e_neg.to(dtype)
        old_bin = (F.softplus(ep) + F.softplus(-en).mean(1)).mean()
        old_rank = F.cross_entropy(-torch.cat([ep[:, None], en], 1), torch.zeros(B, dtype=torch.long))
        old_acc = (ep[:, None] < en).float().mean()
        for d in ((None, None), (torch.zeros(B, dtype=dtype), torch.zeros(B, M, dtype=dtype))):
            loss, acc = nce_train.nce_loss(ep, en, 'binary', *d)
            assert torch.equal(loss, old_bin) and torch.equal(acc, old_acc)
            loss, acc = nce_train.nce_loss(ep, en, 'ranking', *d)
            assert (abs(loss.item() - old_rank.item()) <= 4 * torch.finfo(dtype).eps * old_rank.item()
                    and torch.equal(acc, old_acc))
    p, n, dp, dn = e_pos.tolist(), e_neg.tolist(), d_pos.tolist(), d_neg.tolist()
    ref_bin = sum(softplus64(p[b] - dp[b]) + sum(softplus64(dn[b][j] - n[b][j]) for j in range(M)) / M
                  for b in range(B)) / B
    ref_rank = 0.0
    for b in range(B):
        s = [dp[b] - p[b]] + [dn[b][j] - n[b][j] for j in range(M)]
        ref_rank += (max(s) + math.log(sum(math.exp(v - max(s)) for v in s)) - s[0]) / B
    ref_acc = sum(dp[b] - p[b] > dn[b][j] - n[b][j] for b in range(B) for j in range(M)) / (B * M)
    for kind, ref in (('binary', ref_bin), ('ranking', ref_rank)):
        loss, acc = nce_train.nce_loss(e_pos, e_neg, kind, d_pos, d_neg)
        assert abs(loss.item() - ref) < 1e-12 and abs(acc.item() - ref_acc) < 1e-7, kind
        assert abs(loss.item() - nce_train.nce_loss(e_pos, e_neg, kind)[0].item()) > 0.1  # d matters
    # row 0's real continuation is outside q's support: d_pos = +inf
    d_pos[0] = float('inf')
    for kind in ('binary', 'ranking'):
        ep, en = e_pos.clone().requires_grad_(), e_neg.clone().requires_grad_()
        loss, acc = nce_train.nce_loss(ep, en, kind, d_pos, d_neg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(ep.grad).all() and torch.isfinite(en.grad).all()
        assert ep.grad[0] == 0  # nothing to learn from a certain positive
        rows = torch.arange(1, B)
        rest = (nce_train.nce_loss(e_pos[rows], e_neg[rows], kind, d_pos[rows], d_neg[rows])[0].item()
                * (B - 1) / B)
        if kind == 'ranking':  # the whole row is certain: 0
            assert abs(loss.item() - rest) < 1e-12 and (en.grad[0] == 0).all()
        else:  # its negatives still count
            neg0 = sum(softplus64(dn[0][j] - n[0][j]) for j in range(M)) / M / B
            assert abs(loss.item() - rest - neg0) < 1e-12


def truncated_toy(top_k=2):
    """Two-token sequences over 4 tokens: P_LM(x1) P_LM(x2|x1) from a bigram table whose top-2
    mass after x1 depends on x1, q its per-step top-2 truncation (renormalised at each step, so
    P_LM/q varies across sequences), a random E* and P_data ∝ P_LM exp(-E*) on q's support.
    Returns float64 log P_LM, log q (-inf off the support) and log P_data over the 16 sequences."""
    first = torch.tensor([1.0, 0.6, -0.5, -1.2], dtype=torch.float64)
    lp1, lp2 = torch.log_softmax(first, 0), torch.log_softmax(torch.tensor(BIGRAM, dtype=torch.float64), 1)

    def truncate(lp):
        keep = lp >= lp.topk(top_k, -1).values[..., -1:]
        return torch.where(keep, lp - torch.logsumexp(lp.masked_fill(~keep, float('-inf')), -1, keepdim=True),
                           float('-inf'))

    log_p = (lp1[:, None] + lp2).flatten()
    log_q = (truncate(lp1)[:, None] + truncate(lp2)).flatten()
    e_star = torch.randn(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    log_data = torch.log_softmax((log_p - e_star).masked_fill(log_q == float('-inf'), float('-inf')), 0)
    return log_p, log_q, log_data, e_star


def nce_optimum(log_p, log_q, log_data, kind, corrected):
    """Minimise the exact expected NCE loss over a free energy per sequence of q's support, x+ ~
    P_data and x- ~ q, through nce_loss on every (x+, x-) pair weighted by P_data(x+) q(x-)."""
    sup = torch.isfinite(log_q)
    n = int(sup.sum())
    d = (log_p - log_q)[sup]
    w = (log_data[sup][:, None] + log_q[sup][None]).exp().flatten()  # (n*n,) pair weights
    i, j = torch.arange(n).repeat_interleave(n), torch.arange(n).repeat(n)
    E = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([E], lr=1, max_iter=1000, tolerance_grad=1e-13, tolerance_change=1e-16,
                            line_search_fn='strong_wolfe')

    def closure():
        opt.zero_grad()
        loss = sum(w[k] * nce_train.nce_loss(E[i[k]:i[k] + 1], E[j[k]].view(1, 1), kind,
                                             *((d[i[k]:i[k] + 1], d[j[k]].view(1, 1)) if corrected
                                               else ()))[0]
                   for k in range(n * n))
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    assert E.grad.abs().max() < 1e-7
    return E.detach(), sup


def test_nce_with_truncated_noise_recovers_the_energy():
    """With top-k noise q, NCE with the logit -E + log P_LM - log q has its optimum at P_LM exp(-E)
    = P_data on q's support (binary: self-normalised, E = E* + log Z*; ranking: up to a constant);
    with the logit -E alone it converges elsewhere: P_LM exp(-E) ∝ P_data P_LM / q."""
    log_p, log_q, log_data, e_star = truncated_toy()
    sup = torch.isfinite(log_q)
    assert int(sup.sum()) == 4 and (log_p - log_q)[sup].std() > 0.3  # P_LM/q not constant: truncation matters
    log_z_star = torch.logsumexp((log_p - e_star)[sup], 0)
    for kind in ('binary', 'ranking'):
        E, _ = nce_optimum(log_p, log_q, log_data, kind, corrected=True)
        model = torch.log_softmax(log_p[sup] - E, 0)
        assert (model - log_data[sup]).abs().max() < 1e-6, kind
        assert ((E - e_star[sup]) - (E - e_star[sup]).mean()).abs().max() < 1e-6  # E* up to a constant
        if kind == 'binary':  # and that constant is log Z*: P_LM exp(-E) is normalised
            assert (E - e_star[sup] - log_z_star).abs().max() < 1e-6
            assert abs(torch.logsumexp(log_p[sup] - E, 0).item()) < 1e-6
        E_u, _ = nce_optimum(log_p, log_q, log_data, kind, corrected=False)
        wrong = torch.log_softmax(log_p[sup] - E_u, 0)
        assert (wrong - torch.log_softmax(log_data[sup] + (log_p - log_q)[sup], 0)).abs().max() < 1e-6
        assert tv(wrong.exp(), log_data[sup].exp()) > 0.05, kind


def test_nce_learns_what_the_lm_cannot_see(tmp_path):
    """Every 8-character window is a random 4-letter word followed by a copy of it. The base LM is
    the exact unigram model, so real continuations and its samples look the same to it; the energy
    must learn the copy. 800 iterations of a tiny BIT: ~5 s."""
    rng = random.Random(0)
    words = lambda n: ''.join(w + w for w in (''.join(rng.choice('abcdefgh') for _ in range(4))
                                              for _ in range(n)))
    # 199 characters + end-of-text: every document is 200 tokens, so 8-token windows stay aligned
    data_dir = prepare_corpus(tmp_path, {f'doc{i:03d}.txt': words(25)[:-1] for i in range(120)},
                              extra=['--val_frac', '0.1', '--test_frac', '0.1'])
    lm_path = str(tmp_path / 'unigram.pt')
    logp_uni = unigram_lm(data_dir, lm_path)
    lm, _ = load_lm(lm_path)
    V = len(logp_uni)
    x = torch.randint(V, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (F.log_softmax(lm(x)[0], -1) - logp_uni).abs().max().item() < 1e-5
    for split in ('train', 'select', 'val'):
        negatives.main(['--lm', lm_path, '--split', split, '--out_dir', str(tmp_path / split),
                        '--prefix_len', '4', '--gen_len', '4', '--num_samples', '4', '--chunk', '256', *CPU])
    meta = load_meta(data_dir)
    val = load_split(data_dir, 'val', meta)
    neg = load_negatives(str(tmp_path / 'val'))
    pos = window_tokens(val, neg['offsets'], 8)
    whole = (pos != meta['eot_id']).all(1)  # windows aligned with the words, but the last of each document
    assert len(pos) == 300 and whole.sum() == 288 and torch.equal(pos[whole, :4], pos[whole, 4:])
    samples = torch.from_numpy(neg['tokens'].astype(np.int64))
    assert (samples == pos[:, None, :4]).all(-1).float().mean().item() < 0.01
    # to the LM, a real continuation is as likely as its own samples
    assert abs(logp_uni[pos[:, 4:]].sum(1).mean().item() - np.array(neg['logp']).mean()) < 0.2
    out = str(tmp_path / 'bit')
    res = nce_train.main(['--lm', lm_path, '--negatives', str(tmp_path / 'train'), '--held_out_negatives',
                          str(tmp_path / 'select'), '--out_dir', out, '--body', 'bit', '--n_layer', '2',
                          '--n_head', '2', '--n_embd', '32', '--batch_size', '32', '--max_iters', '800',
                          '--eval_interval', '800', '--log_interval', '100', '--lr', '3e-3',
                          '--min_lr', '3e-4', '--warmup_iters', '20', *CPU])
    assert res['held_out_prefixes'] == 150 and res['held_out_acc'] > 0.9, res
    assert res['held_out_e_pos'] < res['held_out_e_neg']
    # independently, with the saved energy: every (positive, stored negative) pair of the val split
    energy, ckpt = load_energy(os.path.join(out, 'ckpt.pt'), lm_path=lm_path)
    assert ckpt['iter_num'] == 800 and energy.kind == 'bit'
    with torch.no_grad():
        e_pos = energy(pos, 4)
        e_neg = energy(torch.cat([pos[:, None, :4].expand(-1, 4, -1), samples], 2).flatten(0, 1),
                       4).view(-1, 4)
    assert (e_pos[:, None] < e_neg).float().mean().item() > 0.9
    with pytest.raises(ValueError, match='residual of another LM'):
        load_energy(os.path.join(out, 'ckpt.pt'), lm_path=os.path.join(out, 'results.json'))


def test_nce_ddp_matches_single_process(lm_ckpt, fox_negatives, tmp_path):
    flags = ['--lm', lm_ckpt, '--negatives', fox_negatives['train'],
             '--held_out_negatives', fox_negatives['select'],
             '--max_iters', '6', '--eval_interval', '3', '--log_interval', '1', '--grad_accum', '2',
             '--dropout', '0.1', *NCE_FLAGS, '--lr', '1e-2']
    ddp, single, r1, ls = run_ddp_and_single('nce_train.py', nce_train.main, flags, tmp_path)
    assert max(ls.values()) - min(ls.values()) > 1e-3  # the energy trains: the curve is not flat
    with open(os.path.join(ddp, 'results.json')) as f:
        rd = json.load(f)
    assert rd['held_out_prefixes'] == r1['held_out_prefixes'] == 10
    for k in ('held_out_loss', 'held_out_acc', 'last_held_out_e_pos', 'last_held_out_e_neg'):
        assert abs(rd[k] - r1[k]) < 1e-4, k
    md, ms = (load_checkpoint(os.path.join(d, 'ckpt.pt'))['model'] for d in (ddp, single))
    assert md.keys() == ms.keys()
    for k in ms:
        assert (md[k] - ms[k]).abs().max().item() < 1e-4, k


@pytest.mark.parametrize('select', ['gain', 'loss'])
def test_nce_keeps_the_best_energy_on_val(lm_ckpt, fox_negatives, tmp_path, select):
    """best.pt holds the energy at the best held-out figure of --select (the joint gain, highest;
    the NCE loss, lowest): the same weights as a run stopped at that iteration (training is a
    function of the seed), with the --dropout given."""
    flags = ['--lm', lm_ckpt, '--negatives', fox_negatives['train'], '--select', select,
             '--held_out_negatives', fox_negatives['select'],
             '--eval_interval', '2', '--log_interval', '1', '--lr', '5e-2', '--lr_decay_iters', '12',
             '--dropout', '0.05', *NCE_FLAGS]  # an lr at which the held-out loss is lowest before the end
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    res = nce_train.main(['--out_dir', a, '--max_iters', '12', *flags])
    vals = {it: -ev['held_out_gain'] if select == 'gain' else ev['held_out_loss']
            for it, ev in held_out_log(a).items()}  # lower is better
    best_iter = min(vals, key=vals.get)
    assert len(set(vals.values())) == len(vals)  # no tie decides best_iter
    assert (sorted(vals) == list(range(2, 13, 2)) and res['best_iter'] == best_iter
            and res['best_value'] == vals[best_iter] and res['select'] == select)
    accs = {r['iter']: r['held_out_acc'] for r in map(json.loads, open(os.path.join(a, 'log.jsonl')))
            if 'held_out_acc' in r}
    assert res['held_out_acc'] == accs[best_iter] and res['last_held_out_acc'] == accs[12]  # best.pt's
    assert best_iter < 12  # so best.pt is not just the last energy
    best = load_checkpoint(os.path.join(a, 'best.pt'))
    assert best['iter_num'] == best_iter and 'optimizer' not in best and best['config']['dropout'] == 0.05
    nce_train.main(['--out_dir', b, '--max_iters', str(best_iter), *flags])
    stopped = load_checkpoint(os.path.join(b, 'ckpt.pt'))['model']
    for k in stopped:
        assert (best['model'][k] - stopped[k]).abs().max().item() <= 1e-6, k
    energy, _ = load_energy(os.path.join(a, 'best.pt'), lm_path=lm_ckpt)
    assert not energy.training and energy.kind == 'bit'
    # --patience 1: the run stops at the first evaluation after its best so far that did not improve
    # on it, with that best's weights in best.pt: the iteration and loss a's log says
    stop, best_so_far = 12, (math.inf, 0)
    for it in sorted(vals):
        best_so_far = min(best_so_far, (vals[it], it))
        if it - best_so_far[1] >= 2:
            stop = it
            break
    res = nce_train.main(['--out_dir', str(tmp_path / 'c'), '--max_iters', '12', '--patience', '1', *flags])
    assert (res['iters'], res['best_iter'], res['best_value']) == (stop, best_so_far[1], best_so_far[0])
    assert res['stopped_early'] == (stop - best_so_far[1] >= 2)
    if best_so_far[1] == best_iter:
        early = load_checkpoint(str(tmp_path / 'c' / 'best.pt'))['model']
        assert all((early[k] - best['model'][k]).abs().max().item() <= 1e-6 for k in early)


def fox_pairs(fox_negatives, split):
    """The negatives of `split` as a writable dict (tokens copied) and the split's tokens."""
    neg = load_negatives(fox_negatives[split])
    neg = dict(neg, tokens=np.array(neg['tokens']))
    data_dir = neg['meta']['data_dir']
    return neg, load_split(data_dir, split, load_meta(data_dir))


@pytest.mark.parametrize('kind', ['binary', 'ranking'])
def test_nce_batch_scores_each_distinct_sequence_once(fox_negatives, eval_ckpts, lm_ckpt, kind):
    """Negatives equal to one another, to the real continuation, and a prefix drawn twice: nce_batch
    runs each distinct sequence once, and the loss and its gradient gathered from them equal those
    of scoring all B (1 + M) sequences."""
    neg, data = fox_pairs(fox_negatives, 'train')
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    real = window_tokens(data, neg['offsets'], P + L)[:, P:].numpy()
    neg['tokens'][:, 1] = neg['tokens'][:, 0]
    neg['tokens'][::2, 2] = real[::2]
    rows, neg_idx = np.array([0, 1, 2, 3, 0]), np.tile([2, 0, 1], (5, 1))
    B, M = neg_idx.shape
    full = torch.cat([window_tokens(data, neg['offsets'][rows], P + L),
                      torch.cat([window_tokens(data, neg['offsets'][rows], P)[:, None].expand(-1, M, -1),
                                 torch.from_numpy(neg['tokens'][rows[:, None], neg_idx].astype(np.int64))],
                                2).flatten(0, 1)])  # (B (1 + M), P + L): every copy
    tokens, pos, negs = nce_train.nce_batch(data, neg, rows, neg_idx, 'cpu')
    assert torch.equal(tokens[pos], full[:B]) and torch.equal(tokens[negs].flatten(0, 1), full[B:])
    assert len(tokens) == len(torch.unique(full, dim=0)) <= B * (1 + M) - 8  # 5 + 2 + 1 copies at least
    energy = load_energy(eval_ckpts['bit'], lm_path=lm_ckpt)[0]

    def loss_and_grads(e_pos, e_neg):
        energy.zero_grad()
        loss, acc = nce_train.nce_loss(e_pos, e_neg, kind)
        loss.backward()
        return loss.item(), acc.item(), [p.grad.clone() for p in energy.parameters()]

    e = energy(full, P)
    l1, a1, g1 = loss_and_grads(e[:B], e[B:].view(B, M))
    e = energy(tokens, P)
    l2, a2, g2 = loss_and_grads(e[pos], e[negs])
    assert abs(l1 - l2) < 1e-6 and a1 == a2 and l1 > 0
    assert len(g1) == len(g2) > 0
    assert all((a - b).abs().max().item() < 1e-6 for a, b in zip(g1, g2))
    assert max(g.abs().max().item() for g in g1) > 1e-3  # a gradient to compare


def test_ranking_draws_only_prefixes_with_a_gradient(fox_negatives, eval_ckpts, lm_ckpt):
    """untied_rows keeps exactly the prefixes with a stored sample unlike their real continuation;
    a prefix whose samples all equal it has the constant ranking loss log(1 + M) and a zero
    gradient, so leaving it out changes no gradient direction."""
    neg, data = fox_pairs(fox_negatives, 'train')
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    real = window_tokens(data, neg['offsets'], P + L)[:, P:].numpy()
    neg['tokens'][::3] = real[::3, None]  # every third prefix: all K samples are x+
    neg['tokens'][1, 1] = real[1]  # one sample of x+ among others: still informative
    expected = [i for i in range(len(real)) if any((neg['tokens'][i, k] != real[i]).any() for k in range(3))]
    assert nce_train.untied_rows(data, neg, chunk=7).tolist() == expected
    assert 0 not in expected and 1 in expected
    energy = load_energy(eval_ckpts['bit'], lm_path=lm_ckpt)[0]
    tokens, pos, negs = nce_train.nce_batch(data, neg, np.array([0, 3]), np.tile([0, 1, 2], (2, 1)), 'cpu')
    assert len(tokens) == 2
    e = energy(tokens, P)
    loss, _ = nce_train.nce_loss(e[pos], e[negs], 'ranking')
    loss.backward()
    assert abs(loss.item() - math.log(4)) < 1e-6
    assert all(p.grad is None or p.grad.abs().max().item() == 0 for p in energy.parameters())


def test_a_training_step_on_top_k_negatives_corrects_by_log_p_over_q(eval_ckpts, lm_ckpt, tmp_path):
    """train_step on truncated (top-k) negatives: its loss is the ranking NCE of each positive among its
    M negatives with scores -E + log P_LM - log q (each sequence scored alone, float64 loops), not -E
    alone, and it leaves a gradient (the update is the optimizer's, not the step's)."""
    from types import SimpleNamespace
    negatives.main(['--lm', lm_ckpt, '--split', 'select', '--out_dir', str(tmp_path / 'topk'),
                    '--top_k', '24', *NEG_FLAGS])  # wide: the real continuations are in q's support
    neg, data = fox_pairs(dict(select=str(tmp_path / 'topk')), 'select')
    P, L, K, M = neg['meta']['prefix_len'], neg['meta']['gen_len'], neg['meta']['num_samples'], 2
    energy = load_energy(eval_ckpts['bit'], lm_path=lm_ckpt)[0]
    pool = np.arange(len(neg['offsets']))
    rows, neg_idx = nce_train.choose(len(pool), K, 5, M, 3, 'train', 0)
    rows = pool[rows]
    d_pos = neg['pos_logp'][rows] - neg['pos_logq'][rows]
    assert np.isfinite(d_pos).all() and (d_pos < -0.1).all()  # in q's support, and q is not P_LM
    ref = []
    for r, j, dp in zip(rows, neg_idx, d_pos.astype(np.float64)):
        x = window_tokens(data, neg['offsets'][r:r + 1], P + L)
        with torch.no_grad():
            e_pos = energy(x, P).double().item()
            samples = torch.from_numpy(neg['tokens'][r].astype(np.int64))  # (K, L)
            e = [energy(torch.cat([x[:, :P], samples[k:k + 1]], 1), P).double().item() for k in j]
        d = [float(neg['logp'][r, k]) - float(neg['logq'][r, k]) for k in j]
        ref.append(math.log1p(sum(math.exp((dk - ek) - (dp - e_pos)) for dk, ek in zip(d, e))))
    before = [p.detach().clone() for p in energy.parameters()]
    for p in energy.parameters():  # loaded for scoring: trainable again
        p.requires_grad_()
    args = SimpleNamespace(batch_size=5, grad_accum=1, seed=3, loss='ranking')
    stats = nce_train.train_step(energy, torch.amp.GradScaler('cpu', enabled=False), data, neg, pool, M, args,
                                 0, 'cpu', contextlib.nullcontext(), 0, 1)
    assert abs(stats[0] - np.mean(ref)) < 1e-5, (stats[0], np.mean(ref))
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in energy.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, energy.parameters(), strict=True))


@pytest.mark.parametrize('truncated', [False, True])
def test_held_out_gain_reference(fox_negatives, eval_ckpts, lm_ckpt, lm_corpus, tmp_path, truncated):
    """nce_train.evaluate's joint gain, -E(x+) - log Z per token with log Z from the K stored
    samples at Eq. 4's upper end (T_n for the optimistic end), against each sequence scored
    alone and the bounds in float64 numpy loops; with top-k negatives log Z is importance-weighted
    by P_LM / q. The NCE loss of the same pairs against nce_loss on every copy."""
    if truncated:
        negatives.main(['--lm', lm_ckpt, '--split', 'select', '--out_dir', str(tmp_path / 'topk'),
                        '--top_k', '3', *NEG_FLAGS])
        fox_negatives = dict(select=str(tmp_path / 'topk'))
    neg, data = fox_pairs(fox_negatives, 'select')
    P, L, K = neg['meta']['prefix_len'], neg['meta']['gen_len'], neg['meta']['num_samples']
    energy = load_energy(eval_ckpts['bit'], lm_path=lm_ckpt)[0]
    rows, neg_idx = np.arange(7), np.tile([1, 2], (7, 1))
    ev = nce_train.evaluate(energy, data, neg, rows, neg_idx, 3, 'ranking', 'cpu', contextlib.nullcontext())
    gains, highs, losses, enums = [], [], [], []
    for r in rows:
        x = window_tokens(data, neg['offsets'][r:r + 1], P + L)
        with torch.no_grad():
            e_pos = energy(x, P).double().item()
            samples = torch.from_numpy(neg['tokens'][r].astype(np.int64))  # (K, L)
            e = np.array([energy(torch.cat([x[:, :P], samples[k:k + 1]], 1), P).double().item()
                          for k in range(K)])
        d = np.array(neg['logp'][r], dtype=np.float64) - np.array(neg['logq'][r], dtype=np.float64)
        low, high = ref_bounds(d - e)
        gains.append((-e_pos - high) / L)
        highs.append((-e_pos - low) / L)
        d_pos = float(neg['pos_logp'][r] - neg['pos_logq'][r]) if truncated else 0.0
        losses.append(math.log1p(sum(math.exp((d[k] - e[k]) - (d_pos - e_pos)) for k in (1, 2))))
        conts = [tuple(x[0, P:].tolist())] + [tuple(c) for c in samples.tolist()]
        logp = [float(neg['pos_logp'][r])] + [float(v) for v in neg['logp'][r]]
        enums.append((-e_pos - ref_enumerate(conts, logp, [-e_pos] + list(-e), 1)[0]) / L)
    # untruncated: log Z enumerated, the real continuation known; truncated: T_n's gain (not P_LM's samples)
    assert abs(ev['held_out_gain_enumerated'] - np.mean(highs if truncated else enums)) < 1e-5
    assert abs(ev['held_out_gain'] - np.mean(gains)) < 1e-5
    assert abs(ev['held_out_gain_high'] - np.mean(highs)) < 1e-5
    assert ev['held_out_gain'] < ev['held_out_gain_high']  # the upper log Z is the conservative end
    assert abs(ev['held_out_loss'] - np.mean(losses)) < 1e-5

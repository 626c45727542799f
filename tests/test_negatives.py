"""NCE's negatives (negatives.py): the LM's samples with log P_LM and log q, the real continuation's
too.
The tests to read first are in test_all.py."""

import os

import numpy as np
import pytest
import torch

from data import (load_meta, load_negatives, load_split, negatives_command, read_negatives_meta,
                  window_tokens, windows)
from model import load_lm
import nce_train
import negatives

from test_all import brute_proposal64
from tests.common import NEG_FLAGS, logprobs64, neg_files


# =============================================================================
# ==== negatives: the LM's samples with log P_LM and log q, the real continuation's too (negatives.py);
#      a killed run resumes byte-identical ====

def test_negatives_record_their_precision(train_negatives, tmp_path):
    """meta.json records the precision the samples were drawn in; a rerun in another one is
    refused (its chunks would mix precisions), and the finishing command names it."""
    a, flags = train_negatives
    meta = read_negatives_meta(a)
    assert meta['precision'] == 'float32' and '--dtype float32' in negatives_command(meta, a)
    other = [*flags[:flags.index('--dtype')], '--dtype', 'bfloat16', *flags[flags.index('--dtype') + 2:]]
    before = neg_files(a)
    with pytest.raises(ValueError, match=r'other settings \(precision\)'):
        negatives.main(['--out_dir', a, *other])
    assert neg_files(a) == before


def test_negatives_hold_the_lms_samples(lm_corpus, lm_ckpt, train_negatives):
    """What the files hold: the LM's own samples and their log-probs."""
    a, _ = train_negatives
    meta = load_meta(lm_corpus)
    neg = load_negatives(a, lm_path=lm_ckpt)
    data = load_split(lm_corpus, 'train', meta)
    assert neg['offsets'].tolist() == windows(data, 6, 4, max_windows=23).tolist()
    N, K, L = 23, 3, 4
    assert neg['tokens'].shape == (N, K, L) and neg['done'].tolist() == [1] * 5 and neg['meta']['complete']
    tokens = torch.from_numpy(neg['tokens'].astype(np.int64)).view(N * K, L)
    assert len({tuple(t) for t in tokens.tolist()}) > N  # samples, not copies of one
    prefix = window_tokens(data, neg['offsets'], 6).repeat_interleave(K, 0)
    lm, _ = load_lm(lm_ckpt)
    with torch.no_grad():
        ref = lm.sequence_logprob(torch.cat([prefix, tokens], 1), 6)
        wrong = lm.sequence_logprob(torch.cat([prefix.roll(K, 0), tokens], 1), 6)
    logp = torch.from_numpy(np.array(neg['logp'])).view(-1)
    assert (logp - ref).abs().max().item() < 1e-4
    assert (logp - wrong).abs().max().item() > 1e-2  # the check can see a prefix/sample mix-up
    assert np.array_equal(neg['logq'], neg['logp'])  # untruncated: q is P_LM itself


def test_negatives_top_k_proposal(lm_corpus, lm_ckpt, train_negatives, tmp_path):
    """Truncated sampling: logq is the renormalised top-k proposal, logp still the untruncated LM."""
    _, flags = train_negatives
    c = str(tmp_path / 'topk')
    negatives.main(['--out_dir', c, *flags, '--top_k', '3'])
    neg = load_negatives(c)
    assert neg['meta']['top_k'] == 3
    N, K, L = 23, 3, 4
    data = load_split(lm_corpus, 'train', load_meta(lm_corpus))
    prefix = window_tokens(data, neg['offsets'], 6).repeat_interleave(K, 0)
    lm, _ = load_lm(lm_ckpt)
    tokens = torch.from_numpy(neg['tokens'].astype(np.int64)).view(N * K, L)
    with torch.no_grad():
        total, per_tok = lm.sequence_logprob(torch.cat([prefix, tokens], 1), 6, per_token=True)
    assert (torch.from_numpy(np.array(neg['logp'])).view(-1) - total).abs().max().item() < 1e-4
    ranks = (logprobs64(lm, torch.cat([prefix, tokens], 1))[:, 5:-1]
             > per_tok.double()[..., None] + 1e-6).sum(-1)
    assert ranks.max().item() < 3  # every token among the 3 most likely
    logq = np.array(neg['logq'])
    assert (logq >= np.array(neg['logp']) - 1e-6).all() and (logq > np.array(neg['logp']) + 1e-3).mean() > 0.9


def test_negatives_store_real_continuation_scores(lm_corpus, lm_ckpt, tmp_path):
    """pos_logp / pos_logq of negatives.py vs float64 brute force on the tiny LM: log P_LM of the
    real continuation, and its log q under the proposal the negatives came from (-inf for a real
    token outside top-k/top-p, the argmax at temperature 0); untruncated, pos_logq == pos_logp.
    log_ratios hands nce_loss d = log P_LM - log q (None untruncated, +inf off the support)."""
    meta = load_meta(lm_corpus)
    data = load_split(lm_corpus, 'train', meta)
    lm, _ = load_lm(lm_ckpt)
    P, L, N = 6, 4, 23
    flags = ['--lm', lm_ckpt, '--split', 'train', '--num_prefixes', str(N), '--chunk', '5', *NEG_FLAGS]
    real = None
    # the LM is nearly uniform over 30 tokens: wide truncations, so that some real continuations fit
    for name, extra, proposal in (('full', [], {}), ('topk', ['--top_k', '20'], dict(top_k=20)),
                                  ('topp', ['--top_p', '0.8', '--temperature', '0.7'],
                                   dict(top_p=0.8, temperature=0.7)),
                                  ('greedy', ['--temperature', '0'], 'greedy')):
        out = str(tmp_path / name)
        negatives.main(['--out_dir', out, *flags, *extra])
        neg = load_negatives(out, lm_path=lm_ckpt)
        if real is None:
            real = window_tokens(data, neg['offsets'], P + L)
            lp64 = logprobs64(lm, real)[:, P - 1:-1]  # (N, L, V)
            tok = real[:, P:, None]
            ref_logp = lp64.gather(-1, tok).squeeze(-1).sum(1)
        pos_logp, pos_logq = (torch.from_numpy(np.array(neg['pos_logp'])),
                              torch.from_numpy(np.array(neg['pos_logq'])))
        assert pos_logp.shape == pos_logq.shape == (N,) and pos_logp.dtype == torch.float32
        assert (pos_logp.double() - ref_logp).abs().max() < 1e-4
        if proposal == {}:
            assert torch.equal(pos_logq, pos_logp)
            assert nce_train.log_ratios(neg, np.arange(3), np.zeros((3, 2), int)) == (None, None)
            continue
        if proposal == 'greedy':
            ref_q = torch.where(lp64.argmax(-1, keepdim=True) == tok, 0.0, float('-inf')).squeeze(-1).sum(1)
        else:
            ref_q = (torch.from_numpy(brute_proposal64(lp64.numpy(), **proposal)).view(N, L, -1)
                     .gather(-1, tok).squeeze(-1).sum(1))
        off = torch.isinf(ref_q)
        # both cases occur
        assert 0 < off.sum() < N or proposal == 'greedy' and off.sum() > 0, (name, off.sum())
        assert torch.equal(torch.isinf(pos_logq), off) and (pos_logq[off] == float('-inf')).all()
        assert ((pos_logq[~off].double() - ref_q[~off]).abs() < 1e-4).all()
        rows, idx = np.array([0, 4, 7]), np.array([[2, 0], [1, 1], [0, 2]])
        d_pos, d_neg = nce_train.log_ratios(neg, rows, idx)
        assert (torch.equal(d_pos, pos_logp[rows] - pos_logq[rows])
                and torch.isinf(d_pos).tolist() == off[rows].tolist())
        assert torch.equal(d_neg, torch.from_numpy(np.array(neg['logp'])[rows[:, None], idx]
                                                   - np.array(neg['logq'])[rows[:, None], idx]))
        assert torch.isfinite(d_neg).all()
    # a dir from before these files: still read untruncated (d = 0), refused truncated
    for name in ('full', 'topk'):
        for f in ('pos_logp.bin', 'pos_logq.bin'):
            os.remove(tmp_path / name / f)
    neg = load_negatives(str(tmp_path / 'full'))
    assert neg['pos_logp'] is None
    assert nce_train.log_ratios(neg, np.arange(2), np.zeros((2, 1), int)) == (None, None)
    with pytest.raises(ValueError, match='regenerate them into a new --out_dir'):
        load_negatives(str(tmp_path / 'topk'))

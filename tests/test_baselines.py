"""The baselines: RALM (Eq. 6), BALM, the paper's presets.
The tests to read first are in test_all.py."""

import shutil

import pytest
import torch

from energy import Energy
from model import GPT, GPTConfig, RALM, load_lm, width_for_params
from train_lm import PAPER_PRESETS
import train_lm

from tests.common import run_script, tiny_gpt


# =============================================================================
# ==== baselines: RALM (Eq. 6), BALM, the paper's presets ====

def tiny_ralm(residual_std=None):
    """A tiny base GPT, a RALM on it whose residual head is zero (None) or drawn with that std,
    and 3 random rows of 12 tokens."""
    torch.manual_seed(0)
    base = tiny_gpt(vocab_size=7, block_size=16, seed=3)
    ralm = RALM(GPTConfig(block_size=16, vocab_size=7, n_layer=1, n_head=2, n_embd=16), base).eval()
    x = torch.randint(7, (3, 12))
    with torch.no_grad():
        ralm.lm_head.weight.zero_() if residual_std is None else ralm.lm_head.weight.normal_(0, residual_std)
    return base, ralm, x


def test_ralm_zero_residual_is_base():
    """A zero-initialised residual is the base LM exactly, cached generation included."""
    base, ralm, x = tiny_ralm()
    with torch.no_grad():
        assert torch.equal(ralm.logits(x), base.logits(x))
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        a, b = (ralm.generate(x[:, :4], 6, num_samples=3, generator=g1),
                base.generate(x[:, :4], 6, num_samples=3, generator=g2))
        assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_ralm_normalised():
    """A non-zero residual: Eq. 6 is log_softmax(base logits + phi logits), each step sums to 1."""
    base, ralm, x = tiny_ralm(0.5)
    with torch.no_grad():
        lp = torch.log_softmax(ralm.logits(x).double(), -1)
        ref = torch.log_softmax(torch.log_softmax(base.logits(x).double(), -1)
                                + torch.log_softmax(GPT.logits(ralm, x).double(), -1), -1)
        assert torch.allclose(lp, ref, atol=1e-5)
        assert torch.allclose(lp.exp().sum(-1), torch.ones(3, 12, dtype=torch.float64), atol=1e-9)
        total = ralm.sequence_logprob(x, 4).double()
        assert torch.allclose(total, ref[:, 3:-1].gather(-1, x[:, 4:, None]).squeeze(-1).sum(1), atol=1e-4)


def test_ralm_cached_generation():
    """The KV cache covers both models."""
    _, ralm, x = tiny_ralm(0.5)
    with torch.no_grad():
        tokens, logp = ralm.generate(x[:, :4], 8, num_samples=2, generator=torch.Generator().manual_seed(1))
        seq = torch.cat([x[:, :4, None].expand(-1, -1, 2).transpose(1, 2), tokens], 2).flatten(0, 1)
        assert torch.allclose(logp.flatten(0, 1).sum(1), ralm.sequence_logprob(seq, 4), atol=1e-4)


def test_ralm_training_and_checkpoint(lm_corpus, lm_ckpt, tmp_path):
    out = tmp_path / 'ralm'
    res = run_script(['train_lm.py', '--data_dir', str(lm_corpus), '--out_dir', str(out),
                      '--residual_of', str(lm_ckpt), '--n_layer', '1', '--n_head', '2', '--n_embd', '16',
                      '--block_size', '16', '--batch_size', '4', '--max_iters', '3', '--eval_interval', '3',
                      '--print_samples', '0', '--quiet'])
    assert res.returncode == 0, res.stderr
    ralm, ckpt = load_lm(str(out / 'ckpt.pt'))
    base, _ = load_lm(str(lm_ckpt))
    assert isinstance(ralm, RALM) and ckpt['residual_of'][0] == str(lm_ckpt)
    assert not any(k.startswith('base.') for k in ckpt['model'])  # the frozen base is not copied
    assert len(ralm.base.state_dict()) == len(base.state_dict()) > 0
    for (k, v), (_, w) in zip(ralm.base.state_dict().items(), base.state_dict().items()):
        assert torch.equal(v, w), k  # and stayed frozen


def test_balm_width_matches_params():
    V, block = 78, 256

    def count(c):  # on the meta device: shapes without memory or init, as fast as the brute force needs
        with torch.device('meta'):
            return GPT(GPTConfig(block_size=block, vocab_size=V, n_layer=4, n_head=4, n_embd=c)).num_params()

    target = 2 * count(256) + 257  # base LM + a same-shape energy, roughly
    c = width_for_params(target, 4, 4, V, block)
    assert c % 64 == 0  # head sizes a multiple of 16
    best = min(range(64, 1025, 64), key=lambda w: abs(count(w) - target))  # brute force over every such width
    assert c == best and abs(count(c) - target) / target < 0.15  # the nearest of widths 64 apart
    assert (width_for_params(target, 4, 4, V, block, head_multiple=1)
            == min(range(4, 1025, 4), key=lambda w: abs(count(w) - target)))


@pytest.mark.parametrize('name,paper', [('base_lm', 203e6), ('bit_base', 125e6), ('bit_large', 355e6),
                                        ('balm', 433.7e6)])
def test_paper_presets_param_counts(name, paper):
    """The presets built on the meta device have the paper's counts (BALM: what its stated shape
    gives with tied embeddings; the paper lists 408M)."""
    p = PAPER_PRESETS[name]
    bit = name.startswith('bit')
    with torch.device('meta'):
        cfg = GPTConfig(block_size=512, vocab_size=50257 + bit, n_layer=p['n_layer'], n_head=p['n_head'],
                        n_embd=p['n_embd'], bias=p.get('bias', False), causal=not bit)
        n = (Energy(cfg) if bit else GPT(cfg)).num_params()
    assert abs(n - paper) / paper < 0.02, n


def test_preset_flag_sets_defaults():
    args = train_lm.get_args(['--preset', 'bit_base', '--lr', '1e-3'])
    assert ((args.n_layer, args.n_embd, args.n_head, args.batch_size, args.block_size, args.lr)
            == (12, 768, 12, 60, 512, 1e-3))


def test_ralm_base_found_in_a_moved_run_folder(lm_corpus, lm_ckpt, tmp_path):
    """A RALM records its base LM's path and hash: a run folder moved whole still loads (the base where
    it is from the RALM as it was from its --out_dir, the same bytes); a changed base is one line."""
    run, moved = tmp_path / 'run', tmp_path / 'moved'
    (run / 'lm').mkdir(parents=True)
    shutil.copy(lm_ckpt, run / 'lm' / 'best.pt')
    train_lm.main(['--data_dir', str(lm_corpus), '--out_dir', str(run / 'ralm'), '--residual_of',
                   str(run / 'lm' / 'best.pt'), '--n_layer', '1', '--n_head', '2', '--n_embd', '16',
                   '--block_size', '16', '--batch_size', '4', '--max_iters', '3', '--eval_interval', '3',
                   '--print_samples', '0', '--final_eval', '0', '--quiet'])
    x = torch.randint(7, (2, 10))
    with torch.no_grad():
        before = load_lm(str(run / 'ralm' / 'ckpt.pt'))[0](x)[0]
    run.rename(moved)
    ralm, ckpt = load_lm(str(moved / 'ralm' / 'ckpt.pt'))
    assert ckpt['residual_of'][0] == str(run / 'lm' / 'best.pt')  # the old path, gone
    with torch.no_grad():
        assert torch.equal(ralm(x)[0], before)
    shutil.copy(moved / 'ralm' / 'ckpt.pt', moved / 'lm' / 'best.pt')  # another file where the base was
    with pytest.raises(ValueError, match=r"is the residual of .*run/lm/best.pt \(hash \w+\), which is "
                                         r"missing or changed, and so is .*moved/ralm/\.\./lm/best.pt: put"):
        load_lm(str(moved / 'ralm' / 'ckpt.pt'))

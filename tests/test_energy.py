"""The energy E(x) (energy.py): padding, pooling, context, UNIT/BIT bodies, MLM masks, checkpoints
tied to their LM.
The tests to read first are in test_all.py."""

from dataclasses import asdict
import math
import os

import pytest
import torch

from data import load_meta
from energy import Energy, build_energy, energy_state, load_energy, mlm_mask, score, score_continuations
from model import GPT, GPTConfig, load_checkpoint, load_lm
from plumbing import file_hash, save_checkpoint
import train_lm

from test_all import energies
from tests.common import CORPUS, EVAL_L, EVAL_P, NULL, TRAIN_FLAGS, prepare_corpus


# =============================================================================
# ==== energy: E(x) (energy.py): padding, pooling, context, UNIT/BIT bodies, MLM masks,
#      checkpoints tied to their LM ====

def random_energy(kind, pool, vocab_size=12, block_size=16, seed=0, alibi=False):
    """A tiny Energy with wide random weights, head included (a fresh head is zero: E = 0)."""
    torch.manual_seed(seed)
    e = Energy(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32,
                         causal=kind == 'unit', alibi=alibi), pool)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0.0, 0.3)
    return e.eval()


def energy_ref64(e, seq, P):
    """Reference energy of one unpadded sequence: float64 mean of its final hidden states over the
    pooled positions, through the head."""
    with torch.no_grad():
        h = e.body.hidden(seq[None])[0].double()
    h = h[P:] if e.pool == 'continuation' else h
    return (h.mean(0) @ e.head.weight.double()[0] + e.head.bias.double()[0]).item()


@pytest.mark.parametrize('kind', ['bit', 'unit'])
@pytest.mark.parametrize('pool,alibi', [('continuation', False), ('all', False), ('continuation', True)])
def test_energy_padding_invariance(kind, pool, alibi):
    P, T = 5, 16
    e = random_energy(kind, pool, alibi=alibi)
    assert e.kind == kind
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([16, 9, 12, 6, 11])
    seqs = [torch.randint(12, (int(n),), generator=g) for n in lengths]
    with torch.no_grad():
        alone = torch.stack([e(s[None], P)[0] for s in seqs])
        batches = []
        for fill in (0, 7, None):  # the same batch padded with different pad ids
            x = (torch.randint(12, (len(seqs), T), generator=g) if fill is None
                 else torch.full((len(seqs), T), fill))
            for i, s in enumerate(seqs):
                x[i, :len(s)] = s
            batches.append(x)
        padded = [e(x, P, lengths) for x in batches]
        unmasked = e(batches[2], P)
    ref = torch.tensor([energy_ref64(e, s, P) for s in seqs], dtype=torch.float64)
    assert (alone.double() - ref).abs().max().item() < 1e-5
    for got in padded:
        assert got.dtype == torch.float32 and got.shape == (len(seqs),)
        assert (got - alone).abs().max().item() < 1e-5
    assert torch.equal(padded[0], padded[1]) and torch.equal(padded[0], padded[2])  # pad ids are invisible
    # the test can see a mistake: energies are far apart, and without `lengths` padding leaks in
    assert (ref.max() - ref.min()).item() > 0.1
    assert (unmasked - alone).abs()[1:].max().item() > 1e-2
    assert abs(unmasked[0] - alone[0]).item() < 1e-5  # the row without padding
    other = Energy(e.config, 'all' if pool == 'continuation' else 'continuation')
    other.load_state_dict(e.state_dict())
    with torch.no_grad():
        assert ((other.eval()(batches[0], P, lengths) - alone).abs() > 1e-3).all()
    fresh = Energy(e.config, pool)  # a new energy is 0: the joint model starts as P_LM
    assert torch.equal(fresh(batches[0], P, lengths), torch.zeros(len(seqs)))


def test_energy_unknown_pool():
    with pytest.raises(ValueError, match="pool 'max' must be one of"):
        Energy(random_energy('bit', 'continuation').config, 'max')


def test_score_in_chunks():
    """energy.score: the energies of many rows, max_rows at a time, in float64: the float64
    reference of each row."""
    P = 5
    e = random_energy('bit', 'continuation')
    x = torch.randint(12, (10, 16), generator=torch.Generator().manual_seed(2))
    got = score(e, x, P, NULL, max_rows=3)  # chunks of 3, 3, 3, 1
    ref = torch.tensor([energy_ref64(e, s, P) for s in x], dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == (10,)
    assert (got - ref).abs().max().item() < 1e-5 and (ref.max() - ref.min()).item() > 0.1


@pytest.mark.parametrize('kind', ['bit', 'unit'])
@pytest.mark.parametrize('pool,alibi,context,prefix_len', [
    ('continuation', False, None, 6), ('all', False, None, 6), ('continuation', True, None, 6),
    ('continuation', False, 2, 6), ('continuation', False, None, 4), ('all', True, 3, 4),
    ('continuation', False, 0, 6)])
def test_score_continuations_is_score_of_each_sequence(kind, pool, alibi, context, prefix_len):
    """score_continuations (a UNIT runs each prompt once and shares its K/V with the continuations)
    against the float64 reference of every whole sequence, for the pooled prompt positions of
    both pools, ALiBi, a context (0: the shared path has no prompt left and runs whole sequences),
    Eq. 5's prompts that hold real continuation tokens (prefix_len < P), and blocks of 1-2
    continuations or all of them."""
    B, P, n, L = 3, 6, 5, 4
    e = random_energy(kind, pool, alibi=alibi)
    e.context = context
    g = torch.Generator().manual_seed(4)
    prompts, tokens = torch.randint(12, (B, P), generator=g), torch.randint(12, (B, n, L), generator=g)
    x = torch.cat([prompts[:, None].expand(-1, n, -1), tokens], 2)
    cut = e.context_cut(prefix_len)
    ref = torch.tensor([[energy_ref64(e, x[b, i, cut:], prefix_len - cut) for i in range(n)]
                        for b in range(B)], dtype=torch.float64)
    for max_rows in (3, 6, 1000):
        got = score_continuations(e, prompts, tokens, prefix_len, NULL, max_rows=max_rows)
        assert got.dtype == torch.float64 and got.shape == (B, n)
        assert (got - ref).abs().max().item() < 1e-5
    assert ref.std() > 0.05  # a mix-up of rows or of pooled positions would be seen (1e-5 above)
    shifted = score_continuations(e, prompts, tokens,
                                  prefix_len - 1 if pool == 'continuation' else prefix_len, NULL)
    assert pool == 'all' or context == 0 or (shifted - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize('kind', ['bit', 'unit'])
def test_score_continuations_scores_each_distinct_sequence_once(kind):
    """Continuations that repeat (2 distinct of 6 per prompt): score_continuations gives every one the
    float64 reference's energy, and the energy's forward sees each distinct sequence once (a UNIT
    too: fewer tokens than its shared path)."""
    B, P, n, L = 3, 6, 6, 4
    e = random_energy(kind, 'continuation')
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(12, (B, P), generator=g)
    pairs = torch.randint(12, (B, 2, L), generator=g)
    tokens = pairs[:, torch.tensor([0, 1, 1, 0, 0, 1])]  # (B, n, L)
    x = torch.cat([prompts[:, None].expand(-1, n, -1), tokens], 2)
    ref = torch.tensor([[energy_ref64(e, x[b, i], P) for i in range(n)] for b in range(B)],
                       dtype=torch.float64)
    seen = []
    e.register_forward_pre_hook(lambda m, a: seen.append(a[0].size(0)))
    got = score_continuations(e, prompts, tokens, P, NULL)
    assert (got - ref).abs().max().item() < 1e-5 and ref.std() > 0.05
    assert sum(seen) == B * 2  # each prompt's 2 distinct sequences


@pytest.mark.parametrize('kind', ['bit', 'unit'])
def test_energy_context_sees_the_last_prefix_tokens(kind):
    """With context c, E(x) is the full-context energy of x cut to its last c prefix tokens:
    the float64 reference on the cut sequence, padded or not; earlier prefix tokens do not count."""
    P, c = 6, 2
    e = random_energy(kind, 'continuation')
    cut = Energy(e.config, 'continuation', context=c)
    cut.load_state_dict(e.state_dict())
    cut.eval()
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([14, 9, 11])
    x = torch.randint(12, (3, 14), generator=g)
    ref = torch.tensor([energy_ref64(e, x[i, P - c:lengths[i]], c) for i in range(3)], dtype=torch.float64)
    y = x.clone()
    y[:, :P - c] = torch.randint(12, (3, P - c), generator=g)  # other early prefix tokens
    with torch.no_grad():
        got = cut(x, P, lengths)
        assert (got.double() - ref).abs().max().item() < 1e-5
        assert torch.allclose(cut(y, P, lengths), got, atol=1e-6)
        assert (e(x, P, lengths) - got).abs().min().item() > 1e-3  # the whole prefix gives another energy
        whole = Energy(e.config, 'continuation', context=P)  # a context as long as the prefix cuts nothing
        whole.load_state_dict(e.state_dict())
        assert torch.equal(whole.eval()(x, P, lengths), e(x, P, lengths))


def test_energy_negative_context():
    with pytest.raises(ValueError, match='context -1 must be >= 0'):
        Energy(random_energy('bit', 'continuation').config, 'continuation', context=-1)


@pytest.mark.parametrize('sizes', [None, dict(n_layer=2, n_head=None)],
                         ids=['sizes_unset', 'sizes_of_the_lm'])
def test_unit_starts_as_the_lm(lm_corpus, lm_ckpt, sizes):
    """Flags equal to the LM's (or unset) are fine: the UNIT's body is the LM's, its energy 0."""
    meta = load_meta(lm_corpus)
    lm, _ = load_lm(lm_ckpt)
    x = torch.randint(meta['vocab_size'], (3, 16), generator=torch.Generator().manual_seed(0))
    e = build_energy('unit', lm_ckpt, meta, sizes=sizes)
    assert e.kind == 'unit' and e.config == lm.config and e.config.causal
    with torch.no_grad():
        assert torch.equal(e.body.hidden(x), lm.hidden(x))
        assert torch.equal(e(x, 4), torch.zeros(3))


@pytest.mark.parametrize('sizes,what', [(dict(n_layer=3), 'n_layer=2'), (dict(n_embd=64), 'n_embd=32'),
                                        (dict(n_head=4), 'n_head=2')], ids=['n_layer', 'n_embd', 'n_head'])
def test_unit_refuses_another_shape(lm_corpus, lm_ckpt, sizes, what):
    with pytest.raises(ValueError, match=f'UNIT energy has the shape of the LM it starts from .*{what}'):
        build_energy('unit', lm_ckpt, load_meta(lm_corpus), sizes=sizes)


def test_unit_from_another_lm(lm_corpus, lm_ckpt, tmp_path):
    """The paper's UNIT may be another (e.g. larger) LM of the same data: init_from copies that one."""
    meta = load_meta(lm_corpus)
    x = torch.randint(meta['vocab_size'], (3, 16), generator=torch.Generator().manual_seed(0))
    out = str(tmp_path / 'lm1')
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--max_iters', '1', '--eval_interval', '1',
                   '--final_eval', '0', *TRAIN_FLAGS, '--n_layer', '1'])
    lm1, _ = load_lm(os.path.join(out, 'ckpt.pt'))
    e = build_energy('unit', lm_ckpt, meta, init_from=os.path.join(out, 'ckpt.pt'))
    assert e.config.n_layer == 1
    with torch.no_grad():
        assert torch.equal(e.body.hidden(x), lm1.hidden(x))


def test_build_energy_unknown_kind(lm_corpus, lm_ckpt):
    with pytest.raises(ValueError, match="unknown energy kind 'mlp'"):
        build_energy('mlp', lm_ckpt, load_meta(lm_corpus))


def test_bit_from_mlm(lm_corpus, lm_ckpt, mlm_ckpt):
    meta = load_meta(lm_corpus)
    V = meta['vocab_size']
    mlm = load_checkpoint(mlm_ckpt)
    assert mlm['kind'] == 'mlm' and mlm['config']['vocab_size'] == V + 1 and not mlm['config']['causal']
    e = build_energy('bit', lm_ckpt, meta, init_from=mlm_ckpt, pool='all')
    assert e.kind == 'bit' and e.pool == 'all' and asdict(e.config) == mlm['config']
    body = e.body.state_dict()
    assert body.keys() == mlm['model'].keys()
    for k, v in mlm['model'].items():
        assert torch.equal(body[k], v), k
    ref = GPT(GPTConfig(**mlm['config']))
    ref.load_state_dict(mlm['model'])
    x = torch.randint(V + 1, (2, 8), generator=torch.Generator().manual_seed(0))  # [MASK] included
    with torch.no_grad():
        assert torch.equal(e.body.hidden(x), ref.eval().hidden(x))
        # bidirectional: the first position's state depends on the last token
        y = x.clone()
        y[:, -1] = (y[:, -1] + 1) % V
        assert (e.body.hidden(x)[:, 0] - e.body.hidden(y)[:, 0]).abs().max().item() > 1e-4


def test_bit_refuses_an_lm_to_start_from(lm_corpus, lm_ckpt):
    with pytest.raises(ValueError, match="is a 'lm' checkpoint: a BIT starts from a masked-LM one"):
        build_energy('bit', lm_ckpt, load_meta(lm_corpus), init_from=lm_ckpt)


def test_bit_from_scratch(lm_corpus, lm_ckpt):
    """The LM's sizes and block unless told, one extra token ([MASK]), no causal mask."""
    meta = load_meta(lm_corpus)
    V = meta['vocab_size']
    e = build_energy('bit', lm_ckpt, meta)
    assert ((e.config.vocab_size, e.config.block_size, e.config.n_layer, e.config.causal)
            == (V + 1, 16, 2, False))
    e = build_energy('bit', lm_ckpt, meta, sizes=dict(n_layer=1, n_embd=16, n_head=None), block_size=12)
    assert (e.config.n_layer, e.config.n_embd, e.config.n_head, e.config.block_size) == (1, 16, 2, 12)


def test_bit_refuses_an_mlm_of_another_vocabulary(lm_corpus, lm_ckpt, tmp_path):
    """An MLM of another corpus whose vocabulary happens to have the same size is still refused."""
    meta = load_meta(lm_corpus)
    other = prepare_corpus(tmp_path / 'upper', {'u.txt': CORPUS.upper()},
                           extra=['--val_frac', '0.1', '--test_frac', '0.1'])
    assert load_meta(other)['vocab_size'] == meta['vocab_size'] and load_meta(other)['chars'] != meta['chars']
    out = str(tmp_path / 'mlm_upper')
    train_lm.main(['--data_dir', other, '--out_dir', out, '--objective', 'mlm', '--max_iters', '1',
                   '--eval_interval', '1', '--final_eval', '0', *TRAIN_FLAGS, '--block_size', '8'])
    with pytest.raises(ValueError, match='another vocabulary'):
        build_energy('bit', lm_ckpt, meta, init_from=os.path.join(out, 'ckpt.pt'))


@pytest.mark.parametrize('V', [5, 50])
def test_mlm_mask_proportions(V):
    shape = (400, 500)
    n = shape[0] * shape[1]
    x = torch.randint(V, shape, generator=torch.Generator().manual_seed(0))
    inputs, targets = mlm_mask(x, V, mask_id=V, generator=torch.Generator().manual_seed(1))
    chosen = targets != -1

    def close(k, total, p):  # k successes in total trials within 5 binomial standard errors of p
        return abs(k / total - p) < 5 * math.sqrt(p * (1 - p) / total)

    nc = chosen.sum().item()
    assert close(nc, n, 0.15), nc / n
    for half in (chosen[:, :250], chosen[:, 250:], chosen[:200], chosen[200:]):  # not a block of positions
        assert close(half.sum().item(), half.numel(), 0.15)
    assert torch.equal(targets[chosen], x[chosen]) and (targets[~chosen] == -1).all()
    assert torch.equal(inputs[~chosen], x[~chosen])
    masked = chosen & (inputs == V)
    kept = chosen & (inputs == x)
    rand = chosen & (inputs != x) & (inputs != V)
    # a random replacement is uniform over the V real tokens (never [MASK]), so it equals the
    # original 1/V of the time; with V = 5 a [MASK] among them would show as 0.8 + 0.1/6 masked
    assert close(masked.sum().item(), nc, 0.8), masked.sum().item() / nc
    assert close(kept.sum().item(), nc, 0.1 + 0.1 / V), kept.sum().item() / nc
    assert close(rand.sum().item(), nc, 0.1 * (1 - 1 / V)), rand.sum().item() / nc
    assert inputs.min().item() >= 0 and inputs.max().item() == V
    counts = torch.bincount(inputs[rand], minlength=V).double()
    assert counts.numel() == V
    expected = counts.sum() / V
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 3 * V + 10, chi2  # V - 1 degrees of freedom: a chance failure is < 1e-4 for both V
    again = mlm_mask(x, V, mask_id=V, generator=torch.Generator().manual_seed(1))
    other = mlm_mask(x, V, mask_id=V, generator=torch.Generator().manual_seed(2))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)
    assert not torch.equal(other[1], targets)


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
    assert (E.std() > 0.05
            and (E - energies(bit, x, EVAL_P + 1)).abs().max() > 1e-3)  # pooling starts at the prefix
    ref = Energy(GPTConfig(**ck['config']), ck['pool'])
    ref.load_state_dict(torch.load(eval_ckpts['bit'], weights_only=True)['model'])
    assert torch.equal(energies(ref.eval(), x, EVAL_P), E)


def test_energy_checkpoint_keeps_the_context(lm_ckpt, eval_ckpts, tmp_path):
    x = torch.randint(1, 30, (5, EVAL_P + EVAL_L), generator=torch.Generator().manual_seed(0))
    bit, ck = load_energy(eval_ckpts['bit'])
    cut = Energy(bit.config, ck['pool'], context=2)  # the context is saved and restored
    cut.load_state_dict(bit.state_dict())
    save_checkpoint(energy_state(cut, lm_ckpt, ck['meta']), str(tmp_path / 'cut.pt'))
    back, _ = load_energy(str(tmp_path / 'cut.pt'))
    assert back.context == 2 and torch.equal(energies(back, x, EVAL_P), energies(cut.eval(), x, EVAL_P))
    assert (energies(back, x, EVAL_P) - energies(bit, x, EVAL_P)).abs().max() > 1e-3


def test_load_energy_of_an_lm(lm_ckpt):
    with pytest.raises(ValueError, match='not an energy'):
        load_energy(lm_ckpt)


def test_load_energy_of_another_lm(eval_ckpts):
    with pytest.raises(ValueError, match='residual of another LM'):
        load_energy(eval_ckpts['bit'], eval_ckpts['lm2'])

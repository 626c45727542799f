"""
The rebm test suite. CPU only, tiny models and tiny synthetic corpora in pytest's tmp_path.
Every numeric check is against an independent reference (float64 brute force, exact enumeration
or a closed form). Run: python -m pytest -q test_all.py
"""

import collections
import copy
import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import train_lm  # noqa: E402
from data import load_meta  # noqa: E402
from data.shakespeare.prepare import strip_markup  # noqa: E402
from data.text import prepare as text_prepare  # noqa: E402
from model import GPT, GPTConfig, load_checkpoint, load_lm, proposal_logprobs  # noqa: E402
from tokenizer import EOT, build_tokenizer, load_tokenizer, tokenizer_meta  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from threads, and a busy machine makes them spin


# -----------------------------------------------------------------------------
# shared helpers

def run_script(args, timeout=300, env=None):
    """Run a python script/module of the repo as a subprocess from the repo root."""
    env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(res, *fragments):
    """Non-zero exit and exactly one 'error: ...' line on stderr, no traceback."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, res.stdout + res.stderr
    assert len(lines) == 1 and lines[0].startswith('error:'), res.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def tiny_gpt(vocab_size=11, block_size=32, std=0.3, seed=0, n_layer=2, n_head=2, n_embd=32):
    """A tiny random GPT in eval mode. Weights are drawn wider than GPT-2's init (std 0.02) so
    that attention and next-token distributions are far from uniform: a test that compares
    distributions must be able to see a wrong one."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                          n_head=n_head, n_embd=n_embd))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


def logprobs64(model, seqs):
    """float64 log-softmax of the full (uncached) forward: (B, T, V)."""
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        return F.log_softmax(m64(seqs)[0].double(), dim=-1)


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


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        recs = [json.loads(l) for l in f]
    losses = {r['iter']: r['loss'] for r in recs if 'loss' in r}
    vals = {r['iter']: r['val_loss'] for r in recs if 'val_loss' in r}
    return losses, vals


def prepare_corpus(dir_, files, tokenizer='char', extra=()):
    """Write {name: text} into dir_/raw and prepare it into dir_/data with data/text/prepare.py."""
    raw = dir_ / 'raw'
    raw.mkdir(parents=True)
    for name, text in files.items():
        (raw / name).write_text(text, encoding='utf-8')
    out = dir_ / 'data'
    text_prepare.main([str(raw), '--out_dir', str(out), '--tokenizer', tokenizer, *extra])
    return str(out)


TRAIN_FLAGS = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--block_size', '16',
               '--batch_size', '4', '--eval_iters', '2', '--warmup_iters', '2', '--quiet',
               '--num_samples', '0', '--device', 'cpu', '--dtype', 'float32']
CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 60


@pytest.fixture(scope='module')
def lm_corpus(tmp_path_factory):
    """A repetitive one-file char corpus (2.7k chars) that a tiny model learns in a few dozen steps."""
    return prepare_corpus(tmp_path_factory.mktemp('lm_corpus'), {'fox.txt': CORPUS},
                          extra=['--val_frac', '0.1', '--test_frac', '0.1'])


@pytest.fixture(scope='module')
def lm_ckpt(lm_corpus, tmp_path_factory):
    """A checkpoint of a few training steps on lm_corpus."""
    out = str(tmp_path_factory.mktemp('lm_ckpt'))
    train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--max_iters', '2', '--eval_interval', '2',
                   '--final_eval', '0', *TRAIN_FLAGS])
    return os.path.join(out, 'ckpt.pt')


# ---- foundation: tokenizers, data, GPT, training ----

# tokenizers

def test_char_tokenizer_roundtrip_and_unknown():
    text = "Hello, wörld!\nNaïve café — ünïcödé ✓\n\n\ttabs and  spaces\n"
    tok = build_tokenizer('char', [text])
    assert tok.vocab_size == len(set(text)) + 1 and tok.eot_id == 0
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 1 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eot_id] + ids) == text + EOT + text
    again = load_tokenizer(tokenizer_meta(tok))  # rebuilt from meta.json
    assert again.encode(text) == ids and again.decode(ids) == text
    with pytest.raises(ValueError, match=r"character 'Z' is not in this corpus's character table"):
        tok.encode("HelloZ")
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'"):
        build_tokenizer('bpe')


def test_gpt2_tokenizer_offline_ids():
    tok = build_tokenizer('gpt2')
    assert (tok.eot_id, tok.vocab_size) == (50256, 50257)
    # GPT-2's own ids (r50k_base)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262] and tok.encode("\n") == [198] and tok.encode("\n\n") == [628]
    mixed = "Hello world!\n  Ünïcode: naïve café, 日本語, emoji 🤖; numbers 3.14159\n\n\tend"
    ids = tok.encode(mixed)
    assert max(ids) < 50256 and tok.decode(ids) == mixed
    assert tok.decode([15496, 50256, 995]) == "Hello" + EOT + " world"
    assert 50256 not in tok.encode(EOT)  # an EOT inside a document's text is text, never a separator
    assert load_tokenizer(tokenizer_meta(tok)).encode(mixed) == ids


# data

DOCS = {
    'a.txt': "First document.\nIt has two lines.\n",
    'b.txt': "Second: ünïcödé — and tabs\there.\n",
    'c.txt': "Third one, short.",
    'd.txt': "Fourth\n\nwith a blank line\n",
    'e.txt': "Fifth and last; 12345!\n",
    'empty.txt': "  \n",     # whitespace only: skipped
    'notes.md': "not a .txt file: ignored",
}


@pytest.mark.parametrize('tokenizer', ['char', 'gpt2'])
def test_prepare_multi_document(tmp_path, tokenizer):
    out = prepare_corpus(tmp_path, DOCS, tokenizer)
    meta = load_meta(out)
    docs = [t for n, t in DOCS.items() if n.endswith('.txt') and t.strip()]
    tok = load_tokenizer(meta)
    assert meta['dtype'] == 'uint16' and meta['tokenizer'] == tokenizer and meta['vocab_size'] == tok.vocab_size
    assert meta['num_docs'] == dict(train=3, val=1, test=1)
    seen = collections.Counter()
    for split in ('train', 'val', 'test'):
        path = os.path.join(out, f'{split}.bin')
        assert os.path.getsize(path) == 2 * meta['num_tokens'][split]  # 2 bytes a token: uint16
        ids = np.fromfile(path, dtype=np.uint16).tolist()
        assert len(ids) == meta['num_tokens'][split]
        assert ids.count(tok.eot_id) == meta['num_docs'][split] and ids[-1] == tok.eot_id
        text = tok.decode(ids)
        pieces = text.split(EOT)[:-1]
        assert len(pieces) == meta['num_docs'][split] and all(p in docs for p in pieces)
        # the layout is exactly encode(doc) + [eot] for each document of the split
        assert text == ''.join(p + EOT for p in pieces)
        assert ids == [i for p in pieces for i in tok.encode(p) + [tok.eot_id]]
        seen.update(pieces)
    assert seen == collections.Counter(docs)  # every document in exactly one split


def test_prepare_single_file_contiguous(tmp_path):
    text = ''.join(f"line {i}: some text, ünïcode ✓\n" for i in range(40))
    out = prepare_corpus(tmp_path, {'one.txt': text}, extra=['--val_frac', '0.1', '--test_frac', '0.2'])
    meta = load_meta(out)
    tok = load_tokenizer(meta)
    assert meta['num_docs'] == dict(train=1, val=1, test=1)
    parts = []
    for split in ('train', 'val', 'test'):
        dec = tok.decode(np.fromfile(os.path.join(out, f'{split}.bin'), dtype=np.uint16).tolist())
        assert dec.endswith(EOT) and dec.count(EOT) == 1
        parts.append(dec[:-len(EOT)])
    n = len(text)
    assert parts == [text[:int(n * 0.7)], text[int(n * 0.7):int(n * 0.8)], text[int(n * 0.8):]]


def test_prepare_bad_input(tmp_path):
    script = os.path.join('data', 'text', 'prepare.py')
    res = run_script([script, str(tmp_path / 'nope.txt'), '--out_dir', str(tmp_path / 'out')])
    assert_clean_error(res, 'does not exist')
    (tmp_path / 'empty').mkdir()
    res = run_script([script, str(tmp_path / 'empty'), '--out_dir', str(tmp_path / 'out')])
    assert_clean_error(res, 'no non-empty text')
    assert not (tmp_path / 'out').exists()


def test_shakespeare_strip_markup():
    md = (
        "# Macbeth\n"
        "\n"
        "## ACT I\n"
        "\n"
        "### SCENE I. A desert place.\n"
        "\n"
        "_Thunder and lightning. Enter three Witches_\n"
        "\n"
        "**First Witch**  \n"
        "When shall we three meet again  \n"
        "In thunder, lightning, or in rain?\n"
        "\n"
        "**MACBETH**  \n"
        "_\\[Aside]_  \n"
        "Glamis, and thane of Cawdor!  \n"
        "The greatest is behind.\n"
        "\n"
        "_Exeunt, with Attendants,\n"
        "severally_\n"
        "\n"
        "**LADY MACBETH**  \n"
        "Out, damned spot! out, I say!\\--One: two: why,  \n"
        "then, 'tis time to do't. \\[Within] Hell is murky!\n"
        "\n"
        "_Exit_\n"
    )
    assert strip_markup(md) == (
        "First Witch:\n"
        "When shall we three meet again\n"
        "In thunder, lightning, or in rain?\n"
        "\n"
        "MACBETH:\n"
        "Glamis, and thane of Cawdor!\n"
        "The greatest is behind.\n"
        "\n"
        "LADY MACBETH:\n"
        "Out, damned spot! out, I say!--One: two: why,\n"
        "then, 'tis time to do't.  Hell is murky!\n"
    )


# GPT: cached decoding, log-probs, sampling

def test_cached_decoding_matches_full_forward():
    model = tiny_gpt(block_size=32)
    B, T = 3, 32
    idx = torch.randint(11, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)[0]
        for p in (1, 2, 5, 17, 31):  # ragged prompt lengths up to block_size - 1
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
            assert (got - full).abs().max().item() < 1e-5, p
        # the same in float64, where the only difference is summation order
        m64 = copy.deepcopy(model).double()
        full64 = m64(idx)[0]
        cache = m64.new_cache(B, T)
        got = torch.cat([m64(idx[:, :7], cache=cache, pos=0)[0], m64(idx[:, 7:20], cache=cache, pos=7)[0],
                         *[m64(idx[:, t:t + 1], cache=cache, pos=t)[0] for t in range(20, T)]], dim=1)
        assert (got - full64).abs().max().item() < 1e-12
        with pytest.raises(ValueError, match='longer than the model.s block_size 32'):
            model(idx[:, :2], cache=model.new_cache(B, T + 2), pos=31)


def test_sequence_logprob_brute_force():
    model = tiny_gpt(vocab_size=13, block_size=24)
    idx = torch.randint(13, (4, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(idx)[0].double()
        for start in (1, 7, 19):
            total, per_tok = model.sequence_logprob(idx, start, per_token=True)
            assert total.shape == (4,) and per_tok.shape == (4, 20 - start)
            ref = torch.zeros(4, 20 - start, dtype=torch.float64)
            for b in range(4):
                for t in range(start, 20):
                    ref[b, t - start] = F.log_softmax(logits[b, t - 1], dim=-1)[idx[b, t]]
            assert (per_tok.double() - ref).abs().max().item() < 1e-5
            assert (total.double() - ref.sum(1)).abs().max().item() < 1e-4
            assert torch.equal(model.sequence_logprob(idx, start), total)
    for bad in (0, 20):
        with pytest.raises(ValueError, match=f'start={bad} must be in'):
            model.sequence_logprob(idx, bad)


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
                                        temperature=temperature, return_proposal=True, generator=g, max_rows=6000)
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


def test_generate_seed_and_greedy():
    model = tiny_gpt(vocab_size=11, block_size=16, seed=4)
    prompt = torch.randint(11, (2, 3), generator=torch.Generator().manual_seed(5))
    a = model.generate(prompt, 6, num_samples=4, top_k=5, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 6, num_samples=4, top_k=5, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 6, num_samples=4, top_k=5, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # temperature 0: the argmax path of the full forward, the same for every sample
    tokens, logp, logq = model.generate(prompt, 6, num_samples=3, temperature=0, return_proposal=True)
    seq = prompt.clone()
    ref_lp = []
    for _ in range(6):
        lp = logprobs64(model, seq)[:, -1]
        nxt = lp.argmax(-1)
        ref_lp.append(lp.gather(-1, nxt[:, None]))
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    for s in range(3):
        assert torch.equal(tokens[:, s], seq[:, 3:])
        assert (logp[:, s].double() - torch.cat(ref_lp, 1)).abs().max().item() < 1e-5
    assert torch.equal(logq, torch.zeros_like(logq))  # greedy samples its token with probability 1


@pytest.mark.parametrize('top_k,top_p', [(1, None), (3, None), (None, 0.5), (4, 0.7)])
def test_generate_truncation_support(top_k, top_p):
    """Every sampled token is inside the top-k / nucleus of the recomputed next-token distribution."""
    V, P, L = 16, 3, 8
    model = tiny_gpt(vocab_size=V, block_size=16, seed=5)
    prompt = torch.randint(V, (2, P), generator=torch.Generator().manual_seed(6))
    tokens, logp, logq = model.generate(prompt, L, num_samples=50, top_k=top_k, top_p=top_p, return_proposal=True,
                                        generator=torch.Generator().manual_seed(1))
    seqs = torch.cat([prompt.repeat_interleave(50, 0), tokens.view(100, L)], dim=1)
    lp = logprobs64(model, seqs)[:, P - 1:-1]
    allowed = torch.from_numpy(np.isfinite(brute_proposal64(lp.numpy(), top_k, top_p))).view_as(lp)
    assert allowed.gather(-1, tokens.view(100, L, 1)).all()
    if top_k is not None:  # also directly: within the k largest logits
        ranks = (lp > lp.gather(-1, tokens.view(100, L, 1))).sum(-1)
        assert ranks.max().item() < top_k
    if top_k == 1:  # top-1 is greedy
        assert torch.equal(tokens, model.generate(prompt, L, num_samples=50, temperature=0)[0])


def test_proposal_logprobs_brute_force():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(300, 20, generator=g) * 2.5
    for top_k, top_p, temperature in [(None, None, 1.0), (5, None, 1.0), (20, None, 1.0), (1, None, 1.0),
                                      (None, 0.9, 1.0), (None, 0.5, 1.0), (None, 1e-3, 1.0), (None, 0.999, 1.0),
                                      (None, 1.0, 1.0), (None, 0.7, 0.5), (None, 0.7, 2.0), (6, 0.8, 1.3),
                                      (3, None, 0.4)]:
        got = proposal_logprobs(logits, top_k, top_p, temperature).double().numpy()
        ref = brute_proposal64(logits.numpy(), top_k, top_p, temperature)
        assert (np.isfinite(got) == np.isfinite(ref)).all(), (top_k, top_p, temperature)
        fin = np.isfinite(ref)
        assert np.abs(got[fin] - ref[fin]).max() < 1e-5, (top_k, top_p, temperature)
        if top_p is not None and top_k is None:  # the smallest set reaching mass top_p:
            base = F.softmax(logits.double() / temperature, -1).numpy()
            mass = np.where(fin, base, 0).sum(1)
            least = np.where(fin, base, np.inf).min(1)
            assert (mass >= top_p - 1e-12).all() and (mass - least < top_p).all()  # without its least likely token it falls short


def test_generate_shapes_chunking_and_prompt_rows():
    V, P, L = 11, 4, 5
    model = tiny_gpt(vocab_size=V, block_size=16, seed=6)
    prompt = torch.randint(V, (3, P), generator=torch.Generator().manual_seed(2))
    for max_rows, kw in [(512, {}), (2, {}), (4, dict(top_k=4, temperature=0.8)), (7, dict(top_p=0.9))]:
        tokens, logp, logq = model.generate(prompt, L, num_samples=5, max_rows=max_rows, return_proposal=True,
                                            generator=torch.Generator().manual_seed(0), **kw)
        assert tokens.shape == logp.shape == logq.shape == (3, 5, L)
        assert tokens.dtype == torch.long and 0 <= tokens.min() and tokens.max() < V
        assert (logq <= 1e-6).all() and torch.isfinite(logq).all()
        # each row continues its own prompt: generate's log-probs are those of cat(prompt_b, sample)
        seqs = torch.cat([prompt.repeat_interleave(5, 0), tokens.view(15, L)], dim=1)
        total, per_tok = model.sequence_logprob(seqs, P, per_token=True)
        assert (logp.view(15, L) - per_tok).abs().max().item() < 1e-4
        assert (logp.sum(-1).view(15) - total).abs().max().item() < 1e-4
        wrong = model.sequence_logprob(torch.cat([prompt.roll(1, 0).repeat_interleave(5, 0), tokens.view(15, L)], 1), P)
        assert (logp.sum(-1).view(15) - wrong).abs().max().item() > 1e-2  # the check can see a mixed-up prompt
    # heavily chunked (80 chunks of 100 samples per prompt): each prompt's first token still
    # follows that prompt's exact next-token distribution
    tokens = model.generate(prompt, 1, num_samples=8000, max_rows=300, generator=torch.Generator().manual_seed(3))[0]
    exact = logprobs64(model, prompt)[:, -1].exp()
    for b in range(3):
        emp = torch.bincount(tokens[b, :, 0], minlength=V).double() / 8000
        assert 0.5 * (emp - exact[b]).abs().sum().item() < 0.03
    assert 0.5 * (exact[0] - exact[1]).abs().sum().item() > 0.1  # prompts with distinct distributions


def test_generate_bad_arguments():
    model = tiny_gpt(vocab_size=11, block_size=16)
    prompt = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match='exceeds the model.s block_size 16'):
        model.generate(torch.zeros(1, 17, dtype=torch.long), 1)
    with pytest.raises(ValueError, match='10 tokens \\+ 7 new tokens exceeds'):
        model.generate(prompt, 7)
    for k in (0, -1, 12):
        with pytest.raises(ValueError, match=f'top_k={k} must be between 1 and the vocabulary size 11'):
            model.generate(prompt, 2, top_k=k)
    for p in (0.0, 1.5):
        with pytest.raises(ValueError, match=f'top_p={p} must be in'):
            model.generate(prompt, 2, top_p=p)
    with pytest.raises(ValueError, match='temperature=-1 must be >= 0'):
        model.generate(prompt, 2, temperature=-1)


# training

def test_training_lowers_loss(lm_corpus, tmp_path, capsys):
    out = str(tmp_path / 'out')
    res = train_lm.main(['--data_dir', lm_corpus, '--out_dir', out, '--max_iters', '60', '--eval_interval', '30',
                         '--log_interval', '1', *TRAIN_FLAGS, '--lr', '1e-2', '--batch_size', '8',
                         '--num_samples', '2'])  # later flags win
    losses, vals = read_log(out)
    V = load_meta(lm_corpus)['vocab_size']
    assert sorted(losses) == list(range(1, 61)) and sorted(vals) == [30, 60]
    first = np.mean([losses[i] for i in (1, 2, 3)])
    last = np.mean([losses[i] for i in (58, 59, 60)])
    assert abs(first - math.log(V)) < 0.5  # a fresh model is close to uniform: ln V
    assert last < 0.5 * first, (first, last)
    assert vals[60] < 0.5 * math.log(V) and res['val_loss'] < 0.5 * math.log(V)
    assert abs(res['val_ppl'] - math.exp(res['val_loss'])) < 1e-9
    printed = capsys.readouterr().out
    assert '--- sample 2:' in printed  # samples still print when block_size is small
    model, ckpt = load_lm(os.path.join(out, 'ckpt.pt'), meta=load_meta(lm_corpus))
    assert ckpt['iter_num'] == 60 and model.config.block_size == 16


def test_resume_is_exact(lm_corpus, tmp_path):
    flags = ['--data_dir', lm_corpus, '--eval_interval', '4', '--log_interval', '1', '--lr_decay_iters', '8',
             '--dropout', '0.1', '--final_eval', '0', *TRAIN_FLAGS]
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    train_lm.main(['--out_dir', a, '--max_iters', '8', *flags])
    train_lm.main(['--out_dir', b, '--max_iters', '4', *flags])
    assert load_checkpoint(os.path.join(b, 'ckpt.pt'))['iter_num'] == 4
    torch.manual_seed(123)  # whatever the global RNG holds, resume restores the checkpoint's
    train_lm.main(['--out_dir', b, '--max_iters', '8', '--resume', *flags])
    la, va = read_log(a)
    lb, vb = read_log(b)
    assert sorted(la) == sorted(lb) == list(range(1, 9))
    for it in range(1, 9):
        assert abs(la[it] - lb[it]) <= 1e-6, (it, la[it], lb[it])
    assert abs(va[8] - vb[8]) <= 1e-6
    ca, cb = (load_checkpoint(os.path.join(d, 'ckpt.pt')) for d in (a, b))
    assert ca['iter_num'] == cb['iter_num'] == 8
    for k in ca['model']:
        assert (ca['model'][k] - cb['model'][k]).abs().max().item() <= 1e-6, k


def test_ddp_matches_single_process(lm_corpus, tmp_path):
    flags = ['--data_dir', lm_corpus, '--max_iters', '6', '--eval_interval', '3', '--log_interval', '1',
             '--grad_accum', '2', *TRAIN_FLAGS]
    ddp, single = str(tmp_path / 'ddp'), str(tmp_path / 'single')
    res = run_script(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', 'train_lm.py',
                      '--out_dir', ddp, *flags])
    assert res.returncode == 0, res.stdout + res.stderr  # train_lm checks the ranks' parameters agree
    assert '2 process(es)' in res.stdout
    r1 = train_lm.main(['--out_dir', single, *flags])
    (ld, vd), (ls, vs) = read_log(ddp), read_log(single)
    assert sorted(ld) == sorted(ls) == list(range(1, 7)) and sorted(vd) == sorted(vs) == [3, 6]
    for it in ls:
        assert abs(ld[it] - ls[it]) < 1e-4, (it, ld[it], ls[it])
    for it in vs:
        assert abs(vd[it] - vs[it]) < 1e-4, (it, vd[it], vs[it])
    with open(os.path.join(ddp, 'results.json')) as f:
        rd = json.load(f)
    assert abs(rd['test_loss'] - r1['test_loss']) < 1e-4
    md, ms = (load_checkpoint(os.path.join(d, 'ckpt.pt'))['model'] for d in (ddp, single))
    assert md.keys() == ms.keys()
    for k in ms:
        assert (md[k] - ms[k]).abs().max().item() < 1e-4, k


# bad input: one clear 'error:' line, no traceback

def test_train_lm_bad_input(lm_corpus, lm_ckpt, tmp_path):
    def train(data_dir, out_dir, *extra):
        return run_script(['train_lm.py', '--data_dir', str(data_dir), '--out_dir', str(out_dir),
                           '--max_iters', '2', *TRAIN_FLAGS, *extra])

    assert_clean_error(train(tmp_path / 'missing', tmp_path / 'o1'), 'no prepared data')
    (tmp_path / 'empty').mkdir()
    assert_clean_error(train(tmp_path / 'empty', tmp_path / 'o2'), 'no prepared data')

    # an existing checkpoint without --resume: refused, and left untouched
    out = tmp_path / 'existing'
    out.mkdir()
    ckpt = out / 'ckpt.pt'
    ckpt.write_bytes(open(lm_ckpt, 'rb').read())
    before = (ckpt.read_bytes(), ckpt.stat().st_mtime_ns)
    assert_clean_error(train(lm_corpus, out), 'exists: pass --resume')
    assert (ckpt.read_bytes(), ckpt.stat().st_mtime_ns) == before

    # --resume with no checkpoint, with a truncated one, with one of another vocabulary
    assert_clean_error(train(lm_corpus, tmp_path / 'none', '--resume'), 'does not exist')
    bad = tmp_path / 'corrupt'
    bad.mkdir()
    (bad / 'ckpt.pt').write_bytes(open(lm_ckpt, 'rb').read()[:1000])
    assert_clean_error(train(lm_corpus, bad, '--resume'), 'corrupt or truncated')
    other = prepare_corpus(tmp_path / 'other', {'x.txt': "XYZ xyz 0123456789 ~~~\n" * 40})
    assert_clean_error(train(other, out, '--resume'), 'another vocabulary')
    assert (ckpt.read_bytes(), ckpt.stat().st_mtime_ns) == before

    # a test split too short for one window: refused before training, not a NaN perplexity
    short = prepare_corpus(tmp_path / 'short', {'s.txt': CORPUS[:400]}, extra=['--val_frac', '0.1', '--test_frac', '0.02'])
    assert_clean_error(train(short, tmp_path / 'o3'), 'test split has')

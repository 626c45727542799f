"""data/ and the tokenizers (data/tokenizer.py, data/text/prepare.py, the corpora's prepare.py): tokens
round-trip, each document prepared once (train/select/val/test), windows across documents, one
seeding rule.
The tests to read first are in test_all.py."""

import collections
import math
import os

import numpy as np
import pytest
import torch

from data import load_meta, window_tokens, windows
from data.shakespeare.prepare import strip_markup
from data.tokenizer import EOT, build_tokenizer, load_tokenizer, tokenizer_meta
from plumbing import rng_seed

from tests.common import prepare_corpus


# =============================================================================
# ==== data/tokenizer: tokens round-trip, each document prepared once (train/select/val/test),
#      windows across documents, one seeding rule ====

CHAR_TEXT = "Hello, wörld!\nNaïve café — ünïcödé ✓\n\n\ttabs and  spaces\n"


def test_char_tokenizer_roundtrip():
    text = CHAR_TEXT
    tok = build_tokenizer('char', [text])
    assert tok.vocab_size == len(set(text)) + 1 and tok.eot_id == 0
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 1 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eot_id] + ids) == text + EOT + text
    again = load_tokenizer(tokenizer_meta(tok))  # rebuilt from meta.json
    assert again.encode(text) == ids and again.decode(ids) == text


def test_char_tokenizer_unknown_character():
    tok = build_tokenizer('char', [CHAR_TEXT])
    with pytest.raises(ValueError, match=r"character 'Z' is not in this corpus's character table"):
        tok.encode("HelloZ")


def test_unknown_tokenizer():
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
    assert (meta['dtype'] == 'uint16' and meta['tokenizer'] == tokenizer
            and meta['vocab_size'] == tok.vocab_size)
    assert meta['num_docs'] == dict(train=2, select=1, val=1, test=1)
    seen = collections.Counter()
    for split in ('train', 'select', 'val', 'test'):
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
    assert meta['num_docs'] == dict(train=1, select=1, val=1, test=1)
    parts = []
    for split in ('train', 'select', 'val', 'test'):
        dec = tok.decode(np.fromfile(os.path.join(out, f'{split}.bin'), dtype=np.uint16).tolist())
        assert dec.endswith(EOT) and dec.count(EOT) == 1
        parts.append(dec[:-len(EOT)])
    n = len(text)
    assert parts == [text[:int(n * 0.65)], text[int(n * 0.65):int(n * 0.7)], text[int(n * 0.7):int(n * 0.8)],
                     text[int(n * 0.8):]]


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


def windows_brute(data, P, L, stride=None):
    n, stride = P + L, stride or P + L
    return [o for o in range(len(data)) if o % stride == 0 and o + n <= len(data)]


@pytest.mark.parametrize('P,L,stride', [(4, 6, None), (2, 1, None), (3, 3, 1), (5, 5, 4), (1, 1, 7),
                                        (30, 10, None)])
def test_windows_brute_force(P, L, stride):
    rng_ = np.random.default_rng(0)
    eot = 0
    docs = [rng_.integers(1, 9, size=k).tolist() for k in (0, 1, 3, 9, 10, 11, 25, 0, 0, 17, 40, 2, 10)]
    data = np.array(sum((d + [eot] for d in docs), []), dtype=np.uint16)
    got = windows(data, P, L, stride)
    ref = windows_brute(data.tolist(), P, L, stride)
    assert got.dtype == np.int64 and got.tolist() == ref
    assert any(eot in data[o:o + P + L].tolist() for o in got)  # windows cross document ends
    toks = window_tokens(data, got, P + L)
    assert toks.dtype == torch.int64 and toks.tolist() == [data[o:o + P + L].tolist() for o in ref]
    for m in (1, 2, 3, 7, len(ref) - 1, len(ref), len(ref) + 5):
        sub = windows(data, P, L, stride, max_windows=m).tolist()
        if m >= len(ref):
            assert sub == ref
            continue
        idx = [ref.index(o) for o in sub]  # a subset, in order, of m distinct windows
        assert len(sub) == m and idx == sorted(set(idx)) and idx[0] == 0
        if m > 1:  # evenly spaced from the first to the last window
            gaps = np.diff(idx)
            assert idx[-1] == len(ref) - 1 and gaps.max() - gaps.min() <= 1, (m, idx)


def test_windows_none_fit():
    assert len(windows(np.array([1, 2, 0, 3], dtype=np.uint16), 3, 2)) == 0


def test_end_of_text_cannot_separate_real_from_sampled():
    """With an exact LM (here the Markov chain that wrote the corpus), the end-of-text token is as
    frequent in real continuations x+ as in LM samples x-, so no energy can separate them by it.
    Windows kept inside documents (rebm's old rule) never showed it in x+: a free give-away."""
    V, eot, P, L = 5, 0, 3, 6
    g = torch.Generator().manual_seed(0)
    T = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    T[:, eot] = 0.08
    T /= T.sum(1, keepdim=True)
    stream = [1]
    for u in torch.rand(60000, generator=g).tolist():
        stream.append(int(np.searchsorted(np.cumsum(T[stream[-1]].numpy()), u * 0.999999)))
    data = np.array(stream, dtype=np.uint16)
    x = window_tokens(data, windows(data, P, L), P + L)
    real = x[:, P:]
    prev, fake = x[:, P - 1], []
    for _ in range(L):
        prev = torch.multinomial(T[prev], 1, generator=g).squeeze(1)
        fake.append(prev)
    fake = torch.stack(fake, 1)
    has_real, has_fake = (real == eot).any(1).double(), (fake == eot).any(1).double()
    se = math.sqrt((has_real.var() + has_fake.var()) / len(has_real))
    assert has_real.mean() > 0.2 and abs(has_real.mean() - has_fake.mean()) < 4 * se


def test_rng_seeds_are_distinct():
    """One seeding rule: every (seed, purpose, split, index) gets its own stream."""
    seeds = [rng_seed(1337, p, s, c)
             for p in ('negatives', 'log_z') for s in ('train', 'val', 'test') for c in range(300)]
    assert len(set(seeds)) == len(seeds)
    assert (rng_seed(1337, 'log_z', 'val', 3) == rng_seed(1337, 'log_z', 'val', 3)
            != rng_seed(7, 'log_z', 'val', 3))
    assert 0 <= rng_seed(-5, 'negatives', 'test', 0) < 2**32


# ==== issue 57, items 2 and 4: a split is checked against its meta.json; meta.json records the
#      preparation's flags and seed ====

def test_a_split_is_checked_against_meta_json(tmp_path):
    """train.bin cut short, meta.json's vocab_size edited 13 -> 12, or a token beyond the vocabulary:
    one line naming the file (the probe: train_lm.py trained on 1,000 of 15,000 tokens, rc 0; an
    IndexError deep in the embedding)."""
    import json
    import shutil
    from data import load_split
    out = prepare_corpus(tmp_path, {'a.txt': CORPUS_ABC}, extra=['--quiet'])
    meta = load_meta(out)
    assert len(load_split(out, 'train', meta)) == meta['num_tokens']['train']  # whole: read as before
    cut, edited, beyond = (shutil.copytree(out, tmp_path / d) for d in ('cut', 'edited', 'beyond'))
    with open(cut / 'train.bin', 'r+b') as f:
        f.truncate(2 * 100)
    with pytest.raises(ValueError, match=r"cut/train.bin holds 100 tokens, but .*meta.json records "
                                         rf"{meta['num_tokens']['train']:,}: truncated"):
        load_split(str(cut), 'train')
    (edited / 'meta.json').write_text(json.dumps(dict(meta, vocab_size=meta['vocab_size'] - 1)))
    with pytest.raises(ValueError, match=rf"edited/meta.json: vocab_size {meta['vocab_size'] - 1} is not its "
                                         rf"char tokenizer's {meta['vocab_size']}"):
        load_split(str(edited), 'train')
    ids = np.fromfile(beyond / 'val.bin', dtype=np.uint16)
    ids[3] = meta['vocab_size']
    ids.tofile(beyond / 'val.bin')
    with pytest.raises(ValueError, match=rf"beyond/val.bin holds token id {meta['vocab_size']}, beyond the "
                                         rf"vocabulary of {meta['vocab_size']}"):
        load_split(str(beyond), 'val')
    assert meta['made_with']['flags']['seed'] == 0 and meta['made_with']['flags']['val_frac'] == 0.05


CORPUS_ABC = "a cab, a bad cab.\n" * 200


def fake_negatives(d, data_dir, N=4, K=3, L=2):
    """A complete negatives folder of N prefixes x K samples of L tokens (zeros) of the train split of
    data_dir, as negatives.py writes it."""
    from plumbing import write_json
    os.makedirs(d)
    for name, size in (('tokens', N * K * L * 2), ('logp', N * K * 4), ('logq', N * K * 4), ('done', 2),
                       ('pos_logp', N * 4), ('pos_logq', N * 4)):
        (d / f'{name}.bin').write_bytes(bytes(size))
    np.save(d / 'offsets.npy', np.arange(N, dtype=np.int64))
    write_json(dict(lm_path='lm.pt', lm_hash='0', data_dir=data_dir, split='train', prefix_len=2, gen_len=L,
                    num_prefixes=N, num_samples=K, chunk=2, seed=0, dtype='uint16', top_k=None, top_p=None,
                    temperature=1.0, complete=True), str(d / 'meta.json'))


@pytest.mark.parametrize('damage, said', [
    (lambda d: open(d / 'tokens.bin', 'r+b').truncate(10), r'tokens.bin holds 10 bytes, not the 48'),
    (lambda d: open(d / 'logp.bin', 'ab').write(bytes(4)), r'logp.bin holds 52 bytes, not the 48'),
    (lambda d: os.remove(d / 'logq.bin'), r'logq.bin is missing'),
    (lambda d: np.save(d / 'offsets.npy', np.arange(3)), r'offsets.npy holds int64 of shape \(3,\), not 4'),
    (lambda d: (d / 'offsets.npy').write_bytes(b'junk'), r'offsets.npy is not a NumPy array'),
    (lambda d: np.save(d / 'offsets.npy', np.arange(4) * 10**6), r'offsets.npy holds offsets beyond the'),
    (lambda d: np.full(24, 999, np.uint16).tofile(d / 'tokens.bin'), r'tokens.bin holds token id 999, '),
], ids=['tokens-cut', 'logp-longer', 'logq-missing', 'offsets-short', 'offsets-junk', 'offsets-beyond',
        'token-beyond'])
def test_negatives_files_are_checked_against_their_meta(tmp_path, damage, said):
    """A negatives folder whose file is cut, extended, missing or replaced: one line naming the file
    and the fix (a cut tokens.bin gave np.memmap's unnamed 'mmap length is greater than file size';
    a longer logp.bin read silently; offsets or tokens out of range, an IndexError)."""
    from data import load_negatives
    fake_negatives(tmp_path / 'neg', prepare_corpus(tmp_path, {'a.txt': CORPUS_ABC}, extra=['--quiet']))
    assert load_negatives(str(tmp_path / 'neg'))['tokens'].shape == (4, 3, 2)
    damage(tmp_path / 'neg')
    with pytest.raises(ValueError, match=said + r'.*delete .*neg and rerun negatives.py'):
        load_negatives(str(tmp_path / 'neg'))

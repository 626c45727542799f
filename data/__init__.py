"""
The on-disk format of a prepared corpus, shared by every data/<corpus>/prepare.py and every reader:

    <data_dir>/train.bin, select.bin,         token ids (uint16 if the vocabulary fits, else uint32);
             val.bin, test.bin                each document is followed by the end-of-text id
    <data_dir>/meta.json                      tokenizer (and char table), vocab size, dtype,
                                              eot id, token and document counts per split

meta.json is written last, so a data dir that has one is complete.
"""

import json
import os

import numpy as np
import torch

from model import file_hash
from tokenizer import build_tokenizer, tokenizer_meta

# select: documents carved from training that choose what is tuned (early stopping, learning
# rates, recipes), so that val and test are only ever reported
SPLITS = ('train', 'select', 'val', 'test')


def write_dataset(out_dir, docs, tokenizer):
    """docs: {split: [document text, ...]} for train/val/test; tokenizer from tokenizer.py."""
    for split in SPLITS:
        if not docs.get(split):
            raise ValueError(f"split '{split}' has no documents: give it some text")
    os.makedirs(out_dir, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
    meta = dict(tokenizer_meta(tokenizer), dtype=np.dtype(dtype).name, num_tokens={}, num_docs={})
    for split in SPLITS:
        ids = []
        for doc in docs[split]:
            ids.extend(tokenizer.encode(doc))
            ids.append(tokenizer.eot_id)
        path = os.path.join(out_dir, f'{split}.bin')
        np.array(ids, dtype=dtype).tofile(path + '.tmp')
        os.replace(path + '.tmp', path)
        meta['num_tokens'][split], meta['num_docs'][split] = len(ids), len(docs[split])
    write_json(meta, os.path.join(out_dir, 'meta.json'))
    return meta


def write_text(text, path):
    """Atomic text write, like write_json."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        f.write(text)
    os.replace(path + '.tmp', path)


def write_json(obj, path):
    """Atomic JSON write (temp file + rename): a reader never sees half a file."""
    write_text(json.dumps(obj, indent=2), path)


def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise ValueError(f"no prepared data in '{data_dir}' (missing meta.json): "
                         f"run data/shakespeare/prepare.py or data/text/prepare.py first")
    with open(path) as f:
        return json.load(f)


def load_split(data_dir, split, meta=None):
    """Token ids of one split as a read-only memmap."""
    meta = meta or load_meta(data_dir)
    path = os.path.join(data_dir, f'{split}.bin')
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise ValueError(f"split file {path} is missing or empty (data prepared before the 'select' split "
                         f"existed lack it): re-run the data's prepare.py")
    return np.memmap(path, dtype=meta['dtype'], mode='r')


def prepare(docs, out_dir, tokenizer_name, quiet=False):
    """Shared by every data/<corpus>/prepare.py: docs {split: [text, ...]} -> out_dir/*.bin + meta.json."""
    tok = build_tokenizer(tokenizer_name, [d for split in docs.values() for d in split])
    meta = write_dataset(out_dir, docs, tok)
    if not quiet:
        print(f"{out_dir}: {tok.name} tokenizer, vocab {tok.vocab_size}, tokens " +
              ", ".join(f"{s} {n:,}" for s, n in meta['num_tokens'].items()) +
              " (docs " + ", ".join(f"{s} {n}" for s, n in meta['num_docs'].items()) + ")")
    return meta


# -----------------------------------------------------------------------------
# prefix + continuation windows: the unit of NCE training (x+), estimation and sampling

def windows(data, prefix_len, gen_len, stride=None, max_windows=None):
    """Start offsets o of the windows data[o : o + prefix_len + gen_len], stepping by stride
    (default prefix_len + gen_len: no overlap) through the split's token stream. As in the
    paper, a window may cross a document end: the end-of-text token then appears in real text
    as often as in LM samples (a window kept inside documents never shows it, and an energy
    would spot every sample that emits it). With max_windows, an evenly spaced subset."""
    n = prefix_len + gen_len
    offsets = np.arange(0, len(data) - n + 1, stride or n)
    if max_windows and len(offsets) > max_windows:
        offsets = offsets[np.linspace(0, len(offsets) - 1, max_windows).round().astype(int)]
    return offsets.astype(np.int64)


def window_tokens(data, offsets, length):
    """(N, length) int64 tensor of the windows data[o : o + length]."""
    return torch.from_numpy(np.stack([data[o:o + length].astype(np.int64) for o in offsets]))


# -----------------------------------------------------------------------------
# negatives.py's output: K LM samples per prefix of a split

def untruncated(meta):
    """Negatives drawn from P_LM itself (generate's exact path): log q = log P_LM, NCE's d = 0."""
    return (meta['top_k'], meta['top_p'], meta['temperature']) == (None, None, 1.0)


def load_negatives(out_dir, mode='r', lm_path=None):
    """A negatives dir as a dict: meta, offsets (N,), and memmaps tokens (N,K,L), logp (N,K),
    logq (N,K), pos_logp (N,), pos_logq (N,), done; with lm_path, checked to come from that LM.
    Reading needs a complete run. Dirs written before pos_logp/pos_logq existed still read when
    untruncated (d = 0: the positives' scores are not needed), with those two set to None."""
    if not os.path.isfile(os.path.join(out_dir, 'meta.json')):
        raise ValueError(f"no negatives in '{out_dir}' (missing meta.json): run negatives.py first")
    meta = load_meta(out_dir)
    if mode == 'r' and not meta.get('complete'):
        raise ValueError(f"negatives in {out_dir} are incomplete: rerun negatives.py with the same flags to finish them")
    if lm_path is not None and meta['lm_hash'] != file_hash(lm_path):
        raise ValueError(f"negatives in {out_dir} were sampled from another LM ({meta['lm_path']}) "
                         f"than {lm_path}: regenerate them with negatives.py --lm {lm_path}")
    N, K, L = meta['num_prefixes'], meta['num_samples'], meta['gen_len']
    n_chunks = (N + meta['chunk'] - 1) // meta['chunk']
    mm = lambda name, dtype, shape: np.memmap(os.path.join(out_dir, f'{name}.bin'), dtype=dtype, mode=mode, shape=shape)
    has_pos = os.path.isfile(os.path.join(out_dir, 'pos_logq.bin'))
    if not has_pos and (mode != 'r' or not untruncated(meta)):
        raise ValueError(f"negatives in {out_dir} predate the stored log P_LM / log q of real continuations, which "
                         f"{'NCE with truncated negatives needs' if mode == 'r' else 'a resumed run writes'}: "
                         f"regenerate them into a new --out_dir")
    pos = lambda name: mm(name, 'float32', (N,)) if has_pos else None
    return dict(meta=meta, offsets=np.load(os.path.join(out_dir, 'offsets.npy')),
                tokens=mm('tokens', meta['dtype'], (N, K, L)), logp=mm('logp', 'float32', (N, K)),
                logq=mm('logq', 'float32', (N, K)), pos_logp=pos('pos_logp'), pos_logq=pos('pos_logq'),
                done=mm('done', 'uint8', (n_chunks,)))


def log_ratios(neg, rows, neg_idx, device='cpu'):
    """nce_loss's d = log P_LM - log q of the real continuations of prefixes `rows` (B,) and of
    their negatives neg_idx (B, M), as float32 tensors; (None, None) for untruncated negatives.
    d_pos is +inf where the real continuation lies outside q's support."""
    if untruncated(neg['meta']):
        return None, None
    d_pos = neg['pos_logp'][rows] - neg['pos_logq'][rows]
    d_neg = neg['logp'][rows[:, None], neg_idx] - neg['logq'][rows[:, None], neg_idx]
    return torch.from_numpy(d_pos).to(device), torch.from_numpy(d_neg).to(device)

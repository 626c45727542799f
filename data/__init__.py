"""
The on-disk format of a prepared corpus, shared by every data/<corpus>/prepare.py and every reader:

    <data_dir>/train.bin, val.bin, test.bin   token ids (uint16 if the vocabulary fits, else uint32);
                                              each document is followed by the end-of-text id
    <data_dir>/meta.json                      tokenizer (and char table), vocab size, dtype,
                                              eot id, token and document counts per split

meta.json is written last, so a data dir that has one is complete.
"""

import json
import os

import numpy as np

from tokenizer import tokenizer_meta

SPLITS = ('train', 'val', 'test')


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


def write_json(obj, path):
    """Atomic JSON write (temp file + rename): a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=2)
    os.replace(path + '.tmp', path)


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
        raise ValueError(f"split file {path} is missing or empty: re-run the data's prepare.py")
    return np.memmap(path, dtype=meta['dtype'], mode='r')

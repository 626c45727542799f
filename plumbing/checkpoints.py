"""
The checks of a checkpoint as the method loads it (model.load_lm, energy.load_energy and the
trainers' --init_from): a rebm checkpoint of the kind asked for, its vocabulary that of the data,
a RALM's base LM and an energy's LM the very files it was trained with, finite weights; and,
before anything is built from it (check_checkpoint), the entries its kind needs, its config's fields,
types and sizes, the weights those sizes describe against the weights it holds, and the memory the
model would take: a hand-edited or damaged file is one line, never a KeyError or a 120 GB allocation.
Each refuses with one line naming the file; none changes what is loaded.
"""

import dataclasses
import os

import torch

from plumbing.budget import check_memory
from plumbing.files import checked_load, file_hash

KINDS = {'lm': 'a language model', 'mlm': 'a masked LM (train_lm.py --objective mlm)',
         'energy': 'an energy (nce_train.py)'}


def load_checkpoint(path):
    """A rebm checkpoint: a dict with the model's weights and what it is ('kind'), read with
    weights_only=True (checked_load: the file's checks)."""
    ckpt = checked_load(path)
    if not isinstance(ckpt, dict) or 'model' not in ckpt or 'kind' not in ckpt:
        raise ValueError(f"{path} is not a rebm checkpoint (no 'model'/'kind' entries)")
    return ckpt


def check_kind(ckpt, path, kind):
    """The checkpoint at path holds a model of `kind` ('lm', 'mlm' or 'energy')."""
    if ckpt['kind'] != kind:
        raise ValueError(f"{path} holds a '{ckpt['kind']}' model, not {KINDS[kind]}")


def check_vocab(ckpt, meta, path):
    """A model only makes sense with the tokenizer it was trained with."""
    ours = {k: meta.get(k) for k in ('tokenizer', 'vocab_size', 'chars')}
    theirs = {k: ckpt['meta'].get(k) for k in ('tokenizer', 'vocab_size', 'chars')}
    if ours != theirs:
        raise ValueError(f"checkpoint {path} was trained with another vocabulary "
                         f"({theirs['tokenizer']}, {theirs['vocab_size']} tokens) than this data "
                         f"({ours['tokenizer']}, {ours['vocab_size']} tokens): use the matching data dir")


def residual_base(ckpt, path):
    """The path of a RALM's base LM (its checkpoint's residual_of: path and hash), unchanged: where
    it was, or where it is from the RALM at path as it was from the RALM's --out_dir (a run folder
    moved or copied whole)."""
    base_path, base_hash = ckpt['residual_of']
    out_dir = ckpt.get('args', {}).get('out_dir')
    moved = os.path.join(os.path.dirname(path), os.path.relpath(base_path, out_dir)) if out_dir else None
    for where in (base_path, moved):
        if where and os.path.isfile(where) and file_hash(where) == base_hash:
            return where
    also = f", and so is {moved}" if moved else ''
    raise ValueError(f"RALM {path} is the residual of {base_path} (hash {base_hash}), which is missing or "
                     f"changed{also}: put that LM back, or train the RALM again")


def check_energy_of(ckpt, path, lm_path):
    """An energy checkpoint is the residual of the LM at lm_path (None: not checked)."""
    if lm_path is not None and file_hash(lm_path) != ckpt['lm_hash']:
        raise ValueError(f"energy {path} is the residual of another LM ({ckpt['lm_path']}, hash "
                         f"{ckpt['lm_hash']}) than {lm_path}: pass the LM it was trained with")


def check_registered(ckpt, path):
    """A checkpoint written by an extension whose loader this process has not registered."""
    if 'loader' in ckpt:
        raise ValueError(f"{path} holds a '{ckpt['kind']}' energy, whose loader no imported module "
                         f"registered: run the script through the extensions' launcher, which imports "
                         f"{ckpt['loader']} (docs/using.md, 'Extensions')")


def check_finite(model, path):
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError(f"{path} holds non-finite weights (its training diverged): "
                         "retrain it with a lower --lr")


def check_mlm_init(ckpt, meta, path):
    """A BIT's --init_from: a masked LM of this data's vocabulary (plus its [MASK] token)."""
    if ckpt['kind'] != 'mlm':
        raise ValueError(f"{path} is a '{ckpt['kind']}' checkpoint: a BIT starts from a "
                         f"masked-LM one (train_lm.py --objective mlm)")
    check_vocab(ckpt, meta, path)  # same size is not enough: the same tokens
    if ckpt['config']['vocab_size'] != meta['vocab_size'] + 1:
        raise ValueError(f"{path} was pretrained with another vocabulary than this data")


def check_lm_init(src, meta, path):
    """train_lm.py's --init_from: an LM or masked LM of this data's vocabulary."""
    if src['kind'] == 'energy':
        raise ValueError(f"--init_from {path} is an energy (nce_train.py), not a train_lm.py checkpoint: "
                         f"start from an LM or a masked LM")
    check_vocab(src, meta, path)


def check_same_shape(name, w, v, path):
    """A copied weight w fits v; only the vocabulary may differ, by an MLM's extra [MASK] row."""
    if w is None or w.shape[1:] != v.shape[1:] or not 0 <= v.shape[0] - w.shape[0] <= 1:
        raise ValueError(f"{path} does not have this model's shape ({name}): "
                         f"use the sizes it was trained with")


def data_dir_of(ckpt, lm_path, data_dir=None):
    """The prepared data an LM goes with: data_dir, else the folder its checkpoint records, which
    must hold prepared data seen from here."""
    if data_dir is not None:
        return data_dir
    data_dir = ckpt['meta']['data_dir']
    if not os.path.exists(os.path.join(data_dir, 'meta.json')):  # e.g. a relative path, another folder
        raise ValueError(f"{lm_path} was trained on the data in {data_dir}, which holds no prepared data "
                         f"seen from here ({os.getcwd()}): pass --data_dir with that data")
    return data_dir


# what a checkpoint of each kind holds besides 'kind' and 'model' (other kinds: an extension's,
# whose registered loader checks the rest)
REQUIRED = {'lm': ('config', 'meta'), 'mlm': ('config', 'meta'),
            'energy': ('config', 'meta', 'pool', 'lm_path', 'lm_hash')}
SIZES = ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd')  # a config must give these
MAX_SIZE = 2**24  # beyond any model a machine holds, and far below what overflows the estimate
FIX = "the file was edited or damaged; retrain it or restore a copy"


def bad(path, what):
    return ValueError(f"{path} is not a usable checkpoint ({what}): {FIX}")


def check_checkpoint(ckpt, path, config_type):
    """ckpt (torch.loaded from path) checked to be a rebm checkpoint whose model config_type (a
    dataclass: GPTConfig) can be built from its config in the memory this machine has."""
    if not isinstance(ckpt, dict) or 'model' not in ckpt or 'kind' not in ckpt:
        raise ValueError(f"{path} is not a rebm checkpoint (no 'model'/'kind' entries): give a "
                         f"train_lm.py or nce_train.py checkpoint")
    if not isinstance(ckpt['kind'], str):
        raise bad(path, f"its 'kind' is a {type(ckpt['kind']).__name__}, not a name")
    weights = ckpt['model']
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise bad(path, f"its 'model' is a {type(weights).__name__}, not a dict of named tensors")
    missing = [k for k in REQUIRED.get(ckpt['kind'], ()) if k not in ckpt]
    if missing:
        raise bad(path, f"a '{ckpt['kind']}' checkpoint without {', '.join(repr(k) for k in missing)}")
    if 'meta' in REQUIRED.get(ckpt['kind'], ()) and not isinstance(ckpt['meta'], dict):
        raise bad(path, f"its 'meta' is a {type(ckpt['meta']).__name__}, not a dict")
    if 'config' in REQUIRED.get(ckpt['kind'], ()):
        config = check_config(ckpt['config'], path, config_type)
        check_size(config, weights, path)


def check_config(config, path, config_type):
    """config_type(**config), each field of the type declared, the sizes positive and bounded."""
    if not isinstance(config, dict):
        raise bad(path, f"its 'config' is a {type(config).__name__}, not a dict")
    types = {f.name: f.type for f in dataclasses.fields(config_type)}
    unknown = sorted(set(config) - set(types))
    if unknown:
        raise bad(path, f"unknown config key '{unknown[0]}'")
    absent = [k for k in SIZES if k not in config]
    if absent:
        raise bad(path, f"its config lacks {absent[0]}")
    for k, v in config.items():
        if not of_type(v, types[k]):
            raise bad(path, f"config {k} is {v!r}, not a {getattr(types[k], '__name__', types[k])}")
        if k in SIZES and not 1 <= v <= MAX_SIZE:
            raise bad(path, f"config {k} is {v}, not between 1 and {MAX_SIZE:,}")
    if config['n_embd'] % config['n_head']:
        raise bad(path, f"config n_embd {config['n_embd']} is not a multiple of n_head {config['n_head']}")
    if not 0 <= config.get('dropout', 0.0) < 1:
        raise bad(path, f"config dropout is {config['dropout']}, not in [0, 1)")
    return config_type(**config)


def of_type(v, kind):
    """v is a kind (int, float, bool): a bool is no int here, an int is a float."""
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, kind) if isinstance(kind, type) else True


def parameters(c):
    """About the parameters a GPT-shaped model of config c has (as training_memory counts them)."""
    return 12 * c.n_layer * c.n_embd ** 2 + (c.vocab_size + c.block_size) * c.n_embd


def check_size(config, weights, path):
    """The model config describes about the size of the weights the file holds (tied ones counted
    once), and fits in memory (fp32) beside them."""
    stored = {}
    for t in weights.values():
        stored[t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()] = t.numel()
    held, wanted = sum(stored.values()), parameters(config)
    if not held / 3 <= wanted <= 3 * held:
        raise bad(path, f"its config (n_layer {config.n_layer}, n_embd {config.n_embd}, vocab_size "
                        f"{config.vocab_size}) describes ~{wanted:,} parameters, its weights hold {held:,}")
    check_memory(4 * wanted, f"loading {path} ({wanted:,} parameters)",
                 "load it on a machine with more memory", 'cpu')

"""A checkpoint checked for what it claims to be before anything is built from it: its kind, the
entries that kind needs, its config's fields, types and sizes, the weights those sizes describe
against the weights it holds, and the memory the model would take. A hand-edited or damaged file is
one line naming it, never a KeyError or a 120 GB allocation."""

import dataclasses

import torch

from plumbing.budget import check_memory

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

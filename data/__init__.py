"""
The on-disk format of a prepared corpus, shared by every data/<corpus>/prepare.py and every reader:

    <data_dir>/train.bin, select.bin,         token ids (uint16 if the vocabulary fits, else uint32);
             val.bin, test.bin                each document is followed by the end-of-text id
    <data_dir>/meta.json                      tokenizer (and char table), vocab size, dtype,
                                              eot id, token and document counts per split, and
                                              made_with: the preparation's flags and seed

meta.json is written last, so a data dir that has one is complete. A reader checks each split
against it (load_split: its length and its tokens' range, once per load) and the negatives' files
against theirs (load_negatives: each file's size).
load_lm_and_data gives a trained LM with the prepared data it goes with (its vocabulary checked).
"""

import errno
import json
import os
import shlex
import shutil
import tempfile

import numpy as np
import torch

from model import load_lm
from plumbing import (check_free_space, common_flags, content_hash, disk_full, file_hash, not_a_file,
                      out_of_space, rng, write_json)
from plumbing.checkpoints import check_vocab, data_dir_of
from data.tokenizer import build_tokenizer, tokenizer_meta

# select: documents carved from training that choose what is tuned (early stopping, learning
# rates, recipes), so that val and test are only ever reported
SPLITS = ('train', 'select', 'val', 'test')


def encode_dataset(docs, tokenizer, made_with=None):
    """docs: {split: [document text, ...]} -> ({split: token ids}, meta), each document followed
    by the end-of-text id; meta records made_with (the preparation's flags, see made_with) if given."""
    for split in SPLITS:
        if not docs.get(split):
            raise ValueError(f"split '{split}' has no documents: give it some text")
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
    meta = dict(tokenizer_meta(tokenizer), dtype=np.dtype(dtype).name, num_tokens={}, num_docs={})
    arrays = {}
    for split in SPLITS:
        ids = []
        for doc in docs[split]:
            ids.extend(tokenizer.encode(doc))
            ids.append(tokenizer.eot_id)
        arrays[split] = np.array(ids, dtype=dtype)
        meta['num_tokens'][split], meta['num_docs'][split] = len(ids), len(docs[split])
    if made_with is not None:
        meta['made_with'] = made_with
    return arrays, meta


def same_dataset(out_dir, arrays, meta):
    """out_dir already holds exactly this data (then nothing is rewritten, its meta.json's made_with
    included: models trained on it, and reproduce.py's provenance, see the same files)."""
    try:
        old = read_json(os.path.join(out_dir, 'meta.json'))
        data = lambda m: {k: v for k, v in m.items() if k != 'made_with'}  # the same tokens, however made
        if not isinstance(old, dict) or data(old) != data(meta):
            return False
        return all(np.array_equal(np.fromfile(os.path.join(out_dir, f'{s}.bin'), dtype=a.dtype), a)
                   for s, a in arrays.items())
    except (OSError, ValueError):
        return False


def write_dataset(out_dir, docs, tokenizer, force=False, made_with=None):
    """docs: {split: [document text, ...]} for train/val/test; tokenizer from tokenizer.py. Prepared
    data that differs is replaced only with force: models trained on it depend on it."""
    arrays, meta = encode_dataset(docs, tokenizer, made_with)
    if os.path.exists(os.path.join(out_dir, 'meta.json')):
        if same_dataset(out_dir, arrays, meta):
            return meta
        if not force:
            raise ValueError(f"{out_dir} already holds other prepared data "
                             "(models trained on it depend on it): "
                             f"pass --force to replace it, or choose another --out_dir")
    # the splits and meta.json appear together or not at all: written into a temporary folder
    # beside out_dir, then moved in; on failure that folder goes, and the folders this run made
    check_free_space(out_dir, sum(a.nbytes for a in arrays.values()) + 2**16, '--out_dir')
    made, parent = first_missing(out_dir), os.path.dirname(os.path.abspath(out_dir))
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(os.path.abspath(out_dir))}.', dir=parent)
        for split, ids in arrays.items():
            ids.tofile(os.path.join(tmp, f'{split}.bin'))
        write_json(meta, os.path.join(tmp, 'meta.json'))
        move_into(tmp, out_dir)
    except BaseException as e:
        full = out_of_space(e, parent)  # before the partial files go
        for d in (tmp, made):
            if d and os.path.isdir(d):
                shutil.rmtree(d, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, disk_full(out_dir), out_dir) from None
        raise
    return meta


def first_missing(path):
    """The outermost folder of path that does not exist yet (None: path exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def move_into(tmp, out_dir):
    """A prepared dataset in folder tmp moved to out_dir (renames: no disk space needed). Into an
    existing folder, file by file: its old meta.json goes first and the new one comes last, so a
    reader never takes a mix of old and new splits for a complete dataset."""
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    if os.path.exists(os.path.join(out_dir, 'meta.json')):
        os.remove(os.path.join(out_dir, 'meta.json'))
    for f in sorted(os.listdir(tmp), key=lambda f: f == 'meta.json'):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)


JSON_BOUND = 1e100  # no number a rebm script writes comes near it; arithmetic on such numbers overflows


class AbsurdNumber(ValueError):
    pass


def bounded(parse):
    """json's number parser `parse`, refusing a number beyond JSON_BOUND (10^400, 1e308)."""
    def check(text):
        v = parse(text)
        if not abs(v) <= JSON_BOUND:
            raise AbsurdNumber(text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)")
        return v
    return check


def read_json(path, fix='restore or regenerate it'):
    """A JSON file, or one error line naming it (also for a number beyond JSON_BOUND or nesting
    deeper than Python's recursion limit)."""
    if not_a_file(path):
        raise ValueError(f"{path} {not_a_file(path)}: {fix}")
    try:
        with open(path) as f:
            return json.load(f, parse_int=bounded(int), parse_float=bounded(float))
    except AbsurdNumber as e:
        raise ValueError(f"{path} holds the number {e}, beyond any a rebm file holds (|x| <= 1e100): "
                         f"{fix}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a rebm file: {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}; empty or truncated?): {fix}") from None


def check_fits(length, models):
    """Every model ({name: model}) a prefix + continuation of `length` tokens goes through holds it."""
    for name, model in models.items():
        if length > model.config.block_size:
            raise ValueError(f"prefix_len + gen_len = {length} exceeds the {name}'s block_size "
                             f"{model.config.block_size}: shorten them")


def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise ValueError(f"no prepared data in '{data_dir}' (missing meta.json): "
                         f"run python -m data.shakespeare.prepare or python -m data.text.prepare first")
    meta = read_json(path, "re-run the data's prepare.py")
    missing = [k for k in ('tokenizer', 'vocab_size', 'eot_id', 'dtype')
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: it is not a prepared data dir's meta.json; "
                         "re-run prepare.py")
    check_meta(meta, path)
    return meta


def check_meta(meta, path):
    """A prepared folder's meta.json consistent in itself: a vocabulary size of its tokenizer (a char
    table's characters + the end of text; GPT-2's 50,257), an end-of-text id and a dtype that hold
    it, and token and document counts that are counts. One line naming the file otherwise."""
    fix = "it was edited or damaged: re-run the data's prepare.py (with --force) to remake the folder"
    V, eot, dtype = meta['vocab_size'], meta['eot_id'], meta['dtype']
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
    want = {'char': len(meta['chars']) + 1 if isinstance(meta.get('chars'), str) else None,
            'gpt2': 50257}.get(meta['tokenizer'], 'unknown')
    if want == 'unknown' or want is None:
        raise ValueError(f"{path}: tokenizer {meta['tokenizer']!r}"
                         f"{' without its char table' if want is None else ' is not char or gpt2'}: {fix}")
    if not integer(V) or V != want:
        raise ValueError(f"{path}: vocab_size {V!r} is not its {meta['tokenizer']} tokenizer's {want}: {fix}")
    if not integer(eot) or not 0 <= eot < V:
        raise ValueError(f"{path}: eot_id {eot!r} is not a token of its vocabulary of {V}: {fix}")
    if dtype not in ('uint16', 'uint32') or V > np.iinfo(dtype).max + 1:
        raise ValueError(f"{path}: dtype {dtype!r} cannot hold its vocabulary of {V}: {fix}")
    for key in ('num_tokens', 'num_docs'):
        counts = meta.get(key, {})
        if not isinstance(counts, dict) or not all(integer(n) and n >= 0 for n in counts.values()):
            raise ValueError(f"{path}: {key} is not a count per split: {fix}")


def load_lm_and_data(lm_path, data_dir=None, device='cpu'):
    """The LM at lm_path and the prepared data it goes with: data_dir, else the folder it was trained
    on (its checkpoint records it), checked to have its vocabulary. Returns (lm, ckpt, data_dir, meta)."""
    lm, ckpt = load_lm(lm_path, device)
    data_dir = data_dir_of(ckpt, lm_path, data_dir)
    meta = load_meta(data_dir)
    check_vocab(ckpt, meta, lm_path)
    return lm, ckpt, data_dir, meta


ADDITION_CHARS = set('0123456789+=')


def problem_windows(meta):
    """(prefix_len, gen_len) of the problems of addition data (data/addition/prepare.py), None for
    any other data. Known from meta.json alone: a char table of digits, '+' and '=', and every
    document of every split 3N + 4 tokens (`a+b=c` of N-digit operands, then the end of text)."""
    chars, tokens, docs = meta.get('chars'), meta.get('num_tokens'), meta.get('num_docs')
    if meta.get('tokenizer') != 'char' or not chars or not {'+', '='} <= set(chars) <= ADDITION_CHARS:
        return None
    if not isinstance(tokens, dict) or not isinstance(docs, dict) or not docs:
        return None
    lengths = {tokens.get(s, 0) / n if n else 0 for s, n in docs.items()}
    T = lengths.pop() if len(lengths) == 1 else 0
    if T < 7 or T != int(T) or (T - 4) % 3:
        return None
    N = int(T - 4) // 3
    return 2 * N + 2, N + 2


def check_problem_windows(meta, prefix_len, gen_len):
    """On addition data, --prefix_len and --gen_len must be the problems' windows: any other pair
    cuts windows across problems (a prefix holding part of a sum), which trains on nonsense."""
    want = problem_windows(meta)
    if want and (prefix_len, gen_len) != want:
        raise ValueError(f"--prefix_len {prefix_len} --gen_len {gen_len} do not fit this data's addition "
                         f"problems of {sum(want)} tokens: pass --prefix_len {want[0]} --gen_len {want[1]}")


def load_split(data_dir, split, meta=None):
    """Token ids of one split as a read-only memmap, checked against meta.json: as many tokens as
    it records, each below its vocab_size (one np.max over the split, once per load)."""
    meta = meta or load_meta(data_dir)
    path = os.path.join(data_dir, f'{split}.bin')
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise ValueError(f"split file {path} is missing or empty (data prepared before the 'select' split "
                         f"existed lack it): re-run the data's prepare.py")
    fix = "re-run the data's prepare.py (with --force) to remake the folder"
    itemsize, size = np.dtype(meta['dtype']).itemsize, os.path.getsize(path)
    want = meta.get('num_tokens', {}).get(split)
    if size % itemsize or (want is not None and size != want * itemsize):
        raise ValueError(f"split file {path} holds {size / itemsize:,g} tokens, but "
                         f"{os.path.join(data_dir, 'meta.json')} records "
                         f"{'whole tokens' if want is None else f'{want:,}'}: truncated or replaced; {fix}")
    data = np.memmap(path, dtype=meta['dtype'], mode='r')
    top = int(data.max())
    if top >= meta['vocab_size']:
        raise ValueError(f"split file {path} holds token id {top}, beyond the vocabulary of "
                         f"{meta['vocab_size']} its meta.json records: the folder is damaged, or its "
                         f"meta.json is another's; {fix}")
    return data


def data_hash(data_dir, splits):
    """The content of a prepared folder that a run reads: meta.json and the splits named."""
    return content_hash([os.path.join(data_dir, f) for f in ('meta.json', *(f'{s}.bin' for s in splits))])


def prepare_flags(parser, out_dir, seed_help, tokenizer=None):
    """The flags every data/<corpus>/prepare.py takes: --out_dir (`out_dir`: its default, or None:
    required), --tokenizer (where the corpus offers a choice: its default), --seed, --quiet, --force."""
    common_flags(parser, 'out_dir', default=None if out_dir is None else dict(out_dir=out_dir),
                 help=dict(out_dir='where to write train/select/val/test.bin and meta.json'))
    if tokenizer:
        parser.add_argument('--tokenizer', default=tokenizer, choices=['char', 'gpt2'],
                            help="char: one token per character; gpt2: GPT-2's BPE (the paper's)")
    common_flags(parser, 'seed', 'quiet', 'force', default=dict(seed=0), help=dict(
        seed=seed_help, quiet='no summary line', force='replace other prepared data in --out_dir'))


FREE_PREPARE_FLAGS = ('out_dir', 'quiet', 'force', 'wheel_dir')  # they change no token


def made_with(corpus, parser, args, unused=()):
    """What meta.json records of a preparation by data/<corpus>/prepare.py: {'corpus': corpus,
    'flags': the flags that change the data, as run (the seed among them; `unused`: flags the corpus
    ignores, e.g. Shakespeare's fixed split's seed), 'defaults': their defaults}. job/reproduce.py
    compares it with the preparation it asks for (check_made_with), so data of another --data_seed
    or size is never reused silently."""
    name = {a.dest: a.option_strings[0][2:] for a in parser._actions if a.option_strings}  # as typed
    kept = [k for k in vars(args) if k not in FREE_PREPARE_FLAGS + tuple(unused)]
    return dict(corpus=corpus, flags={name.get(k, k): getattr(args, k) for k in kept},
                defaults={name.get(k, k): parser.get_default(k) for k in kept})


def prepare(docs, out_dir, tokenizer_name, quiet=False, force=False, made_with=None):
    """Shared by every data/<corpus>/prepare.py: docs {split: [text, ...]} -> out_dir/*.bin + meta.json
    (recording made_with: data.made_with's record of the flags)."""
    tok = build_tokenizer(tokenizer_name, [d for split in docs.values() for d in split])
    meta = write_dataset(out_dir, docs, tok, force, made_with)
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


def batch_offsets(n_tokens, block_size, n, seed, split, it):
    """Start offsets of the n windows of batch `it` of a split: a function of (seed, split, it)
    only, which is what makes --resume exact and DDP see the same global batch as one process."""
    return torch.randint(n_tokens - block_size - 1, (n,), generator=rng(seed, 'windows', split, it))


def get_batch(data, offsets, block_size, device):
    """The windows at offsets as (inputs, next-token targets), each (B, block_size), on device."""
    x = torch.from_numpy(np.stack([data[i:i + block_size + 1].astype(np.int64) for i in offsets.tolist()]))
    x = x.to(device, non_blocking=True)
    return x[:, :-1], x[:, 1:]


def window_tokens(data, offsets, length):
    """(N, length) int64 tensor of the windows data[o : o + length]."""
    return torch.from_numpy(np.stack([data[o:o + length].astype(np.int64) for o in offsets]))


# -----------------------------------------------------------------------------
# negatives.py's output: K LM samples per prefix of a split

def untruncated(meta):
    """Negatives drawn from P_LM itself (generate's exact path): log q = log P_LM, NCE's d = 0."""
    return (meta['top_k'], meta['top_p'], meta['temperature']) == (None, None, 1.0)


NEGATIVES_KEYS = ('lm_path', 'lm_hash', 'data_dir', 'split', 'prefix_len', 'gen_len', 'num_prefixes',
                  'num_samples', 'chunk', 'seed', 'dtype')


def read_negatives_meta(out_dir):
    if not os.path.isfile(os.path.join(out_dir, 'meta.json')):
        raise ValueError(f"no negatives in '{out_dir}' (missing meta.json): run negatives.py first")
    path = os.path.join(out_dir, 'meta.json')
    meta = read_json(path, f"if {out_dir} holds negatives, delete it and rerun negatives.py")
    missing = [k for k in NEGATIVES_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{out_dir} does not hold negatives "
                         f"(its meta.json lacks {', '.join(missing[:3])}...): "
                         f"give a folder that negatives.py wrote")
    return meta


def negatives_command(meta, out_dir):
    """The negatives.py command that makes (or finishes) the negatives meta describes."""
    flags = dict(lm=meta['lm_path'], data_dir=meta['data_dir'], split=meta['split'], out_dir=out_dir,
                 prefix_len=meta['prefix_len'], gen_len=meta['gen_len'], stride=meta.get('stride'),
                 num_prefixes=meta['num_prefixes'], num_samples=meta['num_samples'], top_k=meta.get('top_k'),
                 top_p=meta.get('top_p'), temperature=meta.get('temperature'), chunk=meta['chunk'],
                 seed=meta['seed'], dtype=meta.get('precision'))
    return shlex.join(['python', 'negatives.py']
                      + [a for k, v in flags.items() if v is not None for a in (f'--{k}', str(v))])


def negatives_hash(out_dir):
    """The content of a negatives folder, by its meta.json and the samples' log-probabilities (any
    other draw changes them; the tokens are far larger to read)."""
    return content_hash([os.path.join(out_dir, f) for f in ('meta.json', 'logp.bin')])


def load_negatives(out_dir, mode='r', lm_path=None):
    """A negatives dir as a dict: meta, offsets (N,), and memmaps tokens (N,K,L), logp (N,K),
    logq (N,K), pos_logp (N,), pos_logq (N,), done; with lm_path, checked to come from that LM.
    Reading needs a complete run. Dirs written before pos_logp/pos_logq existed still read when
    untruncated (d = 0: the positives' scores are not needed), with those two set to None."""
    meta = read_negatives_meta(out_dir)
    N, K, L = meta['num_prefixes'], meta['num_samples'], meta['gen_len']
    n_chunks = (N + meta['chunk'] - 1) // meta['chunk']
    if mode == 'r' and not meta.get('complete'):
        raise ValueError(f"negatives in {out_dir} are incomplete: "
                         "rerun negatives.py with the same flags to finish them: "
                         f"{negatives_command(meta, out_dir)}")
    if lm_path is not None and meta['lm_hash'] != file_hash(lm_path):
        raise ValueError(f"negatives in {out_dir} were sampled from another LM ({meta['lm_path']}) "
                         f"than {lm_path}: regenerate them with negatives.py --lm {lm_path}")

    def mm(name, dtype, shape):
        return np.memmap(os.path.join(out_dir, f'{name}.bin'), dtype=dtype, mode=mode, shape=shape)

    has_pos = os.path.isfile(os.path.join(out_dir, 'pos_logq.bin'))
    if not has_pos and (mode != 'r' or not untruncated(meta)):
        needs = 'NCE with truncated negatives needs' if mode == 'r' else 'a resumed run writes'
        raise ValueError(f"negatives in {out_dir} predate the stored log P_LM / log q of real continuations, "
                         f"which {needs}: regenerate them into a new --out_dir")
    pos = lambda name: mm(name, 'float32', (N,)) if has_pos else None
    if mode == 'r':
        check_negatives_files(out_dir, meta, has_pos)
    try:
        return dict(meta=meta, offsets=np.load(os.path.join(out_dir, 'offsets.npy')),
                    tokens=mm('tokens', meta['dtype'], (N, K, L)), logp=mm('logp', 'float32', (N, K)),
                    logq=mm('logq', 'float32', (N, K)), pos_logp=pos('pos_logp'), pos_logq=pos('pos_logq'),
                    done=mm('done', 'uint8', (n_chunks,)))
    except (OSError, ValueError) as e:  # a missing or truncated file: np.memmap says so without naming it
        raise ValueError(f"negatives in {out_dir} are damaged ({e}): "
                         "delete the folder and rerun negatives.py") from None


def check_negatives_files(out_dir, meta, has_pos):
    """Each file of a complete negatives folder the size its meta.json implies (a truncated or
    extended tokens.bin, logp.bin, ...: one line naming it, never samples read past or short of it),
    and offsets.npy N offsets."""
    N, K, L = meta['num_prefixes'], meta['num_samples'], meta['gen_len']
    fix = (f"the folder is damaged: delete {out_dir} and rerun negatives.py "
           f"({negatives_command(meta, out_dir)})")
    sizes = dict(tokens=N * K * L * np.dtype(meta['dtype']).itemsize, logp=N * K * 4, logq=N * K * 4,
                 done=(N + meta['chunk'] - 1) // meta['chunk'])
    if has_pos:
        sizes.update(pos_logp=N * 4, pos_logq=N * 4)
    for name, size in sizes.items():
        path = os.path.join(out_dir, f'{name}.bin')
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have != size:
            raise ValueError(f"{path} {'is missing' if have is None else f'holds {have:,} bytes'}, not the "
                             f"{size:,} its meta.json implies ({N} prefixes x {K} samples of {L} tokens): "
                             f"{fix}")
    path = os.path.join(out_dir, 'offsets.npy')
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path} is not a NumPy array ({type(e).__name__}): {fix}") from None
    if offsets.shape != (N,) or offsets.dtype.kind not in 'iu':
        raise ValueError(f"{path} holds {offsets.dtype} of shape {offsets.shape}, not {N} offsets: {fix}")
    try:  # the data they come from, where its folder is still there (its meta.json: no read of a split)
        data_meta = load_meta(meta['data_dir'])
        tokens, V = data_meta['num_tokens'][meta['split']], data_meta['vocab_size']
    except (ValueError, KeyError, TypeError, OSError):
        tokens = V = None
    end = meta['prefix_len'] + L
    if N and (offsets.min() < 0 or (tokens is not None and offsets.max() + end > tokens)):
        raise ValueError(f"{path} holds offsets beyond the {meta['split']} split of {meta['data_dir']} "
                         f"({tokens} tokens; windows of {end}): {fix}")
    path = os.path.join(out_dir, 'tokens.bin')
    top = int(np.memmap(path, dtype=meta['dtype'], mode='r').max()) if N * K * L else 0
    if V is not None and top >= V:  # one pass over the samples, once per load
        raise ValueError(f"{path} holds token id {top}, beyond the vocabulary of {V} of {meta['data_dir']}: "
                         f"{fix}")

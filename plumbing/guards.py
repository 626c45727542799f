"""
The method scripts' guards, each called in one line from the script (its main, or the method
function named beside it): their flags beyond what argparse checks, the memory, time and disk
their sizes need, the trainers' --resume fields, and what the files they read must agree on.
Nothing here computes a number of the method: each function refuses with one line naming the
flag, or returns (a few fill a flag's default that depends on others, said where they do).
"""

import os
import sys
from types import SimpleNamespace

from plumbing.budget import check_memory, check_time, check_training_memory, forward_seconds
from plumbing.checkpoints import load_checkpoint
from plumbing.files import check_free_space
from plumbing.run import at_least, check, check_new, check_writable, named_paths
from plumbing.trainer import check_training_flags

# -----------------------------------------------------------------------------
# model.py, energy.py


def check_sampling(config, P, max_new_tokens, top_k, top_p, temperature):
    """GPT.generate's sizes and proposal settings (model.cached_generate)."""
    V = config.vocab_size
    if P + max_new_tokens > config.block_size:
        raise ValueError(f"prompt of {P} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"block_size {config.block_size}: shorten the prompt or the generation")
    if top_k is not None and not 1 <= top_k <= V:
        raise ValueError(f"top_k={top_k} must be between 1 and the vocabulary size {V} "
                         "(or None for no truncation)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no truncation)")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")


def check_unit_sizes(config, sizes, path):
    """A UNIT energy has the shape of the LM it starts from (path): no size flag contradicts it."""
    for k, v in sizes.items():
        if getattr(config, k) != v:
            raise ValueError(f"a UNIT energy has the shape of the LM it starts from ({path}: "
                             f"{k}={getattr(config, k)}), not {k}={v}: drop the size flags")


# -----------------------------------------------------------------------------
# train_lm.py

# the flags beside the model's shape that change a run's numbers: a --resume keeps the checkpoint's
LM_RESUME_FIXED = ('seed', 'data_dir', 'lr', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'batch_size',
                   'grad_accum', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'dropout', 'eval_interval',
                   'eval_iters', 'select_on', 'patience', 'min_rel_delta', 'final_eval_windows',
                   'residual_of', 'init_from', 'match_params')


def lm_saved_flags(ckpt):
    """The flags a train_lm.py checkpoint ran with, its shape and precision included (None: an
    energy, which build_model refuses)."""
    if ckpt.get('kind') not in ('lm', 'mlm'):
        return None
    return dict(ckpt.get('args', {}), **ckpt['config'], objective=ckpt.get('objective', ckpt['kind']),
                gamma=ckpt.get('gamma'), dtype=ckpt.get('args', {}).get('dtype'))


def check_lm_flags(args, argv, load=None, sources=None):
    """train_lm.py's flags in range, and with --resume those given (argv) agreeing with the checkpoint,
    before any work: one line naming the flag. Parses --snapshots; args.select_layout starts None."""
    try:
        args.snapshots = sorted({int(i) for i in args.snapshots.split(',') if i.strip()})
    except ValueError:
        raise ValueError(f"--snapshots {args.snapshots}: must be comma-separated iteration numbers, "
                         f"e.g. 250,500") from None
    if (args.objective == 'tailr') != (args.gamma is not None):
        raise ValueError("--objective tailr and --gamma go together: TaiLr needs its gamma in [0, 1], "
                         "the others none")
    if args.gamma is not None and args.gamma > 1:
        raise ValueError(f"--gamma {args.gamma}: must be in [0, 1]")
    args.select_layout = None  # (P, L) of --select_on continuation, from the data (train_lm.load_data)
    shape = {'n_layer', 'n_head', 'block_size', 'bias', 'alibi', 'objective', 'gamma'}
    shape |= set() if args.match_params else {'n_embd'}  # BALM's width came from --match_params
    check_training_flags(args, argv, shape | set(LM_RESUME_FIXED), lm_saved_flags, load or load_checkpoint,
                         sources)
    return args


def check_new_lm(args, config, device, n_params=None):
    """A new model of config: a RALM is causal, BALM's width near --match_params (n_params: the
    count of config), a training step that fits in memory."""
    if args.residual_of and args.objective == 'mlm':
        raise ValueError("--residual_of trains a RALM, a causal LM: it does not go with --objective mlm")
    if n_params is not None and not 0.5 < n_params / args.match_params < 2:
        raise ValueError(f"--match_params {args.match_params}: the nearest width (n_embd {args.n_embd}) "
                         f"gives {n_params:,} parameters: change --n_layer to get near it")
    what = (f"training {args.n_layer} layers of n_embd {args.n_embd} on --batch_size {args.batch_size} x "
            f"--block_size {args.block_size}")
    check_training_memory(config, args.batch_size, device, what, "lower them (--grad_accum keeps the batch)")


def check_ralm_base(block_size, base, path):
    """A RALM reads no further back than its base LM (the model loaded from path)."""
    if block_size > base.config.block_size:
        raise ValueError(f"--block_size {block_size} exceeds that of --residual_of "
                         f"{path} ({base.config.block_size}): a RALM reads no further back "
                         f"than its base LM")


def check_split_lengths(data, block_size):
    """Every split ({name: tokens}) holds a window of block_size + 1 tokens."""
    for name, d in data.items():
        if len(d) <= block_size + 1:
            raise ValueError(f"the {name} split has {len(d)} tokens, fewer than block_size+1 = "
                             f"{block_size + 1}: lower --block_size or add text")


def check_select_layout(layout, args):
    """--select_on continuation: problem data (layout: its (prefix_len, gen_len)), a causal LM, and
    problems that fit --block_size."""
    if layout is None or args.objective == 'mlm':
        raise ValueError(f"--select_on continuation needs problem data (data/addition) and a causal LM; "
                         f"{args.data_dir} is not, or drop the flag (--select_on window)")
    if sum(layout) > args.block_size:
        raise ValueError(f"--select_on continuation: a problem is {sum(layout)} tokens, more than "
                         f"--block_size {args.block_size}: raise --block_size")


# -----------------------------------------------------------------------------
# nce_train.py

# what a resumed energy is, and the flags that change a run's numbers: a flag given with --resume
# must agree with the run it continues (left out, it takes the checkpoint's value)
NCE_RESUME_FIXED = ('energy', 'init_from', 'pool', 'context', 'n_layer', 'n_head', 'n_embd', 'dropout',
                    'loss', 'num_neg', 'select', 'seed', 'negatives', 'held_out_negatives', 'lr', 'min_lr',
                    'warmup_iters', 'lr_decay_iters', 'batch_size', 'grad_accum', 'weight_decay', 'beta1',
                    'beta2', 'grad_clip', 'eval_interval', 'eval_prefixes', 'patience', 'min_rel_delta')


def nce_saved_flags(ckpt):
    """The flags an energy's checkpoint ran with (None: another kind, which nce_train.build refuses)."""
    return ckpt.get('args', {}) if ckpt.get('kind') == 'energy' else None


def check_nce_flags(args, argv, load=None, sources=None):
    """nce_train.py's flags (check_training_flags), with --resume against the checkpoint's (read by
    load) and args.sources = sources(args), the hashes of its inputs (check_training_flags)."""
    check_training_flags(args, argv, NCE_RESUME_FIXED, nce_saved_flags, load or load_checkpoint, sources)
    return args


def check_nce_lm(lm, path):
    """--lm (its checkpoint lm) is a language model: checked first, as it decides which message is right."""
    if lm['kind'] != 'lm':
        raise ValueError(f"--lm {path} holds a '{lm['kind']}' model, not a language model: pass the "
                         f"train_lm.py checkpoint the negatives were sampled from")


def check_pairs(args, train, held):
    """The train and held-out negatives' metas: the train split and the selection split, alike in shape
    and data (held-out pairs choose best.pt: they are no training prefixes, and val and test are only
    reported)."""
    if held['split'] == train['split']:
        raise ValueError(f"--held_out_negatives {args.held_out_negatives} holds prefixes of the "
                         f"{train['split']} split, which --negatives trains on: held-out pairs must "
                         f"not be training prefixes (negatives.py --split select)")
    if train['split'] != 'train':
        raise ValueError(f"--negatives {args.negatives} were made from the {train['split']} split: "
                         f"the energy trains on the train split (negatives.py --split train)")
    for key in ('prefix_len', 'gen_len', 'data_dir'):
        if held[key] != train[key]:
            raise ValueError(f"train and held-out negatives differ in {key} ({train[key]} vs "
                             f"{held[key]}): regenerate one")
    if held['split'] != 'select':
        raise ValueError(f"--held_out_negatives {args.held_out_negatives} were made from the "
                         f"{held['split']} split: held-out pairs choose the energy kept, so "
                         f"they come from the selection split (negatives.py --split select); val and test "
                         f"are only reported")


def check_num_neg(M, K, K_held):
    """M negatives per pair: at most the K (train) and K_held (held-out) stored per prefix."""
    if not 1 <= M <= min(K, K_held):
        raise ValueError(f"--num_neg {M} must be between 1 and the {min(K, K_held)} stored negatives "
                         f"per prefix (train {K}, held-out {K_held})")


def check_untied(pool, path):
    """The ranking loss needs a training prefix with a sample unlike its real continuation."""
    if len(pool) == 0:
        raise ValueError(f"every stored sample in {path} equals its prefix's real continuation: "
                         f"the ranking loss has nothing to learn from; use --loss binary or sample more "
                         f"negatives")


def planned_config(args):
    """The shape of the energy nce_train.py will build, read before it allocates a weight: that of
    --init_from's model or of the LM, with the size flags of a BIT from scratch (a UNIT refuses them)."""
    src = load_checkpoint(args.init_from or args.lm)['config']
    sizes = {} if args.init_from or args.energy == 'unit' else dict(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    return SimpleNamespace(**dict(src, **{k: v for k, v in sizes.items() if v is not None}))


def check_energy_memory(config, rows, batch_size, device):
    """A training step of the energy config on `rows` sequences must fit (as train_lm.py checks)."""
    check_training_memory(config, rows, device,
                          f"training an energy of n_layer {config.n_layer}, n_embd {config.n_embd} on "
                          f"--batch_size {batch_size} x {rows // batch_size} sequences per pair",
                          "lower --batch_size (--grad_accum keeps the batch) or the energy's size")


def check_energy_block(length, block_size):
    if length > block_size:
        raise ValueError(f"prefix_len + gen_len = {length} of the negatives exceeds the energy's block_size "
                         f"{block_size}: regenerate shorter negatives or give the energy a larger block")


# -----------------------------------------------------------------------------
# negatives.py

def check_negatives_flags(args, chunk_tokens):
    """negatives.py's flags, before out_dir is created (a folder made with bad flags would refuse the
    fixed rerun); --chunk's default filled: about chunk_tokens sampled tokens, prompts included;
    --num_prefixes 0 (all) and --top_k 0 (untruncated) as None, as the sampler takes them."""
    args.max_prefixes, args.top_k = args.max_prefixes or None, args.top_k or None
    if args.chunk is None:  # small models decode ~8x faster in 4,096 rows than in 512 (addition)
        args.chunk = max(1, chunk_tokens // (args.num_samples * (args.prefix_len + args.gen_len)))
    # a chunk's samples come back at once: int64 tokens, float32 log P_LM and log q per token
    check_memory(args.chunk * args.num_samples * 16 * args.gen_len,
                 f"--num_samples {args.num_samples} x --chunk {args.chunk}", "lower them")
    check_writable(args.out_dir, '--out_dir')
    return args


def check_negatives_run(args, vocab_size, offsets, n_chunks, itemsize):
    """--top_k within the LM's vocabulary, a prefix in the split, and the disk for every file before
    any is created: tokens, log P_LM and log q of the samples, the two of the real continuations,
    offsets, done; 64 KiB for meta.json and the last block of each file."""
    if args.top_k is not None and args.top_k > vocab_size:
        raise ValueError(f"--top_k {args.top_k}: must be at most the vocabulary size {vocab_size}")
    P, L, K, N = args.prefix_len, args.gen_len, args.num_samples, len(offsets)
    if N == 0:
        raise ValueError(f"the {args.split} split is shorter than {P + L} tokens: "
                         "lower --prefix_len/--gen_len")
    check_free_space(args.out_dir, N * K * (L * itemsize + 8) + N * 24 + n_chunks + 2**16, '--out_dir')


def check_same_settings(old, settings, out_dir, done):
    """A folder with finished chunks (done) is resumed only with the settings it was made with."""
    if old != settings and done:
        diff = sorted(k for k in settings if old.get(k) != settings[k])
        raise ValueError(f"{out_dir} holds negatives made with other settings ({', '.join(diff)}): "
                         f"use another --out_dir or delete it")


# -----------------------------------------------------------------------------
# estimate_ppl.py

def check_ppl_flags(args, splits):
    """estimate_ppl.py's flags, checked before any work (one line naming the flag), beyond the bounds
    its parser declares; --split parsed (splits: the names a split may have)."""
    args.splits = [s for s in args.splits.split(',') if s]
    if not args.splits or any(s not in splits for s in args.splits):
        raise ValueError(f"--split {','.join(args.splits)}: must be comma-separated names of "
                         f"{', '.join(splits)}")
    check(args, 'max_prefixes', lambda v: v == 0 or v >= 2,
          '0 (all) or at least 2 (the gain has a standard error)')
    check_ppl_models(args)
    if args.per_step is not None:
        at_least(args, 2, 'last_step_samples')  # checked before the main table is computed
    check_ppl_memory(args)
    check_writable(args.out, '--out', folder=False)
    check_new(args.out, '--out', args.force, also=[os.path.splitext(args.out)[0] + '.txt'])
    return args


def check_ppl_models(args):
    """--energy and --extra_lm: names of their own; --per_step with an energy; n of at least 2."""
    if args.per_step is not None and not args.energy:
        raise ValueError("--per_step needs an energy: pass --energy NAME=CKPT")
    energies, extra = named_paths(args.energy, '--energy'), named_paths(args.extra_lm, '--extra_lm')
    taken = set(energies) & set(extra) | {'BASE LM'} & (set(energies) | set(extra))
    if taken:
        raise ValueError(f"--energy/--extra_lm: the name {min(taken)} is taken (by the other flag, or the "
                         f"base LM's row): give each model its own name")
    if min([args.num_samples] + args.sweep) < 2:
        raise ValueError("--num_samples and --ns values must be at least 2 "
                         "(the upper bound needs leave-one-out)")


def check_ppl_memory(args):
    """A batch's samples (int64 tokens) and their -E (float64, per energy), held at once: for the
    largest n, and for the calibration's reference (at least 2 groups of n samples)."""
    per_sample = 8 * args.gen_len + 8 * max(1, len(args.energy))
    n_max = max([args.num_samples] + args.sweep)
    check_memory(args.chunk * n_max * per_sample, f"--num_samples/--ns {n_max} x --chunk {args.chunk}",
                 "lower --num_samples/--ns (or --chunk)")
    if args.calib_prefixes:
        check_memory(2 * args.num_samples * per_sample, f"--num_samples {args.num_samples} (calibrated "
                     f"against --calib_samples >= 2 x {args.num_samples})",
                     "lower --num_samples (or pass --calib_prefixes 0)")
        if args.calib_samples < 2 * args.num_samples:
            raise ValueError(f"--calib_samples {args.calib_samples} must be at least 2 x --num_samples "
                             f"({2 * args.num_samples}): the calibration cuts as many samples into groups "
                             f"of n "
                             f"(or pass --calib_prefixes 0)")
        check_memory(args.calib_samples * per_sample, f"--calib_samples {args.calib_samples}", "lower it")


def check_per_step_name(name, energies):
    if name and name not in energies:
        raise ValueError(f"--per_step {name} names no energy (have: {', '.join(energies)})")


def check_ppl_prefixes(prefixes, length, out, n_models):
    """Each split ({split: offsets}) holds 2 windows of `length` tokens; the disk holds --out: the JSON
    holds ~0.2 KiB per prefix and model (0.86 MB for 512 prefixes x 8 models), 1 KiB bounds it."""
    for split, offsets in prefixes.items():
        if len(offsets) < 2:
            raise ValueError(f"the {split} split has fewer than 2 windows of {length} tokens: "
                             "lower --prefix_len/--gen_len")
    check_free_space(out, 2**16 + 2**10 * sum(map(len, prefixes.values())) * n_models, '--out')


# -----------------------------------------------------------------------------
# sample.py

def check_sample_flags(args):
    """sample.py's flags, and the memory of its log Z samples and of the Table-3 view."""
    if args.logz_samples == 1:  # the declared bounds (sample.get_args): the rest
        raise ValueError(f"--logz_samples {args.logz_samples}: "
                         "0 (off) or at least 2 (the bounds need leave-one-out)")
    per_sample = 8 * args.gen_len + 8  # int64 tokens and a float64 energy, held at once per batch
    check_memory(args.chunk * args.logz_samples * per_sample,
                 f"--logz_samples {args.logz_samples} x --chunk {args.chunk}", "lower them")
    if args.autoregressive or args.table_k:  # next_token_table: m completions of max_rows / 16 rows
        rows = max(1, args.max_rows // min(args.m, 16))
        check_memory(rows * args.m * per_sample, f"--candidate_samples {args.m}", "lower it")
    check_writable(args.out, '--out', folder=False)
    check_new(args.out, '--out', args.force)
    return args


def check_sample_vocab(args, V):
    """--top_k, and the Table-3 view's sizes, within the LM's vocabulary of V tokens."""
    if not 0 <= args.top_k <= V:
        raise ValueError(f"--top_k must be between 0 and the vocabulary size {V}")
    if ((args.autoregressive or args.table_k)
            and not (0 <= args.table_k <= args.keep <= min(args.candidates, V) and args.m >= 1)):
        raise ValueError(f"need 0 <= --table_k ({args.table_k}) <= --keep ({args.keep}) "
                         f"<= --candidates ({args.candidates}) "
                         f"and the vocabulary size ({V}), and --candidate_samples ({args.m}) >= 1")


def check_prompt(ids):
    if not ids:
        raise ValueError("--prompt is empty")


def check_prefix_count(args, offsets, held):
    """A window in the split; --num_prefixes against the `held` windows the split has (a larger count
    takes them all, and says so), and the disk for the JSON of those taken (offsets)."""
    if len(offsets) == 0:
        raise ValueError(f"no window of {args.prefix_len + args.gen_len} tokens "
                         f"in the {args.split} split")
    if held < args.num_prefixes:
        print(f"--num_prefixes {args.num_prefixes}: the {args.split} split holds {held:,} prefixes of "
              f"--prefix_len {args.prefix_len} + --gen_len {args.gen_len} tokens: taking all {held:,}",
              file=sys.stderr, flush=True)
    # the JSON holds each prefix's texts and tokens: 0.23 MB for 256 prefixes of 64 tokens (~0.9 KiB each)
    check_free_space(args.out, 2**16 + min(held, args.num_prefixes) * (2**12 + 2**6 * args.gen_len), '--out')


def check_sampling_time(lm, energy, B, P, args, device):
    """Says how long sampling B prefixes of P tokens takes, by a crude estimate from its forward
    tokens (forward_seconds), before it starts; beyond TIME_LIMIT_S only with --force. Sequences
    sampled and scored: --num_samples (Algorithm 1) and --logz_samples per prefix, and candidates x m
    completions for each Table-3 view and each step of --autoregressive."""
    L, C = args.gen_len, min(args.candidates, lm.config.vocab_size)
    rows = B * (args.n + args.logz_samples)
    sampled, scored = rows * L, rows * (P + L)
    views = (min(B, args.table_prefixes) if args.table_k else 0) + (B * L if args.autoregressive else 0)
    sampled, scored = sampled + views * C * args.m * L, scored + views * C * args.m * (P + L)
    seconds = forward_seconds(2 * lm.num_params() * sampled,
                              2 * sum(p.numel() for p in energy.parameters()) * scored, device)
    check_time(seconds, f"sampling {B} prefixes with --num_samples {args.n}"
                        + (f", --candidate_samples {args.m}" if views else ''), args.force)

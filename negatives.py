"""
Offline negatives for conditional NCE (Eq. 3): for each prefix of a split, K continuations drawn
once from the base LM and stored, as in the paper (16 or 128 per prefix, sampled uniformly among
at training time). Also home of the prefix/continuation windowing that estimate_ppl.py shares.

Default sampling is untruncated: NCE's noise distribution must be P_LM itself (Theorem 1).
--top_k/--top_p are options, recorded in meta.json with each sample's log q.

    python negatives.py --lm out/lm/ckpt.pt --split train --num_samples 4 --out_dir out/neg_train
    torchrun --standalone --nproc_per_node 2 negatives.py ...        # prefixes sharded over ranks

Output (out_dir): offsets.npy (N,) start of each prefix in the split; tokens.bin (N, K, L) sampled
continuations; logp.bin / logq.bin (N, K) float32 log P_LM and log q of each continuation;
pos_logp.bin / pos_logq.bin (N,) float32 the same for the real continuation of each prefix (log q
= -inf where q cannot propose it); done.bin, one byte per chunk of prefixes; meta.json. NCE with a
truncated q needs both: its logit is -E + log P_LM - log q (nce_train.nce_loss). Every chunk is
seeded by (seed, split, chunk), so a killed run resumes where it stopped and ends with
byte-identical files.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data import load_meta, load_split, write_json
from model import check_vocab, file_hash, load_lm, proposal_logprobs
from train_lm import progress, resolve_device, setup_distributed


def windows(data, eot_id, prefix_len, gen_len, stride=None, max_windows=None):
    """Start offsets o such that data[o : o + prefix_len + gen_len] lies inside one document (no
    end-of-text token), stepping by stride (default prefix_len + gen_len: no overlap) through
    each document. With max_windows, an evenly spaced subset (deterministic)."""
    n = prefix_len + gen_len
    stride = stride or n
    eot = np.flatnonzero(np.asarray(data) == eot_id)
    starts = np.concatenate([[0], eot + 1])
    ends = np.concatenate([eot, [len(data)]])
    offsets = np.concatenate([np.arange(s, e - n + 1, stride) for s, e in zip(starts, ends)] + [np.zeros(0, int)])
    if max_windows and len(offsets) > max_windows:
        offsets = offsets[np.linspace(0, len(offsets) - 1, max_windows).round().astype(int)]
    return offsets.astype(np.int64)


SPLITS = ('train', 'val', 'test')


def chunk_seed(seed, split, chunk, purpose=0):
    """The generator seed of one chunk of LM samples, distinct for each (seed, split, chunk,
    purpose). Two sample sets drawn from one random stream are near copies of each other even
    for different prefixes (the same uniforms pick the same characters once contexts agree), so
    val negatives seeded like the train ones would be twins the energy has memorised."""
    return int(np.random.SeedSequence([seed % 2**32, SPLITS.index(split), chunk, purpose]).generate_state(1)[0])


def window_tokens(data, offsets, length):
    """(N, length) int64 tensor of the windows data[o : o + length]."""
    return torch.from_numpy(np.stack([data[o:o + length].astype(np.int64) for o in offsets]))


@torch.no_grad()
def real_logprobs(lm, x, P, top_k=None, top_p=None, temperature=1.0):
    """log P_LM and log q (each (B,) float32) of the real continuations x[:, P:] of the rows of x
    (B, P+L), q the proposal that generate() samples negatives from with these settings (per
    token: proposal_logprobs, or the argmax at temperature 0). A real token outside q's support
    gives log q = -inf. Batched like GPT.sequence_logprob, a few rows at a time: the logits of
    every position are (rows, L, V)."""
    L = x.size(1) - P
    lp, lq = [], []
    for rows in x.split(max(1, 1024 // L)):
        logits = lm.logits(rows[:, :-1], first=P - 1).float()
        tok = rows[:, P:, None]
        logp = F.log_softmax(logits, -1).gather(-1, tok).squeeze(-1)
        if (top_k, top_p, temperature) == (None, None, 1.0):
            logq = logp
        elif temperature == 0:  # greedy: q is a point mass on the argmax
            logq = torch.where(logits.argmax(-1, keepdim=True) == tok, 0.0, float('-inf')).squeeze(-1)
        else:
            logq = proposal_logprobs(logits, top_k, top_p, temperature).gather(-1, tok).squeeze(-1)
        lp.append(logp.sum(1))
        lq.append(logq.sum(1))
    return torch.cat(lp), torch.cat(lq)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a('--lm', default='out/lm/ckpt.pt', help='base LM checkpoint (train_lm.py)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--split', default='train', choices=SPLITS)
    a('--out_dir', required=True, help='where the negatives go')
    a('--prefix_len', type=int, default=128)
    a('--gen_len', type=int, default=64)
    a('--stride', type=int, default=None, help='between prefix starts (default: prefix_len + gen_len)')
    a('--max_prefixes', type=int, default=None, help='evenly spaced subset of this many prefixes')
    a('--num_samples', type=int, default=4, help='K continuations per prefix')
    a('--top_k', type=int, default=None, help='truncate sampling (default: none, NCE needs P_LM)')
    a('--top_p', type=float, default=None)
    a('--temperature', type=float, default=1.0)
    a('--chunk', type=int, default=32, help='prefixes per generate call (and per resumable unit)')
    a('--device', default='auto')
    a('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true')
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    device, dtype, ctx = resolve_device(args.device, args.dtype)
    rank, world_size, device = setup_distributed(device)
    if args.num_samples < 1:
        raise ValueError(f"--num_samples {args.num_samples} must be at least 1")
    lm, lm_ckpt = load_lm(args.lm, device)
    data_dir = args.data_dir or lm_ckpt['meta']['data_dir']
    meta = load_meta(data_dir)
    check_vocab(lm_ckpt, meta, args.lm)
    P, L, K = args.prefix_len, args.gen_len, args.num_samples
    if P + L > lm.config.block_size:
        raise ValueError(f"prefix_len + gen_len = {P + L} exceeds the LM's block_size {lm.config.block_size}")
    data = load_split(data_dir, args.split, meta)
    offsets = windows(data, meta['eot_id'], P, L, args.stride, args.max_prefixes)
    if len(offsets) == 0:
        raise ValueError(f"the {args.split} split has no document of {P + L} tokens: lower --prefix_len/--gen_len")
    N, n_chunks = len(offsets), (len(offsets) + args.chunk - 1) // args.chunk
    settings = dict(lm_path=args.lm, lm_hash=file_hash(args.lm), data_dir=data_dir, split=args.split,
                    prefix_len=P, gen_len=L, stride=args.stride, num_prefixes=N, num_samples=K,
                    top_k=args.top_k, top_p=args.top_p, temperature=args.temperature, chunk=args.chunk,
                    seed=args.seed, dtype=meta['dtype'])
    neg = open_outputs(args.out_dir, settings, offsets, n_chunks, rank, world_size)
    tokens, logp, logq, pos_logp, pos_logq, done = (neg[k] for k in ('tokens', 'logp', 'logq', 'pos_logp', 'pos_logq', 'done'))
    proposal = dict(top_k=args.top_k, top_p=args.top_p, temperature=args.temperature)

    todo = [c for c in range(rank, n_chunks, world_size) if not done[c]]
    for c in progress(todo, quiet=args.quiet or rank != 0, desc=f'negatives {args.split}'):
        i0, i1 = c * args.chunk, min(N, (c + 1) * args.chunk)
        real = window_tokens(data, offsets[i0:i1], P + L).to(device)
        g = torch.Generator(device).manual_seed(chunk_seed(args.seed, args.split, c))
        with ctx:
            t, lp, lq = lm.generate(real[:, :P], L, num_samples=K, return_proposal=True, generator=g, **proposal)
            pos_lp, pos_lq = real_logprobs(lm, real, P, **proposal)
        tokens[i0:i1] = t.cpu().numpy()
        logp[i0:i1], logq[i0:i1] = lp.sum(-1).cpu().numpy(), lq.sum(-1).cpu().numpy()
        pos_logp[i0:i1], pos_logq[i0:i1] = pos_lp.cpu().numpy(), pos_lq.cpu().numpy()
        for m in (tokens, logp, logq, pos_logp, pos_logq):
            m.flush()
        done[c] = 1  # only after the chunk's rows are on disk
        done.flush()
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        write_json(dict(settings, complete=True), os.path.join(args.out_dir, 'meta.json'))
        print(f"{N} prefixes x {K} samples of {L} tokens -> {args.out_dir}")
    if world_size > 1:
        dist.destroy_process_group()


def open_outputs(out_dir, settings, offsets, n_chunks, rank, world_size):
    """Create the memmaps (rank 0), or reopen them to resume when their settings match."""
    meta_path = os.path.join(out_dir, 'meta.json')
    N, K, L = settings['num_prefixes'], settings['num_samples'], settings['gen_len']
    if rank == 0:
        if os.path.exists(meta_path):
            old = load_meta(out_dir)
            old.pop('complete', None)
            if old != settings:
                diff = sorted(k for k in settings if old.get(k) != settings[k])
                raise ValueError(f"{out_dir} holds negatives made with other settings ({', '.join(diff)}): "
                                 f"use another --out_dir or delete it")
        else:
            os.makedirs(out_dir, exist_ok=True)
            np.save(os.path.join(out_dir, 'offsets.npy'), offsets)
            shapes = dict(tokens=((N, K, L), settings['dtype']), logp=((N, K), 'float32'), logq=((N, K), 'float32'),
                          pos_logp=((N,), 'float32'), pos_logq=((N,), 'float32'), done=((n_chunks,), 'uint8'))
            for name, (shape, dtype) in shapes.items():
                np.memmap(os.path.join(out_dir, f'{name}.bin'), dtype=dtype, mode='w+', shape=shape).flush()
            write_json(dict(settings, complete=False), meta_path)
    if world_size > 1:
        dist.barrier()
    return load_negatives(out_dir, mode='r+')


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


if __name__ == '__main__':
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")

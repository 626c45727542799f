"""
Offline negatives for conditional NCE (Eq. 3): for each prefix of a split, K continuations drawn
once from the base LM and stored, as in the paper (16 or 128 per prefix, sampled uniformly among
at training time).

Default sampling is untruncated: Theorem 1's optimum, log P_LM - E = log P_data, is that of Eq. 3
with noise drawn from P_LM itself (truncated noise needs the log P_LM - log q correction).
--top_k/--top_p are options, recorded in meta.json with each sample's log q.

    python negatives.py --lm out/lm/best.pt --split train --num_samples 4 --out_dir out/neg_train
    torchrun --standalone --nproc_per_node 2 negatives.py ...        # prefixes sharded over ranks

Output (out_dir): offsets.npy (N,) start of each prefix in the split; tokens.bin (N, K, L) sampled
continuations; logp.bin / logq.bin (N, K) float32 log P_LM and log q of each continuation;
pos_logp.bin / pos_logq.bin (N,) float32 the same for the real continuation of each prefix (log q
= -inf where q cannot propose it); done.bin, one byte per chunk of prefixes; meta.json. NCE with a
truncated q needs both: its logit is -E + log P_LM - log q (nce_train.nce_loss). Every chunk is
seeded by (seed, split, chunk), so a killed run resumes where it stopped and ends with
byte-identical files.
"""

import errno
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data import SPLITS, check_fits, load_negatives, load_split, read_negatives_meta, window_tokens, windows
from data import load_lm_and_data
from model import proposal_logprobs
from plumbing import (ArgumentParser, atomic_write, common_flags, disk_full, file_hash, guards, precision,
                      progress, rerun_command, rng, run_main, setup, teardown_distributed, write_json)

CHUNK_TOKENS = 2**16  # the default chunk's sequences, in tokens: one decode of all its rows


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
        logits = lm.logits(rows[:, :-1], from_pos=P - 1).float()
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
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/best.pt', help='base LM checkpoint (train_lm.py)')
    a('--data_dir', default=None, help="prepared data (default: the LM's)")
    a('--split', default='train', choices=SPLITS, help='the split whose prefixes are continued')
    common_flags(p, 'out_dir', help=dict(out_dir='where the negatives go'))
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='tokens of each prefix')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='tokens of each continuation')
    a('--stride', type=int, default=None, at_least=1, at_most=None,
      help='between prefix starts (default: prefix_len + gen_len)')
    a('--num_prefixes', dest='max_prefixes', type=int, default=0, at_least=0, at_most='count',
      help='an evenly spaced subset of this many prefixes (0: all)')
    a('--num_samples', type=int, default=16, at_least=1, at_most='samples',
      help='K continuations per prefix (the paper stores 16 or 128)')
    a('--top_k', type=int, default=0, at_least=0, at_most=None,
      help='truncate sampling to the top k tokens (0: untruncated, as NCE needs P_LM)')
    a('--top_p', type=float, default=None, above=0, at_most=1,
      help='truncate sampling to this nucleus, in (0, 1] (default: untruncated)')
    a('--temperature', type=float, default=1.0, at_least=0, at_most=None, help='of sampling (0: greedy)')
    a('--chunk', type=int, default=None, at_least=1, at_most='count',
      help='prefixes per generate call and per resumable unit (default: about 2^16 sampled tokens, '
           'prompts included)')
    common_flags(p, 'device', 'deterministic', 'dtype', 'seed', 'quiet')
    return p.parse_args(argv)


def main(argv=None):
    args = guards.check_negatives_flags(get_args(argv), CHUNK_TOKENS)  # before out_dir is created
    rank, world_size, device = setup(args.device, args.deterministic)
    lm, _, data_dir, meta = load_lm_and_data(args.lm, args.data_dir, device)
    P, L, K = args.prefix_len, args.gen_len, args.num_samples
    check_fits(P + L, {'LM': lm})
    dtype, ctx = precision(device, args.dtype, 'sample', verbose=rank == 0, width=lm.config.n_embd)
    data = load_split(data_dir, args.split, meta)
    offsets = windows(data, P, L, args.stride, args.max_prefixes)
    N, n_chunks = len(offsets), (len(offsets) + args.chunk - 1) // args.chunk
    guards.check_negatives_run(args, lm.config.vocab_size, offsets, n_chunks, 
                               np.dtype(meta['dtype']).itemsize)
    settings = dict(lm_path=args.lm, lm_hash=file_hash(args.lm), data_dir=data_dir, split=args.split,
                    prefix_len=P, gen_len=L, stride=args.stride, num_prefixes=N, num_samples=K,
                    top_k=args.top_k, top_p=args.top_p, temperature=args.temperature, chunk=args.chunk,
                    seed=args.seed, dtype=meta['dtype'], precision=dtype)  # a rerun finishes in it
    neg = open_outputs(args.out_dir, settings, offsets, n_chunks, rank, world_size)
    tokens, logp, logq, pos_logp, pos_logq, done = (neg[k] for k in ('tokens', 'logp', 'logq', 'pos_logp',
                                                                     'pos_logq', 'done'))
    proposal = dict(top_k=args.top_k, top_p=args.top_p, temperature=args.temperature)

    todo = [c for c in range(rank, n_chunks, world_size) if not done[c]]
    for c in progress(todo, quiet=args.quiet or rank != 0, desc=f'negatives {args.split}'):
        i0, i1 = c * args.chunk, min(N, (c + 1) * args.chunk)
        real = window_tokens(data, offsets[i0:i1], P + L).to(device)
        g = rng(args.seed, 'negatives', args.split, c, device)
        with ctx:
            t, lp, lq = lm.generate(real[:, :P], L, num_samples=K, return_proposal=True, generator=g,
                                    max_rows=max(512, CHUNK_TOKENS // (P + L)), **proposal)
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
    teardown_distributed()


def open_outputs(out_dir, settings, offsets, n_chunks, rank, world_size):
    """Create the memmaps (rank 0), or reopen them to resume when their settings match. A folder
    with no finished chunk holds nothing to lose: it is started again with these settings."""
    meta_path = os.path.join(out_dir, 'meta.json')
    if rank == 0:
        fresh = not os.path.exists(meta_path)
        if not fresh:
            old = read_negatives_meta(out_dir)
            old.pop('complete', None)
            old.setdefault('precision', settings['precision'])  # written before it was recorded
            guards.check_same_settings(old, settings, out_dir, chunks_done(out_dir))
            fresh = old != settings
        if fresh:
            create_outputs(out_dir, settings, offsets, n_chunks)
    if world_size > 1:
        dist.barrier()
    return load_negatives(out_dir, mode='r+')


def create_outputs(out_dir, settings, offsets, n_chunks):
    """The empty output files, their disk space reserved now (a full disk is found here, not as a
    crash of a later write into a memmap), then meta.json; on a full disk none of them stays."""
    N, K, L = settings['num_prefixes'], settings['num_samples'], settings['gen_len']
    shapes = dict(tokens=((N, K, L), settings['dtype']), logp=((N, K), 'float32'), logq=((N, K), 'float32'),
                  pos_logp=((N,), 'float32'), pos_logq=((N,), 'float32'), done=((n_chunks,), 'uint8'))
    made = not os.path.exists(out_dir)

    def save_offsets(tmp):
        with open(tmp, 'wb') as f:  # np.save of a path would add '.npy' to the temp file's name
            np.save(f, offsets)

    try:
        os.makedirs(out_dir, exist_ok=True)
        atomic_write(os.path.join(out_dir, 'offsets.npy'), save_offsets)
        for name, (shape, dtype) in shapes.items():
            reserve(os.path.join(out_dir, f'{name}.bin'), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        write_json(dict(settings, complete=False), os.path.join(out_dir, 'meta.json'))
    except OSError as e:
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, disk_full(out_dir), out_dir) from None
        raise


def reserve(path, size):
    """A file of `size` zero bytes whose blocks are allocated now (posix_fallocate), where the
    system can (elsewhere a sparse file, as np.memmap makes)."""
    with open(path, 'wb') as f:
        f.truncate(size)
        try:
            if size:
                os.posix_fallocate(f.fileno(), 0, size)
        except (AttributeError, OSError) as e:  # no posix_fallocate, or a file system without it
            if getattr(e, 'errno', None) == errno.ENOSPC:
                raise


def chunks_done(out_dir):
    path = os.path.join(out_dir, 'done.bin')
    return int(np.fromfile(path, dtype=np.uint8).sum()) if os.path.exists(path) else 0


def resume_hint(argv):
    """Ctrl-C: the finished chunks are on disk; the same command finishes the rest."""
    args = get_args(argv)
    try:
        meta = read_negatives_meta(args.out_dir)
        n_chunks = (meta['num_prefixes'] + meta['chunk'] - 1) // meta['chunk']
    except ValueError:
        return f"nothing was saved yet; rerun: {rerun_command(argv)}"
    return (f"{chunks_done(args.out_dir)} of {n_chunks} chunks of negatives are saved in {args.out_dir}; "
            f"rerun the same command to finish them: {rerun_command(argv)}")


if __name__ == '__main__':
    run_main(main, resume_hint)

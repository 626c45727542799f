"""
Conditional NCE training of the residual energy (Section 3.1, Eq. 3). For a prefix of the
training split, the positive x+ is its real continuation and the negative x- one of its K stored
LM samples (negatives.py), drawn uniformly each time. Because the noise distribution is P_LM and
the model is P_LM exp(-E), the NCE classifier's logit log P_joint - log P_LM reduces to -E:

    binary (Eq. 3):  loss = softplus(E(x+)) + softplus(-E(x-))
    ranking:         loss = -log softmax(-E(x+), -E(x-_1), ..., -E(x-_M))[0]   (M negatives)

    python nce_train.py --lm out/lm/ckpt.pt --negatives out/neg_train --val_negatives out/neg_val \\
        --energy bit --out_dir out/bit                                   # CPU or one GPU
    torchrun --standalone --nproc_per_node 8 nce_train.py ...            # DDP

Batches are a function of (seed, iteration), so --resume is exact and DDP sees the same global
batch as one process. Writes out_dir/ckpt.pt (the latest state, for --resume), best.pt (the energy
at the lowest held-out NCE loss: the one to use, since NCE on a finite set of negatives overfits),
log.jsonl and results.json; checkpoints are written atomically.
"""

import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import load_meta, load_negatives, load_split, window_tokens, write_json
from energy import POOLS, build_energy, energy_state, load_energy
from model import load_checkpoint, save_checkpoint
from runtime import (DTYPES, ArgumentParser, all_mean, at_least, check, check_heads, check_writable, checkpoint_hint,
                     configure_optimizer, get_lr, pick_device, progress, precision, rng, rng_seed, run_main, setup, write_log)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--lm', default='out/lm/ckpt.pt', help='the base LM the energy is the residual of')
    a('--negatives', required=True, help='negatives.py output for the train split')
    a('--val_negatives', required=True, help='negatives.py output for the val split')
    a('--out_dir', default='out/energy')
    a('--resume', action='store_true', help='continue from out_dir/ckpt.pt (exactly)')
    a('--energy', default='bit', choices=['bit', 'unit'], help='bidirectional or LM-initialised causal body')
    a('--init_from', default=None, help='bit: an MLM checkpoint (train_lm.py --objective mlm); unit: an LM (default --lm)')
    a('--pool', default='continuation', choices=POOLS, help='mean-pool hidden states over these positions')
    a('--context', type=int, default=None, help='the energy sees only the last N prefix tokens (default: all)')
    a('--n_layer', type=int, default=None, help='BIT from scratch: layers (default: the LM\'s)')
    a('--n_head', type=int, default=None)
    a('--n_embd', type=int, default=None)
    a('--dropout', type=float, default=None, help="the body's dropout (default: that of --init_from's model; 0 from scratch)")
    a('--loss', default='binary', choices=['binary', 'ranking'])
    a('--num_neg', type=int, default=None, help='ranking: negatives per positive (default: all K stored)')
    a('--batch_size', type=int, default=16, help='positives per micro-batch per process')
    a('--grad_accum', type=int, default=1, help='micro-batches per iteration, summed over processes')
    a('--max_iters', type=int, default=1000)
    a('--lr', type=float, default=3e-4)
    a('--min_lr', type=float, default=3e-5)
    a('--warmup_iters', type=int, default=50)
    a('--lr_decay_iters', type=int, default=None, help='end of the cosine decay (default: max_iters)')
    a('--weight_decay', type=float, default=0.1)
    a('--beta1', type=float, default=0.9)
    a('--beta2', type=float, default=0.99)
    a('--grad_clip', type=float, default=1.0)
    a('--eval_interval', type=int, default=100)
    a('--eval_prefixes', type=int, default=256, help='val prefixes (one fixed negative each) per evaluation')
    a('--log_interval', type=int, default=10)
    a('--device', default='auto')
    a('--dtype', default='auto', choices=DTYPES)
    a('--compile', action='store_true')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true')
    args = p.parse_args(argv)
    check_args(args)
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    return args


def check_args(args):
    """Every flag in range, before any work: one line naming the flag."""
    at_least(args, 1, 'n_layer', 'n_head', 'n_embd', 'num_neg', 'batch_size', 'grad_accum', 'max_iters',
             'lr_decay_iters', 'eval_interval', 'eval_prefixes', 'log_interval')
    at_least(args, 0, 'context', 'warmup_iters', 'weight_decay', 'grad_clip')
    check(args, 'lr', lambda v: 0 < v < math.inf, 'a positive number')
    check(args, 'min_lr', lambda v: 0 <= v < math.inf, 'a number >= 0')
    for name in ('dropout', 'beta1', 'beta2'):
        check(args, name, lambda v: 0 <= v < 1, 'in [0, 1)')
    if args.n_embd and args.n_head:
        check_heads(args.n_embd, args.n_head)
    if args.dtype == 'float16' and not pick_device(args.device).startswith('cuda'):
        raise ValueError(f"--dtype float16 trains with a GradScaler, which needs CUDA: pass --device cuda, or "
                         f"--dtype bfloat16 or float32")
    check_writable(args.out_dir, '--out_dir')


def nce_loss(e_pos, e_neg, kind='binary'):
    """e_pos (B,), e_neg (B, M) energies. Returns (loss, accuracy = fraction of pairs with
    E(x+) < E(x-)). log P_LM does not appear: in the residual model it cancels from the NCE
    logit log P_joint - log P_noise = -E (and from the ranking softmax, the prefix being shared)."""
    if kind == 'binary':  # Eq. 3, averaged over the M negatives of each positive
        loss = F.softplus(e_pos) + F.softplus(-e_neg).mean(1)
    elif kind == 'ranking':
        scores = -torch.cat([e_pos[:, None], e_neg], dim=1)
        loss = F.cross_entropy(scores, torch.zeros(len(e_pos), dtype=torch.long, device=e_pos.device), reduction='none')
    else:
        raise ValueError(f"unknown NCE loss '{kind}': use 'binary' or 'ranking'")
    return loss.mean(), (e_pos[:, None] < e_neg).float().mean()


def nce_batch(data, neg, rows, neg_idx, device):
    """(B*(1+M), P+L) tokens: the B positives, then for each row its M negatives (prefix + sample)."""
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    pos = window_tokens(data, neg['offsets'][rows], P + L)
    samples = torch.from_numpy(neg['tokens'][rows[:, None], neg_idx].astype(np.int64))  # (B, M, L)
    prefix = pos[:, None, :P].expand(-1, samples.size(1), -1)
    negs = torch.cat([prefix, samples], dim=2).flatten(0, 1)
    return torch.cat([pos, negs]).to(device)


def choose(n_rows, K, B, M, seed, split, it):
    """Rows of batch `it` and M distinct negatives of each, uniformly: a function of (seed, split, it)."""
    g = rng(seed, 'nce_pairs', split, it)
    rows = torch.randint(n_rows, (B,), generator=g).numpy()
    neg_idx = torch.rand(B, K, generator=g).argsort(1)[:, :M].numpy()
    return rows, neg_idx


@torch.no_grad()
def evaluate(model, data, neg, rows, neg_idx, batch_size, loss, device, ctx, rank=0, world_size=1):
    """Loss, accuracy and mean energies on fixed val pairs, sharded over ranks, reduced."""
    model.eval()
    P = neg['meta']['prefix_len']
    sums = torch.zeros(5, dtype=torch.float64)
    starts = list(range(0, len(rows), batch_size))
    for s in starts[rank::world_size]:
        r, j = rows[s:s + batch_size], neg_idx[s:s + batch_size]
        with ctx:
            e = model(nce_batch(data, neg, r, j, device), P)
        e_pos, e_neg = e[:len(r)], e[len(r):].view(len(r), -1)
        l, acc = nce_loss(e_pos, e_neg, loss)
        sums += torch.tensor([l.item() * len(r), acc.item() * len(r), e_pos.sum().item(), e_neg.mean(1).sum().item(), len(r)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    n = sums[4].item()
    return dict(val_loss=sums[0].item() / n, val_acc=sums[1].item() / n,
                val_e_pos=sums[2].item() / n, val_e_neg=sums[3].item() / n)


def load_pairs(args):
    """The train and held-out negatives (checked to come from --lm and to agree, and the held-out
    ones not to be training prefixes), and the splits their positives come from."""
    lm = load_checkpoint(args.lm)  # first: what --lm is decides which message is right
    if lm['kind'] != 'lm':
        raise ValueError(f"--lm {args.lm} holds a '{lm['kind']}' model, not a language model: pass the train_lm.py "
                         f"checkpoint the negatives were sampled from")
    neg, val_neg = load_negatives(args.negatives, lm_path=args.lm), load_negatives(args.val_negatives, lm_path=args.lm)
    split, val_split = neg['meta']['split'], val_neg['meta']['split']
    if val_split == 'train':
        raise ValueError(f"--val_negatives {args.val_negatives} holds prefixes of the train split: held-out pairs must "
                         f"not be training prefixes; make them with negatives.py --split val")
    if val_split == split:
        raise ValueError(f"--val_negatives {args.val_negatives} holds prefixes of the {split} split, which --negatives "
                         f"trains on: held-out pairs must not be training prefixes; give negatives of another split")
    for key in ('prefix_len', 'gen_len', 'data_dir'):
        if val_neg['meta'][key] != neg['meta'][key]:
            raise ValueError(f"train and val negatives differ in {key} ({neg['meta'][key]} vs {val_neg['meta'][key]}): regenerate one")
    data_dir = neg['meta']['data_dir']
    meta = load_meta(data_dir)
    data = {n['meta']['split']: load_split(data_dir, n['meta']['split'], meta) for n in (neg, val_neg)}
    return neg, val_neg, data, dict(meta, data_dir=data_dir)


def build(args, meta):
    """The energy to train and, with --resume, the checkpoint it continues."""
    if args.resume:
        model, ckpt = load_energy(os.path.join(args.out_dir, 'ckpt.pt'), args.lm)
        return model.train(), ckpt
    sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    return build_energy(args.energy, args.lm, meta, args.init_from, sizes, args.pool, context=args.context,
                        dropout=args.dropout), None


def main(argv=None):
    args = get_args(argv)
    rank, world_size, device = setup(args.device)
    dtype, ctx = precision(device, args.dtype, 'train', verbose=rank == 0)
    master, n_micro = rank == 0, args.grad_accum // world_size
    if args.grad_accum % world_size:
        raise ValueError(f"--grad_accum {args.grad_accum} must be a multiple of the {world_size} processes")
    torch.manual_seed(rng_seed(args.seed, 'torch', '', rank))
    neg, val_neg, data, meta = load_pairs(args)
    (P, L, K), K_val = (neg['meta'][k] for k in ('prefix_len', 'gen_len', 'num_samples')), val_neg['meta']['num_samples']
    train, held_out = data[neg['meta']['split']], data[val_neg['meta']['split']]
    M = 1 if args.loss == 'binary' else (args.num_neg or K)
    if not 1 <= M <= min(K, K_val):  # held-out pairs need M distinct negatives too
        raise ValueError(f"--num_neg {M} must be between 1 and the {min(K, K_val)} stored negatives per prefix "
                         f"(train {K}, val {K_val})")
    ckpt_path, best_path = os.path.join(args.out_dir, 'ckpt.pt'), os.path.join(args.out_dir, 'best.pt')
    if not args.resume and os.path.exists(ckpt_path):
        raise ValueError(f"{ckpt_path} exists: pass --resume to continue it or choose another --out_dir")
    if not args.resume and os.path.exists(best_path):
        raise ValueError(f"{best_path} exists (an energy kept by an earlier run): choose another --out_dir or delete it")
    raw_model, ckpt = build(args, meta)
    if P + L > raw_model.config.block_size:
        raise ValueError(f"prefix_len + gen_len = {P + L} of the negatives exceeds the energy's block_size "
                         f"{raw_model.config.block_size}: regenerate shorter negatives or give the energy a larger block")
    raw_model.to(device)
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay, (args.beta1, args.beta2), device)
    scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
    iter_num, best_val_loss, best_iter = (ckpt['iter_num'], ckpt['best_val_loss'], ckpt['best_iter']) if ckpt else (0, float('inf'), 0)
    if ckpt:
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        torch.set_rng_state(ckpt['rng_state'])
    model = torch.compile(raw_model) if args.compile else raw_model
    if world_size > 1:
        model = DDP(model, device_ids=[int(device.split(':')[1])] if device.startswith('cuda') else None)

    n_val, B = min(args.eval_prefixes, len(val_neg['offsets'])), args.batch_size
    val_rows = np.arange(n_val)  # the first n_val held-out prefixes, each with fixed random negatives
    val_idx = choose(n_val, K_val, n_val, M, args.seed, 'held_out', 0)[1]
    tokens_per_iter = B * args.grad_accum * (1 + M) * (P + L)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{raw_model.kind.upper()} energy, {raw_model.num_params() / 1e6:.2f}M parameters, {args.loss} NCE with {M} "
              f"negative(s), {len(neg['offsets'])} train prefixes x {K} samples, {world_size} process(es)")
    log = open(os.path.join(args.out_dir, 'log.jsonl'), 'a') if master else None
    t0, t_start, start_iter, last_val = time.time(), time.time(), iter_num, {}
    bar = progress(total=args.max_iters, initial=iter_num, quiet=args.quiet or not master)
    while iter_num < args.max_iters:
        lr = get_lr(iter_num, args)
        for group in optimizer.param_groups:
            group['lr'] = lr
        rows, neg_idx = choose(len(neg['offsets']), K, B * args.grad_accum, M, args.seed, 'train', iter_num)
        stats = np.zeros(4)
        for m in range(rank, args.grad_accum, world_size):  # this process's micro-batches
            r, j = rows[m * B:(m + 1) * B], neg_idx[m * B:(m + 1) * B]
            if world_size > 1:  # all-reduce the gradients only on the last micro-batch
                model.require_backward_grad_sync = m + world_size >= args.grad_accum
            with ctx:  # positives and their negatives in one forward
                e = model(nce_batch(train, neg, r, j, device), P)
            e_pos, e_neg = e[:B], e[B:].view(B, M)
            loss, acc = nce_loss(e_pos, e_neg, args.loss)
            scaler.scale(loss / n_micro).backward()
            stats += [loss.item(), acc.item(), e_pos.mean().item(), e_neg.mean().item()]
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float('inf')).item()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        bar.update()

        if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
            rec = dict(zip(('loss', 'acc', 'e_pos', 'e_neg'), all_mean(list(stats / n_micro), world_size)))
            dt, t0 = time.time() - t0, time.time()
            rec.update(iter=iter_num, lr=lr, grad_norm=grad_norm,
                       tokens_per_s=((iter_num - 1) % args.log_interval + 1) * tokens_per_iter / dt)
            write_log(log, rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}")
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            last_val = evaluate(model, held_out, val_neg, val_rows, val_idx, B, args.loss, device, ctx, rank, world_size)
            improved = last_val['val_loss'] < best_val_loss
            if improved:
                best_val_loss, best_iter = last_val['val_loss'], iter_num
            write_log(log, dict(iter=iter_num, **last_val))
            if master:
                bar.write(f"iter {iter_num}: held-out loss {last_val['val_loss']:.4f} acc {last_val['val_acc']:.3f} "
                          f"E+ {last_val['val_e_pos']:.3f} E- {last_val['val_e_neg']:.3f}" + (' (best)' if improved else ''))
                state = dict(energy_state(raw_model, args.lm, meta), args=vars(args), iter_num=iter_num,
                             best_val_loss=best_val_loss, best_iter=best_iter, negatives=args.negatives)
                if improved:  # the energy to use: NCE overfits the finite negatives, so the last one may be worse
                    save_checkpoint(state, best_path)
                save_checkpoint(dict(state, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                                     rng_state=torch.get_rng_state()), ckpt_path)
    bar.close()
    if not last_val:  # resumed at max_iters: nothing was evaluated in this run
        last_val = evaluate(model, held_out, val_neg, val_rows, val_idx, B, args.loss, device, ctx, rank, world_size)
    train_time = time.time() - t_start
    results = dict(energy=raw_model.kind, params=raw_model.num_params(), iters=iter_num, train_time_s=train_time, dtype=dtype,
                   tokens_per_s=(iter_num - start_iter) * tokens_per_iter / max(train_time, 1e-9),
                   best_val_loss=best_val_loss, best_iter=best_iter, val_prefixes=n_val, **last_val)
    if master:
        log.close()
        write_json(results, os.path.join(args.out_dir, 'results.json'))
        best = f"best loss {best_val_loss:.4f} at iter {best_iter} -> {best_path}" if os.path.exists(best_path) else \
            "the held-out loss was never finite (NaN): no best.pt was written"
        print(f"held-out NCE accuracy {results['val_acc']:.3f} on {n_val} prefixes (chance 0.5), loss "
              f"{results['val_loss']:.4f}; {train_time:.0f}s; {best}")
    if world_size > 1:
        dist.destroy_process_group()
    return results


def resume_hint(argv):
    args = get_args(argv)
    return checkpoint_hint(argv, os.path.join(args.out_dir, 'ckpt.pt'), args.max_iters, args.eval_interval)


if __name__ == '__main__':
    run_main(main, resume_hint)

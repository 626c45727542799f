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

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import load_meta, load_split, write_json
from energy import POOLS, Energy, build_energy, energy_state
from model import GPTConfig, check_vocab, file_hash, load_checkpoint, save_checkpoint
from negatives import load_negatives, window_tokens
from train_lm import all_mean, configure_optimizer, get_lr, progress, resolve_device, setup_distributed, train_step


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    a('--compile', action='store_true')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true')
    args = p.parse_args(argv)
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    return args


def nce_loss(e_pos, e_neg, kind='binary', d_pos=None, d_neg=None):
    """e_pos (B,), e_neg (B, M) energies. Returns (loss, accuracy = fraction of pairs whose
    positive has the larger logit; without d: E(x+) < E(x-)). The NCE logit of x is
    log P_joint(x) - log q(x) = -E(x) + d(x), d = log P_LM(x) - log q(x) for noise q: with q = P_LM
    (untruncated negatives) d = 0 and P_LM cancels, leaving -E (Eq. 3; None is that case, exactly).
    With top-k/top-p/temperature negatives, d_pos (B,) and d_neg (B, M) are the stored log-ratios
    (negatives.py). A real continuation that q cannot propose has d = +inf: it is data with
    certainty, its loss term is 0 and it carries no gradient (no inf - inf anywhere)."""
    s_pos = -e_pos if d_pos is None else d_pos - e_pos
    s_neg = -e_neg if d_neg is None else d_neg - e_neg
    if kind == 'binary':  # Eq. 3, averaged over the M negatives of each positive
        loss = F.softplus(-s_pos) + F.softplus(s_neg).mean(1)
    elif kind == 'ranking':  # -log softmax(s_pos, s_neg_1..M)[0] = log(1 + sum_j exp(s_neg_j - s_pos))
        loss = torch.logsumexp(F.pad(s_neg - s_pos[:, None], (1, 0)), 1)
    else:
        raise ValueError(f"unknown NCE loss '{kind}': use 'binary' or 'ranking'")
    return loss.mean(), (s_pos[:, None] > s_neg).float().mean()


def nce_batch(data, neg, rows, neg_idx, device):
    """(B*(1+M), P+L) tokens: the B positives, then for each row its M negatives (prefix + sample)."""
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    pos = window_tokens(data, neg['offsets'][rows], P + L)
    samples = torch.from_numpy(neg['tokens'][rows[:, None], neg_idx].astype(np.int64))  # (B, M, L)
    prefix = pos[:, None, :P].expand(-1, samples.size(1), -1)
    negs = torch.cat([prefix, samples], dim=2).flatten(0, 1)
    return torch.cat([pos, negs]).to(device)


def choose(n_rows, K, B, M, seed, it):
    """Rows of iteration `it` and M distinct negatives of each, uniformly: a function of (seed, it)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + it)
    rows = torch.randint(n_rows, (B,), generator=g).numpy()
    neg_idx = torch.rand(B, K, generator=g).argsort(1)[:, :M].numpy()
    return rows, neg_idx


def energies(model, x, P, B):
    """Split the energies of one concatenated forward into positives (B,) and negatives (B, M)."""
    e = model(x, P)
    return e[:B], e[B:].view(B, -1)


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
            e_pos, e_neg = energies(model, nce_batch(data, neg, r, j, device), P, len(r))
        l, acc = nce_loss(e_pos, e_neg, loss)
        sums += torch.tensor([l.item() * len(r), acc.item() * len(r), e_pos.sum().item(), e_neg.mean(1).sum().item(), len(r)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    n = sums[4].item()
    return dict(val_loss=sums[0].item() / n, val_acc=sums[1].item() / n,
                val_e_pos=sums[2].item() / n, val_e_neg=sums[3].item() / n)


def main(argv=None):
    args = get_args(argv)
    device, dtype, ctx = resolve_device(args.device, args.dtype)
    rank, world_size, device = setup_distributed(device)
    master = rank == 0
    if args.grad_accum % world_size:
        raise ValueError(f"--grad_accum {args.grad_accum} must be a multiple of the {world_size} processes")
    torch.manual_seed(args.seed + rank)

    neg, val_neg = load_negatives(args.negatives, lm_path=args.lm), load_negatives(args.val_negatives, lm_path=args.lm)
    nmeta = neg['meta']
    for key in ('prefix_len', 'gen_len', 'data_dir'):
        if val_neg['meta'][key] != nmeta[key]:
            raise ValueError(f"train and val negatives differ in {key} ({nmeta[key]} vs {val_neg['meta'][key]}): regenerate one")
    meta = load_meta(nmeta['data_dir'])
    data, val_data = load_split(nmeta['data_dir'], nmeta['split'], meta), load_split(nmeta['data_dir'], val_neg['meta']['split'], meta)
    P, L, K = nmeta['prefix_len'], nmeta['gen_len'], nmeta['num_samples']
    M = 1 if args.loss == 'binary' else (args.num_neg or K)
    if not 1 <= M <= min(K, val_neg['meta']['num_samples']):  # val pairs need M distinct negatives too
        raise ValueError(f"--num_neg {M} must be between 1 and the {min(K, val_neg['meta']['num_samples'])} "
                         f"stored negatives per prefix (train {K}, val {val_neg['meta']['num_samples']})")

    ckpt_path, best_path = os.path.join(args.out_dir, 'ckpt.pt'), os.path.join(args.out_dir, 'best.pt')
    if not args.resume and os.path.exists(ckpt_path):
        raise ValueError(f"{ckpt_path} exists: pass --resume to continue it or choose another --out_dir")
    iter_num, best_val_loss, best_iter, ckpt = 0, float('inf'), 0, None
    if args.resume:
        ckpt = load_checkpoint(ckpt_path)
        if ckpt['kind'] != 'energy':
            raise ValueError(f"{ckpt_path} holds a '{ckpt['kind']}' model, not an energy: choose another --out_dir")
        if ckpt['lm_hash'] != file_hash(args.lm):
            raise ValueError(f"{ckpt_path} is the residual of another LM ({ckpt['lm_path']}) than {args.lm}: "
                             f"resume with the --lm it was trained with")
        check_vocab(ckpt, meta, ckpt_path)
        model = Energy(GPTConfig(**ckpt['config']), ckpt['pool'], ckpt.get('context'))
        model.load_state_dict(ckpt['model'])
        iter_num, best_val_loss, best_iter = ckpt['iter_num'], ckpt['best_val_loss'], ckpt.get('best_iter', 0)
    else:
        sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        model = build_energy(args.energy, args.lm, meta, args.init_from, sizes, args.pool, context=args.context,
                             dropout=args.dropout)
    if P + L > model.config.block_size:
        raise ValueError(f"prefix_len + gen_len = {P + L} of the negatives exceeds the energy's block_size "
                         f"{model.config.block_size}: regenerate shorter negatives or give the energy a larger block")
    model.to(device)
    optimizer = configure_optimizer(model, args, device)
    scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
    if ckpt:
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        torch.set_rng_state(ckpt['rng_state'])
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[int(device.split(':')[1])] if device.startswith('cuda') else None)

    n_val = min(args.eval_prefixes, len(val_neg['offsets']))
    val_rows = np.arange(n_val)  # the first n_val val prefixes, each with fixed random negatives
    val_idx = choose(n_val, val_neg['meta']['num_samples'], n_val, M, args.seed, -1)[1]
    tokens_per_iter = args.batch_size * args.grad_accum * (1 + M) * (P + L)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{raw_model.kind.upper()} energy, {raw_model.num_params() / 1e6:.2f}M parameters, {args.loss} NCE "
              f"with {M} negative(s), {len(neg['offsets'])} train prefixes x {K} samples, {world_size} process(es) on {device}, {dtype}")
    log = open(os.path.join(args.out_dir, 'log.jsonl'), 'a') if master else None

    def loss_fn(model, batch):
        rows, neg_idx = batch
        e_pos, e_neg = energies(model, nce_batch(data, neg, rows, neg_idx, device), P, len(rows))
        loss, acc = nce_loss(e_pos, e_neg, args.loss)
        return loss, dict(loss=loss.item(), acc=acc.item(), e_pos=e_pos.mean().item(), e_neg=e_neg.mean().item())

    def validate():
        return evaluate(model, val_data, val_neg, val_rows, val_idx, args.batch_size, args.loss, device, ctx, rank, world_size)

    def checkpoint(improved):
        state = dict(energy_state(raw_model, args.lm, dict(meta, data_dir=nmeta['data_dir'])), args=vars(args),
                     iter_num=iter_num, best_val_loss=best_val_loss, best_iter=best_iter, negatives=args.negatives)
        if improved:  # the energy to use: NCE overfits the finite negatives, so the last one may be worse
            save_checkpoint(state, best_path)
        save_checkpoint(dict(state, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                             rng_state=torch.get_rng_state()), ckpt_path)

    t0, t_start, start_iter, last_val = time.time(), time.time(), iter_num, {}
    bar = progress(total=args.max_iters, initial=iter_num, quiet=args.quiet or not master)
    while iter_num < args.max_iters:
        lr = get_lr(iter_num, args)
        for group in optimizer.param_groups:
            group['lr'] = lr
        rows, neg_idx = choose(len(neg['offsets']), K, args.batch_size * args.grad_accum, M, args.seed, iter_num)
        micro = [(rows[i * args.batch_size:(i + 1) * args.batch_size], neg_idx[i * args.batch_size:(i + 1) * args.batch_size])
                 for i in range(rank, args.grad_accum, world_size)]
        metrics, grad_norm = train_step(model, optimizer, scaler, ctx, micro, loss_fn, args.grad_clip)
        iter_num += 1
        bar.update()
        if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
            keys = sorted(metrics)
            rec = dict(zip(keys, all_mean([metrics[k] for k in keys], world_size)))
            dt, t0 = time.time() - t0, time.time()
            n_iters = (iter_num - 1) % args.log_interval + 1
            rec.update(iter=iter_num, lr=lr, grad_norm=grad_norm, tokens_per_s=n_iters * tokens_per_iter / dt)
            if master:
                log.write(json.dumps(rec) + '\n')
                log.flush()
                bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}")
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            last_val = validate()
            improved = last_val['val_loss'] < best_val_loss
            if improved:
                best_val_loss, best_iter = last_val['val_loss'], iter_num
            if master:
                log.write(json.dumps(dict(iter=iter_num, **last_val)) + '\n')
                log.flush()
                bar.write(f"iter {iter_num}: val loss {last_val['val_loss']:.4f} acc {last_val['val_acc']:.3f} "
                          f"E+ {last_val['val_e_pos']:.3f} E- {last_val['val_e_neg']:.3f}" + (' (best)' if improved else ''))
                checkpoint(improved)
    bar.close()
    if not last_val:  # resumed at max_iters: nothing was evaluated in this run
        last_val = validate()
    train_time = time.time() - t_start
    results = dict(energy=raw_model.kind, params=raw_model.num_params(), iters=iter_num, train_time_s=train_time,
                   tokens_per_s=(iter_num - start_iter) * tokens_per_iter / max(train_time, 1e-9),
                   best_val_loss=best_val_loss, best_iter=best_iter, val_prefixes=n_val, **last_val)
    if master:
        log.close()
        write_json(results, os.path.join(args.out_dir, 'results.json'))
        print(f"held-out NCE accuracy {results.get('val_acc', float('nan')):.3f} on {n_val} val prefixes "
              f"(chance 0.5), val loss {results.get('val_loss', float('nan')):.4f}; {train_time:.0f}s; "
              f"best val loss {best_val_loss:.4f} at iter {best_iter} -> {best_path}")
    if world_size > 1:
        dist.destroy_process_group()
    return results


if __name__ == '__main__':
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")

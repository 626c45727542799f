"""
MLE training of a GPT: the base LM P_LM that the residual energy corrects (and, later, the
BALM/RALM baselines and the masked-LM pretraining of the BIT energy).

    python train_lm.py --data_dir data/shakespeare --out_dir out/lm               # CPU
    python train_lm.py --data_dir data/shakespeare_gpt2 --n_layer 12 ...          # one GPU
    torchrun --standalone --nproc_per_node 8 train_lm.py ...                      # DDP

Batches are a pure function of (seed, iteration): the global batch of an iteration is the same
whatever the number of processes, and --resume continues exactly where the checkpoint stopped.
Writes out_dir/ckpt.pt (atomically, at every eval), out_dir/log.jsonl and out_dir/results.json.
"""

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data import load_meta, load_split, write_json
from energy import mlm_mask
from model import (GPT, PAPER_DATA, PAPER_PRESETS, RALM, GPTConfig, check_vocab, file_hash, load_checkpoint,
                   load_lm, save_checkpoint, width_for_params)
from tokenizer import load_tokenizer


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a('--data_dir', default='data/shakespeare', help='prepared data (data/<corpus>/prepare.py)')
    a('--out_dir', default='out/lm', help='checkpoint, log and results go here')
    a('--resume', action='store_true', help='continue from out_dir/ckpt.pt (exactly)')
    a('--preset', default=None, choices=sorted(PAPER_PRESETS),
      help="the paper's model shape and Table 4 optimisation settings (GPU scale; flags still override)")
    a('--residual_of', default=None, help='train a RALM (Eq. 6): a GPT whose logits add to this frozen LM\'s')
    a('--match_params', type=int, default=None,
      help='BALM: choose n_embd so the model has about this many parameters (e.g. base LM + energy)')
    a('--init_from', default=None,
      help='start from the weights of this checkpoint (same shape; e.g. the MLM pretraining of a BIT from '
           'the base LM, whose vocabulary gains a [MASK] row)')
    a('--objective', default='lm', choices=['lm', 'mlm'],
      help="lm: next-token MLE (base LM, BALM); mlm: BERT-style masked LM of a bidirectional body "
           "(the BIT energy's pretraining, energy.py)")
    # model
    a('--n_layer', type=int, default=4)
    a('--n_head', type=int, default=4)
    a('--n_embd', type=int, default=256)
    a('--block_size', type=int, default=256, help='context length in tokens')
    a('--dropout', type=float, default=0.0)
    a('--bias', action='store_true', help='biases in linear layers and LayerNorms')
    a('--alibi', action='store_true', help="ALiBi distance penalty in attention (the BIT's MLM pretraining: no plateau)")
    # optimisation
    a('--batch_size', type=int, default=16, help='sequences per micro-batch per process')
    a('--grad_accum', type=int, default=1, help='micro-batches per iteration, summed over processes')
    a('--max_iters', type=int, default=2000)
    a('--lr', type=float, default=2e-3, help='peak learning rate')
    a('--min_lr', type=float, default=2e-4, help='learning rate at the end of the cosine decay')
    a('--warmup_iters', type=int, default=100)
    a('--lr_decay_iters', type=int, default=None, help='end of the cosine decay (default: max_iters)')
    a('--weight_decay', type=float, default=0.1)
    a('--beta1', type=float, default=0.9)
    a('--beta2', type=float, default=0.99)
    a('--grad_clip', type=float, default=1.0, help='clip gradients at this norm (0: off)')
    # evaluation and logging
    a('--eval_interval', type=int, default=250, help='val loss + checkpoint every this many iterations')
    a('--eval_iters', type=int, default=20, help='val batches per periodic evaluation')
    a('--log_interval', type=int, default=10)
    a('--final_eval', type=int, default=1, help='1: val/test PPL over the whole splits at the end')
    a('--num_samples', type=int, default=2, help='samples printed at the end')
    # system
    a('--device', default='auto', help="'cpu', 'cuda', 'cuda:1', ... ('auto': cuda if available)")
    a('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
      help="autocast dtype ('auto': bf16 on GPUs that have it, else fp16 with GradScaler; fp32 on CPU)")
    a('--compile', action='store_true', help='torch.compile the model')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true', help='no progress bar')
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PAPER_PRESETS[preset], block_size=PAPER_DATA['block_size'])
    args = p.parse_args(argv)
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    return args


# -----------------------------------------------------------------------------
# system: DDP, device, autocast

def setup_distributed(device):
    """(rank, world_size, device) from torchrun's environment; a no-op for one process."""
    if int(os.environ.get('RANK', -1)) == -1:
        return 0, 1, device
    local_rank = int(os.environ['LOCAL_RANK'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return dist.get_rank(), dist.get_world_size(), device


def resolve_device(device, dtype):
    """The device, and the autocast context + whether to scale gradients (fp16 only)."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if dtype == 'auto':
        if device.startswith('cuda'):
            dtype = 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
        else:
            dtype = 'float32'
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    ctx = nullcontext() if dtype == 'float32' else \
        torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))
    return device, dtype, ctx


def all_mean(values, world_size):
    """Average a list of floats over processes (identity for one process)."""
    t = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t)
        t /= world_size
    return t.tolist()


def progress(iterable=None, quiet=False, **kw):
    return tqdm(iterable, disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True, **kw)


# -----------------------------------------------------------------------------
# data

def batch_offsets(n_tokens, block_size, n, seed, it):
    """Start offsets of the n windows of iteration `it`: a function of (seed, it) only, which is
    what makes --resume exact and DDP see the same global batch as one process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + it)
    return torch.randint(n_tokens - block_size - 1, (n,), generator=g)


def get_batch(data, offsets, block_size, device):
    x = torch.from_numpy(np.stack([data[i:i + block_size + 1].astype(np.int64) for i in offsets.tolist()]))
    x = x.to(device, non_blocking=True)
    return x[:, :-1], x[:, 1:]


def make_batch(data, offsets, block_size, device, objective='lm', vocab_size=None, seed=0):
    """Inputs and targets of one micro-batch: next tokens (lm), or masked positions (mlm, with
    masks seeded by `seed`; the [MASK] id is vocab_size, one past the data's tokens)."""
    x, y = get_batch(data, offsets, block_size, device)
    if objective == 'lm':
        return x, y
    return mlm_mask(x, vocab_size, mask_id=vocab_size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def evaluate(model, data, offsets, batch_fn, batch_size, ctx, rank=0, world_size=1):
    """Mean loss over the windows at `offsets` (batch_fn(offsets, i) -> x, y for the i-th batch),
    each process taking every world_size-th batch; token-weighted sums are reduced, so the
    result does not depend on the number of processes."""
    model.eval()
    total, count = 0.0, 0
    batches = offsets.split(batch_size)
    for i in range(rank, len(batches), world_size):
        x, y = batch_fn(batches[i], i)
        with ctx:
            _, loss = model(x, y)
        n = (y >= 0).sum().item()
        total, count = total + loss.item() * n, count + n
    model.train()
    t = torch.tensor([total, count], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t)
    return (t[0] / t[1]).item()


def full_split_offsets(data, block_size):
    """Non-overlapping windows covering a whole split (for the final val/test PPL)."""
    return torch.arange(0, len(data) - block_size - 1, block_size)


def train_step(model, optimizer, scaler, ctx, micro_batches, loss_fn, grad_clip):
    """One optimizer step with gradients accumulated over this process's micro-batches.
    loss_fn(model, batch) -> (loss, {name: float}); returns the averaged metrics and grad norm."""
    n, metrics = len(micro_batches), {}
    for i, batch in enumerate(micro_batches):
        if isinstance(model, DDP):  # all-reduce gradients only on the last micro-step
            model.require_backward_grad_sync = i == n - 1
        with ctx:
            loss, m = loss_fn(model, batch)
        scaler.scale(loss / n).backward()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v / n
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf')).item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return metrics, grad_norm


def init_weights(model, path, meta):
    """Copy a checkpoint's weights into a model of the same shape. Only the vocabulary may differ,
    by the extra [MASK] row of an MLM: that row keeps its fresh initialisation."""
    src = load_checkpoint(path)
    check_vocab(src, meta, path)
    state = model.state_dict()
    for k, v in state.items():
        w = src['model'].get(k)
        if w is None or w.shape[1:] != v.shape[1:] or not 0 <= v.shape[0] - w.shape[0] <= 1:
            raise ValueError(f"{path} does not have this model's shape ({k}): use the sizes it was trained with")
        v[:w.shape[0]] = w
    model.load_state_dict(state)


def get_lr(it, args):
    """Linear warmup, then cosine decay from lr to min_lr at lr_decay_iters."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def configure_optimizer(model, args, device):
    """AdamW; weight decay on matrices only (not on biases, LayerNorms), fused where available."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    fused = device.startswith('cuda')
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=fused)


# -----------------------------------------------------------------------------

def main(argv=None):
    args = get_args(argv)
    device, dtype, ctx = resolve_device(args.device, args.dtype)
    rank, world_size, device = setup_distributed(device)
    master = rank == 0
    if args.grad_accum % world_size:
        raise ValueError(f"--grad_accum {args.grad_accum} must be a multiple of the {world_size} processes")
    torch.manual_seed(args.seed + rank)

    meta = load_meta(args.data_dir)
    train_data, val_data = load_split(args.data_dir, 'train', meta), load_split(args.data_dir, 'val', meta)
    splits = dict(train=train_data, val=val_data)
    if args.final_eval:  # the final evaluation of the test split needs a window too
        splits['test'] = load_split(args.data_dir, 'test', meta)
    for name, d in splits.items():
        if len(d) <= args.block_size + 1:
            raise ValueError(f"the {name} split has {len(d)} tokens, fewer than block_size+1 = "
                             f"{args.block_size + 1}: lower --block_size or add text")
    ckpt_path = os.path.join(args.out_dir, 'ckpt.pt')
    if not args.resume and os.path.exists(ckpt_path):
        raise ValueError(f"{ckpt_path} exists: pass --resume to continue it or choose another --out_dir")

    mlm = args.objective == 'mlm'
    if args.match_params:
        args.n_embd = width_for_params(args.match_params, args.n_layer, args.n_head, meta['vocab_size'] + mlm,
                                       args.block_size, args.bias)
    config = GPTConfig(block_size=args.block_size, vocab_size=meta['vocab_size'] + mlm, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, bias=args.bias, causal=not mlm,
                       alibi=args.alibi)
    iter_num, best_val_loss, ckpt = 0, float('inf'), None
    if args.resume:
        ckpt = load_checkpoint(ckpt_path)
        check_vocab(ckpt, meta, ckpt_path)
        if ckpt['kind'] != args.objective:
            raise ValueError(f"{ckpt_path} was trained with --objective {ckpt['kind']}, not {args.objective}")
        config = GPTConfig(**ckpt['config'])  # the architecture is the checkpoint's, not the flags'
        iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
        args.residual_of = (ckpt.get('residual_of') or [None])[0]
    residual_of = (args.residual_of, file_hash(args.residual_of)) if args.residual_of else None
    if ckpt and residual_of and tuple(ckpt['residual_of']) != residual_of:
        raise ValueError(f"the base LM {args.residual_of} changed since this RALM was started: start it again")
    if args.residual_of:
        if mlm:
            raise ValueError("--residual_of trains a RALM, a causal LM: it does not go with --objective mlm")
        model = RALM(config, load_lm(args.residual_of, meta=meta)[0])
    else:
        model = GPT(config)
    if args.init_from and not ckpt:
        init_weights(model, args.init_from, meta)
    model.to(device)
    if ckpt:
        model.load_state_dict(ckpt['model'], strict=not args.residual_of)
    optimizer = configure_optimizer(model, args, device)
    scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
    if ckpt:
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        torch.set_rng_state(ckpt['rng_state'])  # dropout draws continue too
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[int(device.split(':')[1])] if device.startswith('cuda') else None)

    tokens_per_iter = args.batch_size * args.grad_accum * args.block_size
    val_offsets = batch_offsets(len(val_data), args.block_size, args.eval_iters * args.batch_size, args.seed, -1)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        if args.match_params:
            print(f"n_embd {config.n_embd} gives {raw_model.num_params():,} parameters for the {args.match_params:,} asked")
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens/iter, "
              f"{world_size} process(es) on {device}, {dtype}")
    log = open(os.path.join(args.out_dir, 'log.jsonl'), 'a') if master else None

    def batch_fn(data, seed):
        return lambda offsets, i: make_batch(data, offsets, args.block_size, device, args.objective,
                                             meta['vocab_size'], seed * 1_000_003 + i)

    def loss_fn(model, batch):
        offsets, seed = batch
        _, loss = model(*make_batch(train_data, offsets, args.block_size, device, args.objective, meta['vocab_size'], seed))
        return loss, dict(loss=loss.item())

    def checkpoint():
        weights = raw_model.residual_state_dict() if residual_of else raw_model.state_dict()
        save_checkpoint(dict(kind=args.objective, model=weights, residual_of=residual_of, optimizer=optimizer.state_dict(),
                             scaler=scaler.state_dict(), config=asdict(config), args=vars(args),
                             iter_num=iter_num, best_val_loss=best_val_loss, rng_state=torch.get_rng_state(),
                             meta=dict(meta, data_dir=args.data_dir)), ckpt_path)

    t0, t_start, start_iter = time.time(), time.time(), iter_num
    bar = progress(total=args.max_iters, initial=iter_num, quiet=args.quiet or not master)
    while iter_num < args.max_iters:
        lr = get_lr(iter_num, args)
        for group in optimizer.param_groups:
            group['lr'] = lr
        offsets = batch_offsets(len(train_data), args.block_size, args.batch_size * args.grad_accum,
                                args.seed, iter_num).view(args.grad_accum, args.batch_size)
        micro = [(offsets[m], (args.seed * 1_000_003 + iter_num) * 1009 + m) for m in range(rank, args.grad_accum, world_size)]
        metrics, grad_norm = train_step(model, optimizer, scaler, ctx, micro, loss_fn, args.grad_clip)
        iter_num += 1
        bar.update()

        if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
            loss_avg, = all_mean([metrics['loss']], world_size)
            dt, t0 = time.time() - t0, time.time()
            n_iters = (iter_num - 1) % args.log_interval + 1
            rec = dict(iter=iter_num, loss=loss_avg, lr=lr, grad_norm=grad_norm,
                       tokens_per_s=n_iters * tokens_per_iter / dt)
            if master:
                log.write(json.dumps(rec) + '\n')
                log.flush()
                bar.set_postfix(loss=f"{loss_avg:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            val_loss = evaluate(model, val_data, val_offsets, batch_fn(val_data, -1), args.batch_size, ctx, rank, world_size)
            best_val_loss = min(best_val_loss, val_loss)
            if master:
                log.write(json.dumps(dict(iter=iter_num, val_loss=val_loss)) + '\n')
                log.flush()
                bar.write(f"iter {iter_num}: val loss {val_loss:.4f}")
                checkpoint()
    bar.close()
    train_time = time.time() - t_start

    if world_size > 1:  # DDP must leave every rank with the same weights
        flat = torch.cat([p.detach().double().flatten() for p in raw_model.parameters()]).cpu()
        sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(sums, torch.stack([flat.sum(), (flat * torch.arange(len(flat))).sum()]))
        if master and not all(torch.equal(s, sums[0]) for s in sums):
            raise RuntimeError(f"ranks ended with different parameters: {sums}")

    results = dict(params=raw_model.num_params(), iters=iter_num, train_time_s=train_time,
                   tokens_per_s=(iter_num - start_iter) * tokens_per_iter / max(train_time, 1e-9),
                   best_val_loss=best_val_loss)
    if args.final_eval:
        for split in ('val', 'test'):
            data = load_split(args.data_dir, split, meta)
            loss = evaluate(model, data, full_split_offsets(data, args.block_size), batch_fn(data, -2),
                            args.batch_size, ctx, rank, world_size)
            results[f'{split}_loss'], results[f'{split}_ppl'] = loss, math.exp(loss)
    if master:
        log.close()
        write_json(results, os.path.join(args.out_dir, 'results.json'))
        print(f"{'split':<6} {'loss':>8} {'ppl':>8}")
        for split in ('val', 'test'):
            if f'{split}_loss' in results:
                print(f"{split:<6} {results[f'{split}_loss']:>8.4f} {results[f'{split}_ppl']:>8.3f}")
        print(f"trained {iter_num} iters in {train_time:.0f}s ({results['tokens_per_s']:.0f} tokens/s)")
        if args.num_samples and not mlm:
            print_samples(raw_model, val_data, meta, args.num_samples, device)
    if world_size > 1:
        dist.destroy_process_group()
    return results


def print_samples(model, data, meta, num_samples, device):
    """A few continuations of the start of the val split, to eyeball what was learned."""
    tok = load_tokenizer(meta)
    prompt_len = min(64, model.config.block_size // 2)
    gen_len = min(200, model.config.block_size - prompt_len)
    prompt = torch.from_numpy(data[:prompt_len].astype(np.int64))[None].to(device)
    tokens, _ = model.generate(prompt, gen_len, num_samples=num_samples, generator=torch.Generator(device).manual_seed(0))
    print(f"--- prompt:\n{tok.decode(prompt[0].tolist())}")
    for i in range(num_samples):
        print(f"--- sample {i + 1}:\n{tok.decode(tokens[0, i].tolist())}")


if __name__ == '__main__':
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")

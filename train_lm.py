"""
MLE training of a GPT: the base LM P_LM that the residual energy corrects (and, later, the
BALM/RALM baselines and the masked-LM pretraining of the BIT energy); --objective tailr trains or
fine-tunes an LM with TaiLr instead (Ji et al., ICLR 2023: tailr_loss).

    python train_lm.py --data_dir data/shakespeare --out_dir out/lm               # CPU
    python train_lm.py --data_dir data/shakespeare_gpt2 --n_layer 12 ...          # one GPU
    torchrun --standalone --nproc_per_node 8 train_lm.py ...                      # DDP

Batches are a pure function of (seed, iteration): for a given --grad_accum (default: one
micro-batch per process) the global batch of an iteration is the same whatever the number of
processes, and --resume continues exactly where the checkpoint stopped.
The periodic evaluation uses the selection split ('select', carved from the training documents);
val and test are evaluated once, at the end, and only reported. Writes out_dir/ckpt.pt
(atomically, at every evaluation), out_dir/log.jsonl and out_dir/results.json.
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import plumbing  # first: threads' wait policy, read once as torch loads (plumbing.py; skip it)
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from budget import check_training_memory
from data import batch_offsets, get_batch, load_meta, load_split, write_json
from data.tokenizer import load_tokenizer
from energy import mlm_mask
from model import (GPT, RALM, GPTConfig, check_vocab, file_hash, load_checkpoint, load_lm, save_checkpoints,
                   width_for_params)
from plumbing import (ArgumentParser, at_least, check_new_run, check_resumed_flags, check_resumed_iters,
                      check_training_flags, checkpoint_hint, choose_dtype, diverged, lock_folder,
                      micro_batches, missing_checkpoint, one_job, pick_device, rng, rng_seed, run_main,
                      write_log)

# The paper's models (Section 4.1, Appendix A.3 / Table 4) for GPT-2 BPE, prefix 120 + 40 tokens.
# Shapes: d_ff = 4 d_model everywhere; BIT-BASE/LARGE are RoBERTa-base/large; BIT-MED matches UNIT.
PAPER_PRESETS = {
    'base_lm': dict(n_layer=12, n_head=16, n_embd=1024,
                    batch_size=32, warmup_iters=2000, max_iters=180000, lr=1e-4, grad_clip=10.0),
    'base_lm_24l': dict(n_layer=24, n_head=12, n_embd=768,
                        batch_size=50, warmup_iters=2000, max_iters=90000, lr=3e-4, grad_clip=0.25),
    'ralm': dict(n_layer=12, n_head=16, n_embd=1024,
                 batch_size=64, warmup_iters=2000, max_iters=180000, lr=1e-4, grad_clip=10.0),
    'balm': dict(n_layer=12, n_head=16, n_embd=1568,
                 batch_size=32, warmup_iters=2000, max_iters=180000, lr=1e-4, grad_clip=10.0),
    'unit': dict(batch_size=64, warmup_iters=2000, max_iters=180000, lr=3e-4, grad_clip=10.0),
    'bit_base': dict(n_layer=12, n_head=12, n_embd=768, bias=True,
                     batch_size=60, warmup_iters=2000, max_iters=90000, lr=5e-5, grad_clip=0.25),
    'bit_med': dict(n_layer=12, n_head=16, n_embd=1024, bias=True,
                    batch_size=32, warmup_iters=2000, max_iters=90000, lr=5e-5, grad_clip=0.25),
    'bit_large': dict(n_layer=24, n_head=16, n_embd=1024, bias=True,
                      batch_size=20, warmup_iters=2000, max_iters=90000, lr=5e-5, grad_clip=0.25),
}
PAPER_DATA = dict(tokenizer='gpt2', block_size=512, prefix_len=120, gen_len=40)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
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
    a('--objective', default='lm', choices=['lm', 'mlm', 'tailr'],
      help="lm: next-token MLE (base LM, BALM); mlm: BERT-style masked LM of a bidirectional body "
           "(the BIT energy's pretraining, energy.py); tailr: next-token TaiLr (tailr_loss, Ji et al. 2023)")
    a('--gamma', type=float, default=None,
      help='TaiLr: 1 = total variation, towards 0 = MLE (--objective tailr)')
    # model
    a('--n_layer', type=int, default=4)
    a('--n_head', type=int, default=4)
    a('--n_embd', type=int, default=256)
    a('--block_size', type=int, default=256, help='context length in tokens')
    a('--dropout', type=float, default=0.0)
    a('--bias', action='store_true', help='biases in linear layers and LayerNorms')
    a('--alibi', action='store_true',
      help="ALiBi distance penalty in attention (the BIT's MLM pretraining: no plateau)")
    add_training_flags(a)
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PAPER_PRESETS[preset], block_size=PAPER_DATA['block_size'])
    args = p.parse_args(argv)
    check_args(args, argv)
    return args


def add_training_flags(a):
    """Optimisation, evaluation and system flags (a: the parser's add_argument)."""
    a('--batch_size', type=int, default=16, help='sequences per micro-batch per process')
    a('--grad_accum', type=int, default=None,
      help='micro-batches per iteration, summed over processes (default: one per process)')
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
    a('--eval_interval', type=int, default=250,
      help='selection-set loss + checkpoint every this many iterations')
    a('--patience', type=int, default=0,
      help='early stopping: stop once the lowest selection loss has improved by less than --min_rel_delta '
           'over the last this many evaluations (0: off); best.pt always holds the lowest loss\'s weights')
    a('--min_rel_delta', type=float, default=0.0,
      help='early stopping: the smallest relative improvement that counts (0.001: 0.1%%; 0: any)')
    a('--snapshots', default='', help='comma-separated iterations whose weights are also kept as iter_N.pt '
                                      '(the ordering figure: models along the training run)')
    a('--eval_iters', type=int, default=20, help='selection-set batches per periodic evaluation')
    a('--log_interval', type=int, default=10)
    a('--final_eval', type=int, default=1, choices=[0, 1],
      help='1: val/test PPL over the whole splits at the end')
    a('--final_eval_windows', type=int, default=0, help='evenly spaced windows of each split for it (0: all)')
    a('--num_samples', type=int, default=2, help='samples printed at the end')
    # system
    a('--device', default='auto', help="'cpu', 'cuda', 'cuda:1', ... ('auto': cuda if available)")
    a('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
      help="autocast dtype ('auto': bf16 on GPUs from compute capability 8.0, fp16 + GradScaler before; "
           "on a CPU bf16 where it has bf16 units; float16 on a CPU is emulated, slow, for tests)")
    a('--compile', action='store_true', help='torch.compile the model')
    a('--seed', type=int, default=1337)
    a('--quiet', action='store_true', help='no progress bar')


def check_resume(args, argv):
    """--resume continues the checkpoint's model: a flag given that contradicts it is refused."""
    path = os.path.join(args.out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        raise missing_checkpoint(args.out_dir)
    ckpt = load_checkpoint(path)
    if ckpt['kind'] not in ('lm', 'mlm'):
        return  # build_model says what it holds instead
    saved = dict(ckpt.get('args', {}), **ckpt['config'], objective=ckpt.get('objective', ckpt['kind']),
                 gamma=ckpt.get('gamma'), dtype=ckpt.get('args', {}).get('dtype'))
    shape = {'n_layer', 'n_head', 'block_size', 'bias', 'alibi', 'objective', 'gamma'}
    shape |= set() if args.match_params else {'n_embd'}  # BALM's width came from --match_params
    check_resumed_flags(args, argv, saved, shape | set(RESUME_FIXED), path, 'run')
    check_resumed_iters(args.max_iters, ckpt['iter_num'], path)


# the flags beside the model's shape that change a run's numbers: a --resume keeps the checkpoint's
RESUME_FIXED = ('seed', 'data_dir', 'lr', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'batch_size',
                'grad_accum', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'dropout', 'eval_interval',
                'eval_iters', 'patience', 'min_rel_delta', 'final_eval_windows', 'residual_of', 'init_from',
                'match_params')


def check_args(args, argv):
    """Every flag in range, and with --resume those given (argv) agreeing with the checkpoint,
    before any work: one line naming the flag."""
    at_least(args, 1, 'n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'grad_accum', 'max_iters',
             'lr_decay_iters', 'eval_interval', 'eval_iters', 'log_interval', 'match_params')
    at_least(args, 0, 'warmup_iters', 'num_samples', 'weight_decay', 'grad_clip', 'patience', 'min_rel_delta',
             'final_eval_windows')
    try:
        args.snapshots = sorted({int(i) for i in args.snapshots.split(',') if i.strip()})
    except ValueError:
        raise ValueError(f"--snapshots {args.snapshots}: must be comma-separated iteration numbers, "
                         f"e.g. 250,500") from None
    if (args.objective == 'tailr') != (args.gamma is not None):
        raise ValueError("--objective tailr and --gamma go together: TaiLr needs its gamma in [0, 1], "
                         "the others none")
    if args.gamma is not None:
        at_least(args, 0, 'gamma')
        if args.gamma > 1:
            raise ValueError(f"--gamma {args.gamma}: must be in [0, 1]")
    check_training_flags(args)
    if args.resume:
        check_resume(args, argv)


def tailr_loss(logits, targets, gamma):
    """TaiLr (the talk's "TVD for LM fine-tuning"; Ji et al., ICLR 2023): each token's
    log-likelihood weighted by p / (gamma + (1 - gamma) p), p the model's own probability of that
    token, the weight held constant (stop-gradient). gamma = 1 weights by p: the gradient of the
    total variation distance, which lets go of tokens the model finds unlikely; gamma -> 0 is MLE.
    logits (B, T, V), targets (B, T) -> a scalar, in float32."""
    logp = F.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    p = logp.detach().exp()
    return -(p / (gamma + (1 - gamma) * p) * logp).mean()


# -----------------------------------------------------------------------------
# data

def make_batch(data, offsets, block_size, device, objective='lm', vocab_size=None, g=None):
    """Inputs and targets of one micro-batch: next tokens (lm), or masked positions (mlm, masks
    drawn from the generator g; the [MASK] id is vocab_size, one past the data's tokens)."""
    x, y = get_batch(data, offsets, block_size, device)
    if objective != 'mlm':
        return x, y
    return mlm_mask(x, vocab_size, mask_id=vocab_size, generator=g)


@torch.no_grad()
def evaluate(model, data, split, offsets, args, vocab_size, device, ctx, rank=0, world_size=1):
    """Mean loss over the windows at `offsets`, each process taking every world_size-th batch;
    token-weighted sums are reduced, so the result does not depend on the number of processes."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    batches = offsets.split(args.batch_size)
    for i in range(rank, len(batches), world_size):
        x, y = make_batch(data, batches[i], args.block_size, device, args.objective, vocab_size,
                          rng(args.seed, 'mlm_mask', split, i))
        with ctx:
            _, loss = model(x, y)
        n = (y >= 0).sum().item()
        sums += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    model.train()
    if world_size > 1:  # on the run's device: NCCL refuses CPU tensors
        sums = sums.to(device)
        dist.all_reduce(sums)
    loss = (sums[0] / sums[1]).item()
    if not math.isfinite(loss):  # the same on every rank; raised before anything of it is saved
        raise ValueError(f"the {split} loss is {loss}: training diverged; lower --lr or --weight_decay, "
                         f"or clip harder (--grad_clip)")
    return loss


def final_evaluation(model, data, args, vocab_size, device, ctx, rank, world_size):
    """Loss and PPL of val and test over the whole splits (or --final_eval_windows of them)."""
    results = {}
    for split in ('val', 'test'):
        offsets = full_split_offsets(data[split], args.block_size, args.final_eval_windows)
        loss = evaluate(model, data[split], split, offsets, args, vocab_size, device, ctx, rank, world_size)
        results[f'{split}_loss'], results[f'{split}_ppl'] = loss, math.exp(loss)
    return results


def full_split_offsets(data, block_size, max_windows=0):
    """Non-overlapping windows covering a whole split (for the final val/test PPL), or an evenly
    spaced max_windows of them."""
    offsets = torch.arange(0, len(data) - block_size - 1, block_size)
    if max_windows and len(offsets) > max_windows:
        offsets = offsets[torch.linspace(0, len(offsets) - 1, max_windows).round().long()]
    return offsets


# -----------------------------------------------------------------------------
# the model

def build_model(args, meta):
    """The model to train and, with --resume, the checkpoint it continues (whose architecture
    wins over the flags). New: a GPT, or a RALM on the frozen --residual_of LM (Eq. 6),
    optionally starting from --init_from's weights."""
    mlm, ckpt_path = args.objective == 'mlm', os.path.join(args.out_dir, 'ckpt.pt')
    if args.resume:
        model, ckpt = load_lm(ckpt_path, meta=meta, kind='mlm' if mlm else 'lm')
        args.residual_of = (ckpt.get('residual_of') or [None])[0]
        return model.train(), ckpt
    check_new_run(args.out_dir)  # best.pt as much as ckpt.pt
    if args.residual_of and mlm:
        raise ValueError("--residual_of trains a RALM, a causal LM: it does not go with --objective mlm")
    if args.match_params:
        args.n_embd = width_for_params(args.match_params, args.n_layer, args.n_head, meta['vocab_size'] + mlm,
                                       args.block_size, args.bias)
    config = GPTConfig(block_size=args.block_size, vocab_size=meta['vocab_size'] + mlm, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, bias=args.bias,
                       causal=not mlm, alibi=args.alibi)
    if args.match_params:
        with torch.device('meta'):  # counted before any memory is spent on it
            n_params = GPT(config).num_params()
        if not 0.5 < n_params / args.match_params < 2:
            raise ValueError(f"--match_params {args.match_params}: the nearest width (n_embd {args.n_embd}) "
                             f"gives {n_params:,} parameters: change --n_layer to get near it")
    what = (f"training {args.n_layer} layers of n_embd {args.n_embd} on --batch_size {args.batch_size} x "
            f"--block_size {args.block_size}")
    check_training_memory(config, args.batch_size, pick_device(args.device), what,
                          "lower them (--grad_accum keeps the batch)")
    if args.residual_of:
        base = load_lm(args.residual_of, meta=meta)[0]
        if args.block_size > base.config.block_size:
            raise ValueError(f"--block_size {args.block_size} exceeds that of --residual_of "
                             f"{args.residual_of} ({base.config.block_size}): a RALM reads no further back "
                             f"than its base LM")
    model = RALM(config, base) if args.residual_of else GPT(config)
    if args.init_from:
        init_weights(model, args.init_from, meta)
    return model, None


def init_weights(model, path, meta):
    """Copy a checkpoint's weights into a model of the same shape. Only the vocabulary may differ,
    by the extra [MASK] row of an MLM: that row keeps its fresh initialisation."""
    src = load_checkpoint(path)
    if src['kind'] == 'energy':
        raise ValueError(f"--init_from {path} is an energy (nce_train.py), not a train_lm.py checkpoint: "
                         f"start from an LM or a masked LM")
    check_vocab(src, meta, path)
    state = model.state_dict()
    for k, v in state.items():
        w = src['model'].get(k)
        if w is None or w.shape[1:] != v.shape[1:] or not 0 <= v.shape[0] - w.shape[0] <= 1:
            raise ValueError(f"{path} does not have this model's shape ({k}): "
                             f"use the sizes it was trained with")
        v[:w.shape[0]] = w
    model.load_state_dict(state)


def load_data(args):
    meta = load_meta(args.data_dir)
    splits = ('train', 'select', 'val', 'test') if args.final_eval else ('train', 'select', 'val')
    data = {name: load_split(args.data_dir, name, meta) for name in splits}
    for name, d in data.items():
        if len(d) <= args.block_size + 1:
            raise ValueError(f"the {name} split has {len(d)} tokens, fewer than block_size+1 = "
                             f"{args.block_size + 1}: lower --block_size or add text")
    return meta, data


# -----------------------------------------------------------------------------

@one_job  # --out_dir's lock released however main ends
def main(argv=None):
    args = get_args(argv)
    lock_folder(args.out_dir)  # one job per folder
    # DDP under torchrun (one process otherwise): each rank takes its share of every batch
    device = pick_device(args.device)
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        if device.startswith('cuda'):
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master = rank == 0
    args.grad_accum = micro_batches(args.grad_accum, world_size)  # default: one per process
    torch.manual_seed(rng_seed(args.seed, 'torch', '', rank))  # init (DDP then copies rank 0's)
    # precision from the hardware, decided once and saved with the flags (a --resume keeps it)
    args.dtype, why = choose_dtype(device, args.dtype, 'train')
    ctx = (nullcontext() if args.dtype == 'float32'
           else torch.autocast(device_type=device.split(':')[0], dtype=getattr(torch, args.dtype)))
    if master:
        print(f"threads: {torch.get_num_threads()}, {plumbing.THREADS_WHY}\n"
              f"train: {device}, {args.dtype} ({why})", flush=True)

    meta, data = load_data(args)
    raw_model, ckpt = build_model(args, meta)
    residual_of = (args.residual_of, file_hash(args.residual_of)) if args.residual_of else None
    raw_model.to(device)
    # AdamW, weight decay on matrices only; the GradScaler scales fp16's loss (a no-op otherwise)
    params = [p for p in raw_model.parameters() if p.requires_grad]  # a RALM's base LM stays frozen
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2),
                                  fused=device.startswith('cuda'))
    scaler = torch.amp.GradScaler(device.split(':')[0], enabled=args.dtype == 'float16')
    if ckpt:  # --resume: optimizer and scaler continue where they stopped
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
    model = torch.compile(raw_model) if args.compile else raw_model
    if ddp:
        model = DDP(model, device_ids=[torch.cuda.current_device()] if device.startswith('cuda') else None)

    iter_num = ckpt['iter_num'] if ckpt else 0
    # best: the lowest selection loss (best.pt); trail: the lowest loss after each evaluation
    best = {'trail': [], **ckpt['best']} if ckpt and 'best' in ckpt else dict(loss=math.inf, iter=0, trail=[])
    V, select_offsets = meta['vocab_size'], fixed_select_offsets(len(data['select']), args)
    tokens_per_iter = args.batch_size * args.grad_accum * args.block_size
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters (n_embd {raw_model.config.n_embd}), "
              f"{tokens_per_iter:,} tokens/iter, {world_size} process(es)")
    log = open(os.path.join(args.out_dir, 'log.jsonl'), 'a') if master else None
    t0, t_start, start_iter = time.time(), time.time(), iter_num
    best_weights = None  # every rank keeps its own copy (reading best.pt back would race rank 0's write)
    bar = tqdm(total=args.max_iters, initial=iter_num, dynamic_ncols=True,
               disable=args.quiet or not master or not sys.stderr.isatty())
    while iter_num < args.max_iters and not stopped_early(best, args):
        lr = get_lr(iter_num, args)
        for group in optimizer.param_groups:
            group['lr'] = lr
        train_loss = train_step(model, scaler, data['train'], V, args, iter_num, device, ctx, rank,
                                world_size)
        scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf).item()
        if not math.isfinite(grad_norm) and not scaler.is_enabled():  # fp16's scaler skips such steps itself
            raise ValueError(diverged(iter_num, grad_norm, args.out_dir))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        bar.update()

        if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
            loss = torch.tensor(train_loss, dtype=torch.float64)
            if ddp:  # the mean over ranks, reduced on the run's device (NCCL refuses CPU tensors)
                loss = loss.to(device)
                dist.all_reduce(loss)
                loss /= world_size
            rec = dict(iter=iter_num, loss=loss.item(), lr=lr, grad_norm=grad_norm)
            now = time.time()
            rec['tokens_per_s'] = ((iter_num - 1) % args.log_interval + 1) * tokens_per_iter / (now - t0)
            t0 = now
            write_log(log, rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            select_loss = evaluate(model, data['select'], 'select', select_offsets, args, V, device, ctx,
                                   rank, world_size)
            improved = select_loss < best['loss']  # the same on every rank: the loss is all-reduced
            if improved:
                best.update(loss=select_loss, iter=iter_num)
                best_weights = {k: v.detach().clone() for k, v in weights_of(raw_model, residual_of).items()}
            best['trail'].append(best['loss'])
            write_log(log, dict(iter=iter_num, tokens=iter_num * tokens_per_iter, select_loss=select_loss))
            if master:
                bar.write(f"iter {iter_num}: select loss {select_loss:.4f}" + (' (best)' if improved else ''))
                save_states(raw_model, optimizer, scaler, args, meta, iter_num, best, improved, residual_of)
    bar.close()

    train_time = time.time() - t_start
    results = dict(params=raw_model.num_params(), iters=iter_num, train_time_s=train_time, dtype=args.dtype,
                   tokens_per_s=(iter_num - start_iter) * tokens_per_iter / max(train_time, 1e-9),
                   best_select_loss=best['loss'], best_iter=best['iter'], last_iter=iter_num,
                   converged=stopped_early(best, args), tokens_per_iter=tokens_per_iter,
                   curve=learning_curve(args.out_dir) if master else [])
    if args.final_eval:  # val and test of the best weights, the ones every later stage uses
        load_best(raw_model, best_weights, args.out_dir, residual_of)
        results.update(final_evaluation(model, data, args, V, device, ctx, rank, world_size))
    if master:
        log.close()
        report(results, args, raw_model, data['val'], meta, device)
    if ddp:
        dist.barrier()  # no rank tears down while another still writes
        dist.destroy_process_group()
    return results


def get_lr(it, args):
    """Linear warmup, then cosine decay from --lr to --min_lr at --lr_decay_iters (nanoGPT's)."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def load_best(raw_model, best_weights, out_dir, residual_of):
    """The weights of the lowest selection loss into raw_model: this run's copy, or best.pt when the
    best came before a --resume (best_weights None); a RALM's are its residual's only."""
    best_weights = best_weights or load_checkpoint(os.path.join(out_dir, 'best.pt'))['model']
    raw_model.load_state_dict(best_weights, strict=not residual_of)


def fixed_select_offsets(n, args):
    """The selection-split windows every periodic evaluation uses (the same each time)."""
    return batch_offsets(n, args.block_size, args.eval_iters * args.batch_size, args.seed, 'select', 0)


def train_step(model, scaler, train, V, args, iter_num, device, ctx, rank, world_size):
    """Forward and backward of this process's micro-batches of step iter_num: batches, masks and
    dropout draws are a function of the seed and the micro-batch, so that --resume (on any device)
    and DDP see what one uninterrupted process sees; returns their mean loss."""
    B = args.batch_size
    n_micro = args.grad_accum // world_size  # this process's micro-batches
    offsets = batch_offsets(len(train), args.block_size, B * args.grad_accum, args.seed, 'train', iter_num)
    train_loss = 0.0
    for m in range(rank, args.grad_accum, world_size):
        mask_rng = rng(args.seed, 'mlm_mask', 'train', iter_num * args.grad_accum + m)
        torch.manual_seed(rng_seed(args.seed, 'dropout', 'train', iter_num * args.grad_accum + m))
        x, y = make_batch(train, offsets[m * B:(m + 1) * B], args.block_size, device, args.objective, V,
                          mask_rng)
        if world_size > 1:  # all-reduce the gradients only on the last micro-batch
            model.require_backward_grad_sync = m + world_size >= args.grad_accum
        with ctx:
            if args.objective == 'tailr':
                loss = tailr_loss(model(x)[0], y, args.gamma)
            else:
                loss = model(x, y)[1]
        scaler.scale(loss / n_micro).backward()
        train_loss += loss.item() / n_micro
    return train_loss


# -----------------------------------------------------------------------------
# early stopping and what is kept

def stopped_early(best, args):
    """Early stopping, this project's protocol for every LM (the paper trains for fixed budgets): stop
    once the lowest selection loss has improved by less than --min_rel_delta, relative, over the
    last --patience evaluations. Measured from the best loss so far, so a run still improving by
    small steps that add up goes on; with --min_rel_delta 0, stop when the best step is --patience
    evaluations old. `converged` in results.json: this rule fired (not --max_iters)."""
    trail = best['trail']  # the lowest selection loss after each evaluation
    return (args.patience > 0 and len(trail) > args.patience
            and trail[-1] >= trail[-1 - args.patience] * (1 - args.min_rel_delta))


def save_states(raw_model, optimizer, scaler, args, meta, iter_num, best, improved, residual_of):
    """ckpt.pt: everything --resume needs; best.pt: the weights at the lowest selection loss;
    iter_N.pt at the iterations of --snapshots. Saved together (save_checkpoints): the disk is
    checked for all of them first, and ckpt.pt goes in first, so a --resume can always continue."""
    state = dict(kind='mlm' if args.objective == 'mlm' else 'lm', objective=args.objective, gamma=args.gamma,
                 model=weights_of(raw_model, residual_of), residual_of=residual_of,
                 config=asdict(raw_model.config), args=vars(args), iter_num=iter_num, best=best,
                 meta=dict(meta, data_dir=args.data_dir))
    saves = [(dict(state, optimizer=optimizer.state_dict(), scaler=scaler.state_dict()),
              os.path.join(args.out_dir, 'ckpt.pt'))]
    if improved:
        saves.append((state, os.path.join(args.out_dir, 'best.pt')))
    if iter_num in args.snapshots:
        saves.append((state, os.path.join(args.out_dir, f'iter_{iter_num}.pt')))
    save_checkpoints(saves)


def weights_of(raw_model, residual_of):
    """What a checkpoint keeps: the weights, or a RALM's residual only (its base is frozen)."""
    return raw_model.residual_state_dict() if residual_of else raw_model.state_dict()


def learning_curve(out_dir):
    """The selection loss against iterations and tokens seen, from log.jsonl (resumed runs
    included): the convergence evidence that results.json carries."""
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    curve = {r['iter']: dict(iter=r['iter'], tokens=r.get('tokens'), select_loss=r['select_loss'])
             for r in recs if 'select_loss' in r}
    return [curve[k] for k in sorted(curve)]


def report(results, args, model, val_data, meta, device):
    write_json(results, os.path.join(args.out_dir, 'results.json'))
    print(f"{'split':<6} {'loss':>8} {'ppl':>8}")
    for split in ('val', 'test'):
        if f'{split}_loss' in results:
            print(f"{split:<6} {results[f'{split}_loss']:>8.4f} {results[f'{split}_ppl']:>8.3f}")
    print(f"trained {results['iters']} iters in {results['train_time_s']:.0f}s "
          f"({results['tokens_per_s']:.0f} tokens/s)")
    if args.num_samples and args.objective != 'mlm':
        print_samples(model, val_data, meta, args.num_samples, device)


def print_samples(model, data, meta, num_samples, device):
    """A few continuations of the start of the val split, to eyeball what was learned."""
    tok = load_tokenizer(meta)
    prompt_len = min(64, model.config.block_size // 2)
    gen_len = min(200, model.config.block_size - prompt_len)
    prompt = torch.from_numpy(data[:prompt_len].astype(np.int64))[None].to(device)
    tokens, _ = model.generate(prompt, gen_len, num_samples=num_samples,
                               generator=torch.Generator(device).manual_seed(0))
    print(f"--- prompt:\n{tok.decode(prompt[0].tolist())}")
    for i in range(num_samples):
        print(f"--- sample {i + 1}:\n{tok.decode(tokens[0, i].tolist())}")


def resume_hint(argv):
    args = get_args(argv)
    return checkpoint_hint(argv, os.path.join(args.out_dir, 'ckpt.pt'), args.max_iters, args.eval_interval)


if __name__ == '__main__':
    run_main(main, resume_hint)

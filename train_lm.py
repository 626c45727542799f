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

import math
import os
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import batch_offsets, data_hash, get_batch, load_meta, load_split, problem_windows, windows
from data.tokenizer import load_tokenizer
from energy import mlm_mask
from model import (GPT, RALM, GPTConfig, configure_optimizer, get_lr, load_checkpoint, load_lm, stopped_early,
                   width_for_params)
from plumbing import (RunDir, all_reduce, checkpoints, file_hash, guards, one_job, precision, rng_seed,
                      run_trainer, setup, teardown_distributed, training_parser)

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
    'bit_large': dict(n_layer=24, n_head=16, n_embd=1024, bias=True,  # Table 4's row with LM-24L
                      batch_size=20, warmup_iters=2000, max_iters=90000, lr=5e-5, grad_clip=0.25),
}
PAPER_DATA = dict(tokenizer='gpt2', block_size=512, prefix_len=120, gen_len=40)


def get_args(argv=None):
    p = training_parser(__doc__, 'out/lm', max_iters=2000, lr=2e-3, min_lr=2e-4, warmup_iters=100,
                        eval_interval=250)
    a = p.add_argument
    a('--data_dir', default='data/shakespeare', help='prepared data (data/<corpus>/prepare.py)')
    a('--preset', default=None, choices=sorted(PAPER_PRESETS),
      help="the paper's model shape and Table 4 optimisation settings (GPU scale; flags still override)")
    a('--residual_of', default=None, help='train a RALM (Eq. 6): a GPT whose logits add to this frozen LM\'s')
    a('--match_params', type=int, default=None, at_least=1, at_most=None,
      help='BALM: choose n_embd so the model has about this many parameters (e.g. base LM + energy)')
    a('--init_from', default=None,
      help='start from the weights of this checkpoint (same shape; e.g. the MLM pretraining of a BIT from '
           'the base LM, whose vocabulary gains a [MASK] row)')
    a('--objective', default='lm', choices=['lm', 'mlm', 'tailr'],
      help="lm: next-token MLE (base LM, BALM); mlm: BERT-style masked LM of a bidirectional body "
           "(the BIT energy's pretraining, energy.py); tailr: next-token TaiLr (tailr_loss, Ji et al. 2023)")
    a('--gamma', type=float, default=None, at_least=0, at_most=None,
      help='TaiLr: 1 = total variation, towards 0 = MLE (--objective tailr)')
    # model
    a('--n_layer', type=int, default=4, at_least=1, at_most='tokens', help='transformer blocks')
    a('--n_head', type=int, default=4, at_least=1, at_most='tokens',
      help='attention heads (they divide n_embd)')
    a('--n_embd', type=int, default=256, at_least=1, at_most='tokens', help='width')
    a('--block_size', type=int, default=256, at_least=1, at_most='tokens', help='context length in tokens')
    a('--dropout', type=float, default=0.0, at_least=0, below=1, help='dropout probability, in [0, 1)')
    a('--bias', action='store_true', help='biases in linear layers and LayerNorms')
    a('--alibi', action='store_true',
      help="ALiBi distance penalty in attention (the BIT's MLM pretraining: no plateau)")
    # evaluation
    a('--snapshots', default='', help='comma-separated iterations whose weights are also kept as iter_N.pt '
                                      '(the ordering figure: models along the training run)')
    a('--eval_iters', type=int, default=20, at_least=1, at_most='count',
      help='selection-set batches per periodic evaluation')
    a('--select_on', default='window', choices=['window', 'continuation'],
      help="what the selection loss (stopping, best.pt) scores: every token of its windows, or, on problem "
           "data (a+b=c, data/addition), only the continuation (the answer) after each problem's prefix")
    a('--final_eval', type=int, default=1, choices=[0, 1], at_least=0, at_most=1,
      help='1: val/test PPL over the whole splits at the end')
    a('--final_eval_windows', type=int, default=0, at_least=0, at_most='count',
      help='evenly spaced windows of each split for it (0: all)')
    a('--print_samples', dest='num_samples', type=int, default=2, at_least=0, at_most=1000,
      help='samples printed at the end')
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PAPER_PRESETS[preset], block_size=PAPER_DATA['block_size'])
    return p.parse_args(argv)


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
    answers = args.select_layout if split == 'select' else None  # (P, L): score the answers only
    batches = offsets.split(args.batch_size * (args.block_size // sum(answers) if answers else 1))
    for i in range(rank, len(batches), world_size):
        g = torch.Generator().manual_seed(rng_seed(args.seed, 'mlm_mask', split, i))
        if answers:
            x, y = continuation_batch(data, batches[i], *answers, device)
        else:
            x, y = make_batch(data, batches[i], args.block_size, device, args.objective, vocab_size, g)
        with ctx:
            _, loss = model(x, y)
        n = (y >= 0).sum().item()
        sums += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    model.train()
    sums = all_reduce(sums, device, world_size)
    loss = (sums[0] / sums[1]).item()
    if not math.isfinite(loss):  # the same on every rank; raised before anything of it is saved
        raise ValueError(f"the {split} loss is {loss}: training diverged; lower --lr or --weight_decay, "
                         f"or clip harder (--grad_clip)")
    return loss


def continuation_batch(data, offsets, P, L, device):
    """Inputs (B, P+L-1) of the problem windows at offsets and targets with the prefix's positions
    ignored (-1): the loss of the continuation given its problem, what a task with an answer scores."""
    x = torch.from_numpy(np.stack([data[o:o + P + L].astype(np.int64) for o in offsets.tolist()])).to(device)
    y = x[:, 1:].clone()
    y[:, :P - 1] = -1
    return x[:, :-1], y


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

def build_model(args, meta, device):
    """The model to train and, with --resume, the checkpoint it continues (whose architecture
    wins over the flags). New: a GPT, or a RALM on the frozen --residual_of LM (Eq. 6),
    optionally starting from --init_from's weights."""
    mlm, ckpt_path = args.objective == 'mlm', os.path.join(args.out_dir, 'ckpt.pt')
    if args.resume:
        model, ckpt = load_lm(ckpt_path, meta=meta, kind='mlm' if mlm else 'lm')
        args.residual_of = (ckpt.get('residual_of') or [None])[0]
        return model.train(), ckpt
    if args.match_params:
        args.n_embd = width_for_params(args.match_params, args.n_layer, args.n_head, meta['vocab_size'] + mlm,
                                       args.block_size, args.bias)
    config = GPTConfig(block_size=args.block_size, vocab_size=meta['vocab_size'] + mlm, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, bias=args.bias,
                       causal=not mlm, alibi=args.alibi)
    with torch.device('meta'):  # BALM's parameters, counted before any memory is spent on it
        n_params = GPT(config).num_params() if args.match_params else None
    guards.check_new_lm(args, config, device, n_params)
    if args.residual_of:
        base = load_lm(args.residual_of, meta=meta)[0]
        guards.check_ralm_base(args.block_size, base, args.residual_of)
    model = RALM(config, base) if args.residual_of else GPT(config)
    if args.init_from:
        init_weights(model, args.init_from, meta)
    return model, None


def init_weights(model, path, meta):
    """Copy a checkpoint's weights into a model of the same shape. Only the vocabulary may differ,
    by the extra [MASK] row of an MLM: that row keeps its fresh initialisation."""
    src = load_checkpoint(path)
    checkpoints.check_lm_init(src, meta, path)
    state = model.state_dict()
    for k, v in state.items():
        w = src['model'].get(k)
        checkpoints.check_same_shape(k, w, v, path)
        v[:w.shape[0]] = w
    model.load_state_dict(state)


def load_data(args):
    meta = load_meta(args.data_dir)
    args.select_layout = select_layout(args, meta)
    splits = ('train', 'select', 'val', 'test') if args.final_eval else ('train', 'select', 'val')
    data = {name: load_split(args.data_dir, name, meta) for name in splits}
    guards.check_split_lengths(data, args.block_size)
    return meta, data


def select_layout(args, meta):
    """(prefix_len, gen_len) of the problems whose answers --select_on continuation scores, else None."""
    if args.select_on == 'window':
        return None
    layout = problem_windows(meta)
    guards.check_select_layout(layout, args)
    return layout


# -----------------------------------------------------------------------------

def input_hashes(args):
    """What a --resume must find unchanged: the data this run trains and stops on (ckpt.pt records it)."""
    return dict(data_dir=data_hash(args.data_dir, ('train', 'select', 'val')))


@one_job  # --out_dir's lock released however main ends
def main(argv=None):
    args = guards.check_lm_flags(get_args(argv), argv, load_checkpoint, input_hashes)  # before any work
    out = RunDir(args)  # one job per folder; log.jsonl, results.json
    # DDP under torchrun (one process otherwise): each rank takes its share of every batch
    rank, world_size, device = setup(args.device, args.deterministic)
    master = rank == 0
    torch.manual_seed(rng_seed(args.seed, 'torch', '', rank))  # init (DDP then copies rank 0's)
    # autocast's precision from the hardware, decided once and saved with the flags (a --resume keeps it)
    args.dtype, ctx = precision(device, args.dtype, verbose=master)

    meta, data = load_data(args)
    raw_model, ckpt = build_model(args, meta, device)
    residual_of = (args.residual_of, file_hash(args.residual_of)) if args.residual_of else None
    raw_model.to(device)
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay, (args.beta1, args.beta2), device)
    scaler = torch.amp.GradScaler(device.split(':')[0], enabled=args.dtype == 'float16')  # fp16 only
    if ckpt:  # --resume: optimizer and scaler continue where they stopped
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
    model = torch.compile(raw_model) if args.compile else raw_model
    if world_size > 1:
        model = DDP(model, device_ids=[torch.cuda.current_device()] if device.startswith('cuda') else None)

    iter_num = ckpt['iter_num'] if ckpt else 0
    # best: the lowest selection loss (best.pt); trail: the lowest loss after each evaluation
    best = {'trail': [], **ckpt['best']} if ckpt and 'best' in ckpt else dict(loss=math.inf, iter=0, trail=[])
    V, select_offsets = meta['vocab_size'], fixed_select_offsets(data['select'], args)
    tokens_per_iter = args.batch_size * args.grad_accum * args.block_size
    if master:
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters (n_embd {raw_model.config.n_embd}), "
              f"{tokens_per_iter:,} tokens/iter, {world_size} process(es)")
    out.start(master, iter_num, args.max_iters, tokens_per_iter, args.quiet)
    best_weights = None  # every rank keeps its own copy (reading best.pt back would race rank 0's write)
    while iter_num < args.max_iters and not stopped_early(best['trail'], args.patience, args.min_rel_delta):
        lr = get_lr(iter_num, args.lr, args.min_lr, args.warmup_iters, args.lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        train_loss = train_step(model, scaler, data['train'], V, args, iter_num, device, ctx, rank,
                                world_size)
        scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf).item()
        if not math.isfinite(grad_norm) and not scaler.is_enabled():  # fp16's scaler skips such steps itself
            raise out.diverged(iter_num, grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        out.bar.update()

        if iter_num % args.log_interval == 0 or iter_num == args.max_iters:
            loss = all_reduce(torch.tensor(train_loss, dtype=torch.float64), device, world_size) / world_size
            out.log_train(dict(iter=iter_num, loss=loss.item(), lr=lr, grad_norm=grad_norm))
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            select_loss = evaluate(model, data['select'], 'select', select_offsets, args, V, device, ctx,
                                   rank, world_size)
            improved = select_loss < best['loss']  # the same on every rank: the loss is all-reduced
            if improved:
                best.update(loss=select_loss, iter=iter_num)
                best_weights = {k: v.detach().clone() for k, v in weights_of(raw_model, residual_of).items()}
            best['trail'].append(best['loss'])
            out.log_eval(dict(iter=iter_num, tokens=iter_num * tokens_per_iter, select_loss=select_loss),
                         f"iter {iter_num}: select loss {select_loss:.4f}" + (' (best)' if improved else ''))
            if master:
                snapshot = [f'iter_{iter_num}.pt'] if iter_num in args.snapshots else []
                out.save(checkpoint(raw_model, args, meta, iter_num, best, residual_of), optimizer, scaler,
                         improved, snapshot)

    results = dict(params=raw_model.num_params(), iters=iter_num, **out.timing(iter_num), dtype=args.dtype,
                   select_on=args.select_on, best_select_loss=best['loss'], best_iter=best['iter'],
                   last_iter=iter_num, patience=args.patience,  # patience 0: a fixed budget, no rule
                   converged=stopped_early(best['trail'], args.patience, args.min_rel_delta),
                   tokens_per_iter=tokens_per_iter, curve=out.learning_curve() if master else [])
    if args.final_eval:  # val and test of the best weights, the ones every later stage uses
        load_best(raw_model, best_weights, args.out_dir, residual_of)
        results.update(final_evaluation(model, data, args, V, device, ctx, rank, world_size))
    out.close(results)
    if master:
        report(results, args, raw_model, data['val'], meta, device)
    teardown_distributed()
    return results


def load_best(raw_model, best_weights, out_dir, residual_of):
    """The weights of the lowest selection loss into raw_model: this run's copy, or best.pt when the
    best came before a --resume (best_weights None); a RALM's are its residual's only."""
    best_weights = best_weights or load_checkpoint(os.path.join(out_dir, 'best.pt'))['model']
    raw_model.load_state_dict(best_weights, strict=not residual_of)


def fixed_select_offsets(data, args):
    """The selection-split windows every periodic evaluation uses (the same each time): random windows,
    or with --select_on continuation evenly spaced problems, as many tokens in all."""
    if args.select_layout:
        P, L = args.select_layout
        n = args.eval_iters * args.batch_size * (args.block_size // (P + L))
        return torch.from_numpy(windows(data, P, L, max_windows=n))
    n = args.eval_iters * args.batch_size
    return batch_offsets(len(data), args.block_size, n, args.seed, 'select', 0)


def train_step(model, scaler, train, V, args, iter_num, device, ctx, rank, world_size):
    """Forward and backward of this process's micro-batches of step iter_num: batches, masks and
    dropout draws are a function of the seed and the micro-batch, so that --resume (on any device)
    and DDP see what one uninterrupted process sees; returns their mean loss."""
    B = args.batch_size
    n_micro = args.grad_accum // world_size  # this process's micro-batches
    offsets = batch_offsets(len(train), args.block_size, B * args.grad_accum, args.seed, 'train', iter_num)
    train_loss = 0.0
    for m in range(rank, args.grad_accum, world_size):
        micro = iter_num * args.grad_accum + m
        mask_rng = torch.Generator().manual_seed(rng_seed(args.seed, 'mlm_mask', 'train', micro))
        torch.manual_seed(rng_seed(args.seed, 'dropout', 'train', micro))
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
# what is kept

def checkpoint(raw_model, args, meta, iter_num, best, residual_of):
    """What best.pt holds, and ckpt.pt with the optimizer's and scaler's states (RunDir.save)."""
    return dict(kind='mlm' if args.objective == 'mlm' else 'lm', objective=args.objective, gamma=args.gamma,
                model=weights_of(raw_model, residual_of), residual_of=residual_of,
                config=asdict(raw_model.config), args=vars(args), iter_num=iter_num, best=best,
                meta=dict(meta, data_dir=args.data_dir))


def weights_of(raw_model, residual_of):
    """What a checkpoint keeps: the weights, or a RALM's residual only (its base is frozen)."""
    return raw_model.residual_state_dict() if residual_of else raw_model.state_dict()


def report(results, args, model, val_data, meta, device):
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


if __name__ == '__main__':
    run_trainer(main, get_args)

"""
Conditional NCE training of the residual energy (Section 3.1, Eq. 3). For a prefix of the
training split, the positive x+ is its real continuation and the negative x- one of its K stored
LM samples (negatives.py), drawn uniformly each time. Because the noise distribution is P_LM and
the model is P_LM exp(-E), the NCE classifier's logit log P_joint - log P_LM reduces to -E:

    ranking (default): loss = -log softmax(-E(x+), -E(x-_1), ..., -E(x-_M))[0]   (M negatives)
    binary (Eq. 3):    loss = softplus(E(x+)) + softplus(-E(x-))

The ranking form uses every stored sample of a prefix at once. Where the LM is often right, most
samples equal the real continuation: such a tie carries no gradient in the ranking loss (its two
logits cancel), while the binary loss spends a step pushing the same sequence both ways. Identical
sequences of a batch are scored once (nce_batch): the same loss, at the cost of the distinct ones.

best.pt and early stopping follow what the energy is for (--select gain): the joint model's
log-likelihood of the held-out prefixes' real continuations, relative to the LM's,
-E(x+) - log Z (Eq. 2), with log Z from their K stored samples at Eq. 4's conservative end. The
NCE loss, which ties dominate, is reported beside it.

With truncated negatives (negatives.py --top_k/--top_p/--temperature) the noise is the proposal
q, not P_LM, and the logit is -E + log P_LM - log q: the stored log-probs of every negative and
of every real continuation under both give that correction, applied automatically.

    python nce_train.py --lm out/lm/best.pt --negatives out/neg_train --held_out_negatives out/neg_select \\
        --body bit --out_dir out/bit                                     # CPU or one GPU
    torchrun --standalone --nproc_per_node 8 nce_train.py ...            # DDP

Batches are a function of (seed, iteration), so --resume is exact and DDP sees the same global
batch as one process with the same --grad_accum (default: one micro-batch per process). Writes
out_dir/ckpt.pt (the latest state, for --resume), best.pt (the energy at its best held-out figure:
the one to use, since NCE on a finite set of negatives overfits), log.jsonl and results.json;
checkpoints are written atomically.
"""

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import load_meta, load_negatives, load_split, negatives_hash, untruncated, window_tokens
from energy import (POOLS, build_energy, energy_state, load_energy, logz_bounds, logz_diagnostics,
                    logz_enumerate)
from model import configure_optimizer, get_lr, load_checkpoint, stopped_early
from plumbing import (RunDir, all_reduce, file_hash, guards, one_job, precision, rng_seed, run_trainer, setup,
                      teardown_distributed, training_parser)


def get_args(argv=None):
    p = training_parser(__doc__, 'out/energy', max_iters=1000, lr=3e-4, min_lr=3e-5, warmup_iters=50,
                        eval_interval=100)
    a = p.add_argument
    a('--lm', default='out/lm/best.pt', help='the base LM the energy is the residual of')
    a('--negatives', required=True, help='negatives.py output for the train split')
    a('--held_out_negatives', required=True,
      help="negatives.py output for held-out prefixes, which choose best.pt (--select): the selection split "
           "('select', carved from the training documents), so that val and test are only reported")
    a('--body', dest='energy', default='bit', choices=['bit', 'unit'],
      help="the energy's body: bidirectional (BIT) or LM-initialised causal (UNIT)")
    a('--init_from', default=None,
      help='bit: an MLM checkpoint (train_lm.py --objective mlm); unit: an LM (default --lm)')
    a('--pool', default='continuation', choices=POOLS, help='mean-pool hidden states over these positions')
    a('--context', type=int, default=None, at_least=0, at_most='tokens',
      help='the energy sees only the last N prefix tokens (default: all)')
    a('--n_layer', type=int, default=None, at_least=1, at_most='tokens',
      help='BIT from scratch: layers (default: the LM\'s)')
    a('--n_head', type=int, default=None, at_least=1, at_most='tokens',
      help="BIT from scratch: heads (default: the LM's)")
    a('--n_embd', type=int, default=None, at_least=1, at_most='tokens',
      help="BIT from scratch: width (default: the LM's)")
    a('--dropout', type=float, default=None, at_least=0, below=1,
      help="the body's dropout (default: that of --init_from's model; 0 from scratch)")
    a('--loss', default='ranking', choices=['binary', 'ranking'],
      help='ranking: cross-entropy over [x+, all M negatives] (no gradient from a negative equal to x+); '
           'binary: Eq. 3, one negative per positive')
    a('--num_neg', type=int, default=None, at_least=1, at_most='samples',
      help='ranking: negatives per positive (default: all K stored)')
    a('--select', default='gain', choices=['gain', 'gain_enumerated', 'loss'],
      help="what chooses best.pt and early stopping on the held-out prefixes: gain, the joint model's "
           "log-likelihood of their real continuations over the LM's (Eq. 2, log Z at Eq. 4's upper end); "
           "gain_enumerated, the same with log Z from energy.logz_enumerate (untruncated negatives: where "
           "samples repeat, as on addition, Eq. 4 fails); loss, the NCE loss")
    a('--eval_prefixes', type=int, default=256, at_least=1, at_most='count',
      help='held-out prefixes (fixed negatives each) per evaluation')
    return p.parse_args(argv)


def nce_loss(e_pos, e_neg, kind='binary', d_pos=None, d_neg=None):
    """e_pos (B,), e_neg (B, M) energies. Returns (loss, accuracy = fraction of pairs whose
    positive has the larger logit; without d: E(x+) < E(x-)). The NCE logit of x is
    log P_joint(x) - log q(x) = -E(x) + d(x), d = log P_LM(x) - log q(x) for noise q: with q = P_LM
    (untruncated negatives) d = 0 and P_LM cancels, leaving -E (Eq. 3; None is that case, exactly).
    With top-k/top-p/temperature negatives, d_pos (B,) and d_neg (B, M) are the stored log-ratios
    (negatives.py). A real continuation that q cannot propose has d = +inf: it is data with
    certainty, its loss term is 0 and it carries no gradient (no inf - inf anywhere)."""
    s_pos = -e_pos if d_pos is None else d_pos - e_pos  # (B,) logits of the real continuations
    s_neg = -e_neg if d_neg is None else d_neg - e_neg  # (B, M) logits of the negatives
    if kind == 'binary':  # Eq. 3, averaged over the M negatives of each positive
        loss = F.softplus(-s_pos) + F.softplus(s_neg).mean(1)  # (B,)
    elif kind == 'ranking':  # -log softmax(s_pos, s_neg_1..M)[0] = log(1 + sum_j exp(s_neg_j - s_pos))
        loss = torch.logsumexp(F.pad(s_neg - s_pos[:, None], (1, 0)), 1)
    else:
        raise ValueError(f"unknown NCE loss '{kind}': use 'binary' or 'ranking'")
    return loss.mean(), (s_pos[:, None] > s_neg).float().mean()


# -----------------------------------------------------------------------------
# the pairs: which prefixes and negatives a batch holds, and nce_loss's d

def log_ratios(neg, rows, neg_idx, device='cpu'):
    """nce_loss's d = log P_LM - log q of the real continuations of prefixes `rows` (B,) and of
    their negatives neg_idx (B, M), as float32 tensors; (None, None) for untruncated negatives.
    d_pos is +inf where the real continuation lies outside q's support."""
    if untruncated(neg['meta']):
        return None, None
    d_pos = neg['pos_logp'][rows] - neg['pos_logq'][rows]  # (B,)
    d_neg = neg['logp'][rows[:, None], neg_idx] - neg['logq'][rows[:, None], neg_idx]  # (B, M)
    return torch.from_numpy(d_pos).to(device), torch.from_numpy(d_neg).to(device)


def nce_batch(data, neg, rows, neg_idx, device):
    """The distinct sequences of a batch and where each pair's sequences are among them: tokens
    (U, P+L) of the B positives and their M negatives (prefix + sample), each distinct sequence
    once, and pos (B,), negs (B, M) indices into them. Most LM samples of an easy prefix are the
    real continuation itself, or one another: scored once and gathered back (e[pos], e[negs]),
    the loss and its gradient are exactly those of scoring every copy, at the cost of the
    distinct ones (on addition, ~2 of 17 sequences per prefix)."""
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    pos = window_tokens(data, neg['offsets'][rows], P + L).numpy()  # (B, P+L) the real text
    samples = neg['tokens'][rows[:, None], neg_idx].astype(np.int64)  # (B, M, L)
    prefix = np.broadcast_to(pos[:, None, :P], samples.shape[:2] + (P,))  # (B, M, P)
    seqs = np.concatenate([pos, np.concatenate([prefix, samples], 2).reshape(-1, P + L)])  # (B(1+M), P+L)
    uniq, inverse = np.unique(seqs, axis=0, return_inverse=True)
    inverse = torch.from_numpy(inverse.reshape(-1)).to(device)
    B = len(rows)
    return torch.from_numpy(uniq).to(device), inverse[:B], inverse[B:].view(B, -1)


def untied_rows(data, neg, chunk=65536):
    """The training prefixes (indices) with at least one stored sample unlike their real
    continuation. In the ranking loss a prefix whose samples all equal x+ has a constant loss,
    log(1 + M), and no gradient: drawing only the others gives the same gradient direction with
    every row of a batch informative (on addition a third of the prefixes are such ties)."""
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    keep = []
    for s in range(0, len(neg['offsets']), chunk):
        real = window_tokens(data, neg['offsets'][s:s + chunk], P + L)[:, P:].numpy()  # (c, L)
        keep.append(s + np.flatnonzero((neg['tokens'][s:s + chunk] != real[:, None]).any(-1).any(-1)))
    return np.concatenate(keep)


def training_pool(train, neg, loss, path):
    """The training prefixes batches are drawn from: untied_rows for the ranking loss, all for binary
    (path: where the negatives neg came from)."""
    if loss == 'binary':
        return np.arange(len(neg['offsets']))
    pool = untied_rows(train, neg)
    guards.check_untied(pool, path)
    return pool


def choose(n_rows, K, B, M, seed, split, it):
    """Rows of batch `it` and M distinct negatives of each, uniformly: a function of (seed, split, it)."""
    g = torch.Generator().manual_seed(rng_seed(seed, 'nce_pairs', split, it))
    rows = torch.randint(n_rows, (B,), generator=g).numpy()  # (B,) prefixes, with replacement
    neg_idx = torch.rand(B, K, generator=g).argsort(1)[:, :M].numpy()  # (B, M) of the K stored
    return rows, neg_idx


# -----------------------------------------------------------------------------
# the held-out figures that choose best.pt

def held_out_pairs(held_neg, M, eval_prefixes, seed):
    """The fixed held-out pairs that choose best.pt: the first eval_prefixes prefixes of the
    selection split, M of their stored negatives each (rows (N,), negative indices (N, M))."""
    n = min(eval_prefixes, len(held_neg['offsets']))
    return np.arange(n), choose(n, held_neg['meta']['num_samples'], n, M, seed, 'held_out', 0)[1]


def enumerated_logz(neg, rows, pos, negs, e_pos, e_all):
    """log Z of each held-out prefix by energy.logz_enumerate: its real continuation known, its K
    stored (untruncated) samples scored exactly where they repeat. pos (b, P+L) and negs (b, K, P+L)
    are the sequences, e_pos (b,) and e_all (b, K) their energies."""
    P = neg['meta']['prefix_len']
    x = torch.cat([pos[:, None, P:], negs[..., P:]], 1)  # (b, 1 + K, L)
    log_p = torch.from_numpy(np.concatenate([neg['pos_logp'][rows][:, None], neg['logp'][rows]], 1))
    log_w = -torch.cat([e_pos[:, None], e_all], 1).double()
    return logz_enumerate(x, log_p.to(x.device), log_w, known=1)


# evaluate's figures, each a mean over the held-out prefixes (held_out_<name> in log.jsonl, results.json)
FIGURES = ('loss', 'acc', 'e_pos', 'e_neg', 'gain', 'gain_high', 'gain_enumerated', 'ess', 'flagged')


def held_out_sums(model, data, neg, rows, neg_idx, loss, device, ctx):
    """Each of FIGURES summed over the held-out prefixes `rows` (b,), neg_idx (b, M) their negatives:
    the NCE loss and accuracy of the pairs, E(x+), the mean E of all K stored samples, the joint
    gain over the LM -E(x+) - log Z (Eq. 2) per token, with log Z from the K samples at Eq. 4's
    upper end (gain), at T_n (gain_high) and by logz_enumerate (gain_enumerated), and
    logz_diagnostics' ESS and flag of those samples."""
    P, L, K = neg['meta']['prefix_len'], neg['meta']['gen_len'], neg['meta']['num_samples']
    every = np.broadcast_to(np.arange(K), (len(rows), K))  # all K samples of each prefix: log Z
    tokens, pos, negs = nce_batch(data, neg, rows, every, device)
    with ctx:
        e = model(tokens, P).float()
    e_pos, e_all = e[pos], e[negs]  # (b,), (b, K)
    l, acc = nce_loss(e_pos, e_all.gather(1, torch.from_numpy(neg_idx).to(device)), loss,
                      *log_ratios(neg, rows, neg_idx, device))
    d_all = log_ratios(neg, rows, every, device)[1]
    log_w = -e_all if d_all is None else d_all - e_all  # truncated negatives: weighted by P_LM / q
    z_low, z_high = logz_bounds(log_w)
    enum = enumerated_logz(neg, rows, tokens[pos], tokens[negs], e_pos, e_all) if d_all is None else None
    z_enum = z_low if enum is None else enum['estimate']  # truncated negatives: not P_LM's samples
    diag = logz_diagnostics(log_w, None if enum is None else enum['sure'])
    gain = lambda logz: ((-e_pos.double() - logz) / L).sum().item()
    return dict(loss=l.item() * len(rows), acc=acc.item() * len(rows), e_pos=e_pos.sum().item(),
                e_neg=e_all.mean(1).sum().item(), gain=gain(z_high), gain_high=gain(z_low),
                gain_enumerated=gain(z_enum), ess=diag['ess'].sum().item(),
                flagged=diag['flagged'].sum().item())


@torch.no_grad()
def evaluate(model, data, neg, rows, neg_idx, batch_size, loss, device, ctx, rank=0, world_size=1):
    """FIGURES on fixed held-out prefixes, sharded over ranks and reduced: {held_out_<name>: the
    mean over the prefixes}. The gain, log P_joint(x+) - log P_LM(x+) = -E(x+) - log Z (Eq. 2), is
    the joint log-likelihood of real text relative to the LM's: what the energy is for, and what
    --select gain chooses best.pt by; at Eq. 4's upper end of log Z it is the conservative gain
    Table 1 reports, at T_n (held_out_gain_high) the optimistic one."""
    model.eval()
    sums = torch.zeros(len(FIGURES) + 1, dtype=torch.float64)  # each figure's sum, then the prefix count
    starts = list(range(0, len(rows), batch_size))
    for s in starts[rank::world_size]:
        r, j = rows[s:s + batch_size], neg_idx[s:s + batch_size]
        batch = held_out_sums(model, data, neg, r, j, loss, device, ctx)
        sums += torch.tensor([batch[name] for name in FIGURES] + [len(r)], dtype=torch.float64)
    model.train()
    *totals, n = all_reduce(sums, device, world_size).tolist()
    return {f'held_out_{name}': total / n for name, total in zip(FIGURES, totals, strict=True)}


# -----------------------------------------------------------------------------
# what main loads and builds, and what it reports

def load_pairs(args):
    """The train and held-out negatives (checked to come from --lm and to agree, and the held-out
    ones not to be training prefixes: guards.check_pairs), and the splits their positives come from."""
    guards.check_nce_lm(load_checkpoint(args.lm), args.lm)  # first: it decides which error
    neg, held_neg = (load_negatives(args.negatives, lm_path=args.lm),
                     load_negatives(args.held_out_negatives, lm_path=args.lm))
    guards.check_pairs(args, neg['meta'], held_neg['meta'])
    data_dir = neg['meta']['data_dir']
    meta = load_meta(data_dir)
    data = {n['meta']['split']: load_split(data_dir, n['meta']['split'], meta) for n in (neg, held_neg)}
    return neg, held_neg, data, dict(meta, data_dir=data_dir)


def negatives_per_pair(loss, num_neg, neg, held_neg):
    """M: 1 for binary NCE, num_neg (None: all K) for ranking; held-out pairs need M too."""
    K, K_held = neg['meta']['num_samples'], held_neg['meta']['num_samples']
    M = 1 if loss == 'binary' else (num_neg or K)
    guards.check_num_neg(M, K, K_held)
    return M


def build(args, meta, length, rows, device):
    """The energy to train and, with --resume, the checkpoint it continues; it must see
    sequences of `length` tokens, `rows` of them per micro-batch."""
    if args.resume:
        model, ckpt = load_energy(os.path.join(args.out_dir, 'ckpt.pt'), args.lm)
        model.train()
        guards.check_energy_memory(model.config, rows, args.batch_size, device)
    else:  # before any weight is allocated
        guards.check_energy_memory(guards.planned_config(args), rows, args.batch_size, device)
        sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        model, ckpt = build_energy(args.energy, args.lm, meta, args.init_from, sizes, args.pool,
                                   context=args.context, dropout=args.dropout), None
    guards.check_energy_block(length, model.config.block_size)
    return model, ckpt


def report(results, out_dir):
    best_path = os.path.join(out_dir, 'best.pt')
    best = (f"best.pt from iter {results['best_iter']} (by held-out {results['select']}) -> {best_path}"
            if os.path.exists(best_path)
            else "the held-out figures were never finite (NaN): no best.pt was written")
    print(f"best.pt on {results['held_out_prefixes']} held-out prefixes: joint gain over the LM "
          f"{results['held_out_gain']:.5f} nats/token (Eq. 4's upper log Z; "
          f"{results['held_out_gain_high']:.5f} at T_n, {results['held_out_gain_enumerated']:.5f} with log Z "
          f"enumerated; Eq. 4 flagged on {100 * results['held_out_flagged']:.0f}% of prefixes, mean ESS "
          f"{results['held_out_ess']:.1f}), NCE loss {results['held_out_loss']:.4f}, "
          f"accuracy {results['held_out_acc']:.3f} "
          f"(last weights: gain {results['last_held_out_gain']:.5f}); {results['train_time_s']:.0f}s; {best}")


def selected(ev, select):
    """--select's figure of a held-out evaluation, lower is better: -gain, or the NCE loss."""
    return ev['held_out_loss'] if select == 'loss' else -ev[f"held_out_{select}"]


def input_hashes(args):
    """What a --resume must find unchanged: the negatives it trains and selects on, the weights it
    started from (ckpt.pt records them)."""
    started = {'init_from': file_hash(args.init_from)} if args.init_from else {}
    return dict(negatives=negatives_hash(args.negatives),
                held_out_negatives=negatives_hash(args.held_out_negatives), **started)


# -----------------------------------------------------------------------------
# the training loop: train_step, then main

def train_step(model, scaler, train, neg, pool, M, args, iter_num, device, ctx, rank, world_size):
    """Forward and backward of this process's micro-batches of step iter_num: B positives from the
    training prefixes `pool` and M negatives of each (nce_loss). Returns their mean (loss, acc, E+,
    E-). Rows and dropout draws are a function of (seed, micro-batch), as in train_lm.py."""
    B = args.batch_size
    rows, neg_idx = choose(len(pool), neg['meta']['num_samples'], B * args.grad_accum, M, args.seed, 'train',
                           iter_num)
    rows, n_micro = pool[rows], args.grad_accum // world_size  # n_micro: this process's micro-batches
    stats = np.zeros(4)
    for m in range(rank, args.grad_accum, world_size):
        r, j = rows[m * B:(m + 1) * B], neg_idx[m * B:(m + 1) * B]
        torch.manual_seed(rng_seed(args.seed, 'dropout', 'train', iter_num * args.grad_accum + m))
        if world_size > 1:  # all-reduce the gradients only on the last micro-batch
            model.require_backward_grad_sync = m + world_size >= args.grad_accum
        tokens, pos, negs = nce_batch(train, neg, r, j, device)
        with ctx:  # positives and their negatives in one forward, each distinct sequence once
            e = model(tokens, neg['meta']['prefix_len'])  # (U,)
        e_pos, e_neg = e[pos], e[negs]  # (B,), (B, M)
        loss, acc = nce_loss(e_pos, e_neg, args.loss, *log_ratios(neg, r, j, device))
        scaler.scale(loss / n_micro).backward()
        stats += [loss.item(), acc.item(), e_pos.mean().item(), e_neg.mean().item()]
    return stats / n_micro


@one_job  # --out_dir's lock released however main ends
def main(argv=None):
    args = guards.check_nce_flags(get_args(argv), argv, load_checkpoint, input_hashes)  # before any work
    out = RunDir(args)  # one job per folder; log.jsonl, results.json
    # DDP under torchrun (one process otherwise): each rank takes its share of every batch
    rank, world_size, device = setup(args.device, args.deterministic)
    master = rank == 0
    torch.manual_seed(rng_seed(args.seed, 'torch', '', rank))  # init (DDP then copies rank 0's)
    # autocast's precision from the hardware, decided once and saved with the flags (a --resume keeps it)
    args.dtype, ctx = precision(device, args.dtype, verbose=master)

    neg, held_neg, data, meta = load_pairs(args)
    P, L = neg['meta']['prefix_len'], neg['meta']['gen_len']
    M = negatives_per_pair(args.loss, args.num_neg, neg, held_neg)
    train, held_out = data[neg['meta']['split']], data[held_neg['meta']['split']]
    pool = training_pool(train, neg, args.loss, args.negatives)
    raw_model, ckpt = build(args, meta, P + L, args.batch_size * (1 + M), device)
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
    # value: --select's figure at best.pt (lower is better), eval: its evaluation; trail: the best value
    # after each evaluation (the stopping rule's)
    best = dict(value=math.inf, iter=0, eval={}, trail=[])
    if ckpt:
        best = dict(value=ckpt.get('best_value', ckpt.get('best_loss')), iter=ckpt['best_iter'],
                    eval=ckpt.get('best_eval', {}), trail=ckpt.get('best_trail', []))
    held_rows, held_negs = held_out_pairs(held_neg, M, args.eval_prefixes, args.seed)
    tokens_per_iter = args.batch_size * args.grad_accum * (1 + M) * (P + L)
    if master:
        print(f"{raw_model.kind.upper()} energy, {raw_model.num_params() / 1e6:.2f}M parameters, "
              f"{args.loss} NCE with {M} negative(s), {len(pool)} of {len(neg['offsets'])} train prefixes "
              f"(those with a gradient) x {neg['meta']['num_samples']} samples, {world_size} process(es)")
    out.start(master, iter_num, args.max_iters, tokens_per_iter, args.quiet)
    last_eval = {}
    while iter_num < args.max_iters and not stopped_early(best['trail'], args.patience, args.min_rel_delta):
        lr = get_lr(iter_num, args.lr, args.min_lr, args.warmup_iters, args.lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        stats = train_step(model, scaler, train, neg, pool, M, args, iter_num, device, ctx, rank, world_size)
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
            stats = all_reduce(torch.tensor(stats, dtype=torch.float64), device, world_size) / world_size
            out.log_train(dict(zip(('loss', 'acc', 'e_pos', 'e_neg'), stats.tolist()), iter=iter_num, lr=lr,
                               grad_norm=grad_norm))
        if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
            last_eval = evaluate(model, held_out, held_neg, held_rows, held_negs, args.batch_size, args.loss,
                                 device, ctx, rank, world_size)
            value = selected(last_eval, args.select)
            improved = value < best['value']  # the same on every rank: the figures are all-reduced
            if improved:
                best.update(value=value, iter=iter_num, eval=last_eval)
            best['trail'].append(best['value'])
            out.log_eval(dict(iter=iter_num, **last_eval),
                         f"iter {iter_num}: held-out gain {last_eval['held_out_gain']:.5f} nats/token, "
                         f"NCE loss {last_eval['held_out_loss']:.4f}, acc {last_eval['held_out_acc']:.3f}"
                         + (' (best)' if improved else ''))
            if master:
                state = dict(energy_state(raw_model, args.lm, meta), args=vars(args), iter_num=iter_num,
                             best_value=best['value'], best_iter=best['iter'], best_eval=best['eval'],
                             best_trail=best['trail'], negatives=args.negatives)
                out.save(state, optimizer, scaler, improved)

    if not last_eval:  # resumed at max_iters: nothing was evaluated in this run
        last_eval = evaluate(model, held_out, held_neg, held_rows, held_negs, args.batch_size, args.loss,
                             device, ctx, rank, world_size)
    results = dict(energy=raw_model.kind, params=raw_model.num_params(), iters=iter_num,
                   **out.timing(iter_num), dtype=args.dtype, select=args.select, best_value=best['value'],
                   best_iter=best['iter'], held_out_prefixes=len(held_rows),
                   stopped_early=stopped_early(best['trail'], args.patience, args.min_rel_delta),
                   **{f'last_{k}': v for k, v in last_eval.items()},  # the last weights'
                   **best['eval'] or {k: math.nan for k in last_eval})  # the kept energy's (best.pt)
    out.close(results)
    if master:
        report(results, args.out_dir)
    teardown_distributed()
    return results


if __name__ == '__main__':
    run_trainer(main, get_args)

"""The timing tools every section of job/bench.py shares: a median of alternating timed runs, the
char GPT's config from the bench's flags, training and forward FLOPs for MFU, the trainers' AdamW, the
process's peak memory."""

import dataclasses
import resource
import statistics
import sys
import time

import torch

from model import GPTConfig, configure_optimizer


def log(args, msg):
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)


def timeit(fns, device, warmup, repeats, stat=statistics.median):
    """Wall time in seconds (the median of the repeats) of each function of the dict fns. The
    timed runs of the functions alternate, so that a load change on a shared machine hits all
    of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def lm_config(args, meta):
    return GPTConfig(block_size=args.block_size, vocab_size=meta['vocab_size'], n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


def flops_per_token(config, num_params):
    """Training FLOPs per token (forward + backward): 6N for the weights plus attention's
    12 * L * T * C (PaLM appendix B), as in nanoGPT's MFU estimate."""
    return 6 * num_params + 12 * config.n_layer * config.block_size * config.n_embd


def adamw(model, lr, device):
    """The trainers' optimizer (model.configure_optimizer at their weight decay 0.1 and betas (0.9, 0.99)):
    weight decay on matrices only, fused on CUDA."""
    return configure_optimizer(model, lr, 0.1, (0.9, 0.99), device)


def forward_flops_per_token(config, num_params, context):
    """Forward FLOPs per token: a third of flops_per_token's (forward + backward), attention over
    `context` positions."""
    return flops_per_token(dataclasses.replace(config, block_size=context), num_params) / 3


def peak_rss_mb():
    """High-water mark of this process's resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

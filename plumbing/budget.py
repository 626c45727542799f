"""
Budgets: a run's memory and time, estimated from its sizes and checked before any work, so that a
size that cannot fit, or would run for hours unasked, stops with one `error:` line (the memory and
time checks of bad input).
"""

import os
import sys
import resource

import torch


def available_memory(device='cpu'):
    """Bytes free for new arrays now: a CUDA GPU's free memory, Linux's MemAvailable on the CPU
    (or what `ulimit -v` leaves this process, if less); None where it cannot be read (other
    systems, Apple's MPS)."""
    if device.startswith('cuda'):  # under torchrun, the rank's own GPU (before DDP setup picks it)
        return torch.cuda.mem_get_info(device if ':' in device else int(os.environ.get('LOCAL_RANK', 0)))[0]
    if device != 'cpu':
        return None
    known = [n for n in (proc_kib('/proc/meminfo', 'MemAvailable:'), address_space_left()) if n is not None]
    return min(known) if known else None


def proc_kib(path, key):
    """The bytes of a `key: N kB` line of a /proc file (None where there is none)."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration, ValueError):
        return None


def address_space_left():
    """Bytes of address space `ulimit -v` (RLIMIT_AS) leaves this process: its limit less what the
    process maps already (None: no limit, or unreadable). An allocation beyond it fails however
    much memory the machine has free."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    mapped = proc_kib('/proc/self/status', 'VmSize:')
    if limit == resource.RLIM_INFINITY or mapped is None:
        return None
    return max(0, limit - mapped)


# the share of the available memory a run may plan to fill: the rest is room for the rest of the
# machine and for what the estimates miss (a run estimated at 21 GiB of 22.4 available died)
MEMORY_SHARE = 0.8


def check_memory(nbytes, what, fix, device='cpu'):
    """Refuses work whose arrays alone need more than MEMORY_SHARE of the memory the device has
    available now: one line with the numbers and the fix (nothing checked where
    available_memory cannot tell)."""
    avail = available_memory(device)
    if avail is not None and nbytes > MEMORY_SHARE * avail:
        left = address_space_left() if device == 'cpu' else None
        under_ulimit = left is not None and left < avail + 2**20
        where = f' on {device}' if device != 'cpu' else ' under ulimit -v' if under_ulimit else ''
        raise ValueError(f"{what} needs ~{nbytes / 2**30:,.1f} GiB of memory, more than the "
                         f"{MEMORY_SHARE * avail / 2**30:.1f} GiB it may use ({MEMORY_SHARE:.0%} of the "
                         f"{avail / 2**30:.1f} GiB available{where}): {fix}")


def check_training_memory(config, rows, device, what,
                          fix="lower --batch_size (--grad_accum keeps the batch)"):
    """Refuses a training step of `rows` sequences that could not fit (training_memory)."""
    check_memory(training_memory(config, rows, device), what, fix, device)


def training_memory(config, batch_size, device='cpu'):
    """Bytes a training step of a GPT-shaped model holds at least: weights, gradients and AdamW's
    two moments (16 per parameter, fp32), and what autograd keeps: ~16 (B, T, C) tensors and the
    attention weights (B, nh, T, T) per layer, and the logits (B, T, V) twice, in fp32 on a CPU and
    at 2 bytes on a GPU (its autocast, bf16 or fp16: a lower bound in fp32 too); and the batch's
    int64 tokens and targets. Measured (train_lm.py, CPU, fp32, one step and one evaluation: peak
    RSS above that of a 1-sequence run): 0.99x this for 2 layers 32 wide, block 16, B 20k-60k (the
    narrow model the probe ran out of memory with), 0.6-0.8x for 2-8 layers 64-256 wide, block
    128-256, B 64-512. What it misses is left to check_memory's MEMORY_SHARE."""
    c, B = config, batch_size
    params = 12 * c.n_layer * c.n_embd ** 2 + (c.vocab_size + c.block_size) * c.n_embd
    acts = (c.n_layer * B * c.block_size * (16 * c.n_embd + 2 * c.n_head * c.block_size)
            + 2 * B * c.block_size * c.vocab_size)
    return 16 * params + (2 if device.startswith('cuda') else 4) * acts + 16 * B * (c.block_size + 1)


# -----------------------------------------------------------------------------
# time: a size that makes a run of hours is said before the work, and beyond TIME_LIMIT_S needs --force

TIME_LIMIT_S = 3600
# forward FLOP/s (2 x parameters per token), crude: this 2-core CPU in fp32 beside a busy process
# sampled from a KV cache at 1-17 GFLOP/s and scored whole sequences at 8-43 GFLOP/s (2-6 layers,
# 32-384 wide, 512 rows per call; the narrow models slowest); a GPU is taken as 100x faster
SAMPLE_FLOPS, SCORE_FLOPS, GPU_SPEEDUP = 5e9, 3e10, 100


def forward_seconds(sampled, scored, device='cpu'):
    """A crude estimate (within a few x) of the seconds that `sampled` FLOPs of token-by-token
    sampling and `scored` FLOPs of scoring whole sequences take on device."""
    seconds = sampled / SAMPLE_FLOPS + scored / SCORE_FLOPS
    return seconds / GPU_SPEEDUP if device.startswith('cuda') else seconds


def check_time(seconds, what, force):
    """Says the estimate of work of a minute or more before it starts; beyond TIME_LIMIT_S only
    with --force (a mistyped size must not run for days unasked)."""
    if seconds > TIME_LIMIT_S and not force:
        raise ValueError(f"{what} would take ~{duration(seconds)} by a crude estimate, beyond the "
                         f"{duration(TIME_LIMIT_S)} that runs unasked: lower it, or pass --force to run it")
    if seconds >= 60:
        print(f"{what}: ~{duration(seconds)} by a crude estimate", file=sys.stderr, flush=True)


def duration(seconds):
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.0f} days"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"

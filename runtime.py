"""
What every script needs around the method, in one place: the device, the precision (chosen by
measuring this machine), DDP from torchrun's environment, random streams, the optimizer and its
schedule, progress bars, and the one-line error exit. Nothing here is specific to the paper.
"""

import json
import math
import os
import sys
import time
import zlib
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')

# -----------------------------------------------------------------------------
# device and precision


def pick_device(device='auto'):
    """'auto': CUDA, else Apple's MPS (untested here: no Mac), else the CPU."""
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        return 'mps' if torch.backends.mps.is_available() else 'cpu'
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA GPU that torch {torch.__version__} can use: "
                         f"pass --device cpu (or auto)")
    if device == 'mps' and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available here: pass --device cpu (or auto)")
    if not (device in ('cpu', 'mps') or device.startswith('cuda')):
        raise ValueError(f"--device {device}: use auto, cpu, cuda, cuda:N or mps")
    return device


def choose_dtype(device, dtype='auto', work='train', probe=None):
    """The autocast dtype for one kind of work ('train', 'sample', 'score'), and why.
    CUDA: bf16 from compute capability 8.0 (Ampere) on; before that fp16 with a GradScaler
    (torch.cuda.is_bf16_supported() says True on a V100, which only emulates bf16). CPU: bf16
    only where it measures faster than fp32 for this work (`probe`, a function timed under
    both; default a matmul): with AVX512-BF16 or AMX it is 2-4x faster for training, without
    them ~100x slower, and small decode steps can lose even with them."""
    if dtype != 'auto':
        return dtype, 'asked for'
    if device.startswith('cuda'):
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return 'bfloat16', f'compute capability {major}.{minor} has bf16 units'
        return 'float16', f'compute capability {major}.{minor} has no bf16 units: fp16 with GradScaler'
    if device != 'cpu':
        return 'float32', f'{device}: fp32 (autocast not measured there)'
    ratio = bf16_speedup(matmul_probe, 'matmul')
    if ratio >= 0.5 and probe is not None:  # bf16 is not emulated: measure the work itself
        ratio = bf16_speedup(probe, work)
    why = f'bf16 measured {ratio:.2f}x fp32 for {work} on this CPU ({torch.backends.cpu.get_cpu_capability()})'
    return ('bfloat16' if ratio >= 1.2 else 'float32'), why


_PROBE, _SPEEDUP = {}, {}


def matmul_probe():
    """A training-sized matmul, forward and backward (~50 ms where bf16 is emulated)."""
    if not _PROBE:
        _PROBE.update(x=torch.randn(512, 256), w=torch.randn(512, 256, requires_grad=True))
    torch.nn.functional.linear(_PROBE['x'], _PROBE['w']).sum().backward()


def bf16_speedup(probe, work, repeats=7):
    """fp32 time / bf16-autocast time of probe() (the fastest of the repeats, fp32 and bf16 runs
    alternating so that load from other processes hits both alike), measured once per process
    for each kind of work."""
    if work not in _SPEEDUP:
        times = {torch.float32: [], torch.bfloat16: []}
        for i in range(repeats + 1):
            for dtype, ts in times.items():
                with autocast('cpu', dtype):
                    t0 = time.perf_counter()
                    probe()
                    if i:  # the first run of each warms up
                        ts.append(time.perf_counter() - t0)
        _SPEEDUP[work] = min(times[torch.float32]) / min(times[torch.bfloat16])
    return _SPEEDUP[work]


def autocast(device, dtype):
    """The autocast context of a dtype name or torch dtype (nothing for fp32)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.split(':')[0], dtype=dtype)


def sampling_probe(lm, device):
    """A few decode steps of lm, the work sampling spends its time on."""
    n = max(1, min(16, lm.config.block_size // 2))
    x = torch.zeros(2, n, dtype=torch.long, device=device)
    return lambda: lm.generate(x, n // 2 + 1, num_samples=16)


def scoring_probe(energy, device, length):
    """One small batch of energies, the work scoring spends its time on."""
    length = min(length, energy.config.block_size)
    x = torch.zeros(4, length, dtype=torch.long, device=device)

    @torch.no_grad()
    def probe():
        energy(x, length // 2)
    return probe


def precision(device, dtype, work='train', probe=None, verbose=True):
    """(dtype, autocast context) for this work; prints the choice and why."""
    dtype, why = choose_dtype(device, dtype, work, probe)
    if verbose:
        print(f"{work}: {device}, {dtype} ({why})", flush=True)
    return dtype, autocast(device, dtype)


def setup(device):
    """(rank, world_size, device): the device picked, and DDP set up under torchrun."""
    return setup_distributed(pick_device(device))


# -----------------------------------------------------------------------------
# DDP

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


def all_mean(values, world_size):
    """Average a list of floats over processes (identity for one process)."""
    t = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t)
        t /= world_size
    return t.tolist()


# -----------------------------------------------------------------------------
# random streams: one rule for every seed in rebm

def rng_seed(seed, purpose, split='', index=0):
    """The seed of one random stream, distinct for each (seed, purpose, split, index). Never
    do arithmetic on seeds instead: two sample sets drawn from one random stream are near copies
    of each other even for different prefixes (the same uniforms pick the same characters once
    contexts agree), which once made the val negatives twins of the train ones."""
    key = [seed % 2**32, zlib.crc32(purpose.encode()), zlib.crc32(split.encode()), index]
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def rng(seed, purpose, split='', index=0, device='cpu'):
    return torch.Generator(device).manual_seed(rng_seed(seed, purpose, split, index))


# -----------------------------------------------------------------------------
# optimisation

def configure_optimizer(model, lr, weight_decay, betas, device):
    """AdamW; weight decay on matrices only (not on biases, LayerNorms), fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.startswith('cuda'))


def prepare_training(raw_model, ckpt, args, device, dtype, world_size):
    """The optimizer, the GradScaler (active for fp16 only) and the model to call (compiled,
    wrapped in DDP); with a checkpoint, optimizer, scaler and RNG continue where it stopped."""
    raw_model.to(device)
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay, (args.beta1, args.beta2), device)
    scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
    if ckpt:
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        torch.set_rng_state(ckpt['rng_state'])  # dropout draws continue too
    model = torch.compile(raw_model) if args.compile else raw_model
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[int(device.split(':')[1])] if device.startswith('cuda') else None)
    return model, optimizer, scaler


def optimizer_step(model, optimizer, scaler, grad_clip):
    """Clip the (unscaled) gradients, step, clear them; returns the gradient norm before clipping."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf')).item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def get_lr(it, args):
    """Linear warmup, then cosine decay from lr to min_lr at lr_decay_iters."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


# -----------------------------------------------------------------------------
# user interface

def progress(iterable=None, quiet=False, **kw):
    return tqdm(iterable, disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True, **kw)


def write_log(log, rec):
    """One JSON line of a log.jsonl (None: not rank 0, which alone writes the log)."""
    if log is not None:
        log.write(json.dumps(rec) + '\n')
        log.flush()


def run_main(main):
    """A script's entry point: bad input exits with one `error:` line, not a traceback."""
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")

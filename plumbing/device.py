"""
Device, precision, DDP and seeds, the threads' wait policy of a run on a shared machine, and where
freed memory goes.
"""

import ctypes
import os
import re
import shutil
import sys
import time
import zlib
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')

# -----------------------------------------------------------------------------
# threads on a shared machine: OpenMP reads its wait policy once, as torch loads it


def cores_in_use(seconds=0.1, stat='/proc/stat'):
    """How many cores other processes kept busy over the next `seconds` (Linux's /proc/stat; None
    elsewhere). This process's own threads (numpy's, spinning just after it loads) do not count."""
    def ticks():
        with open(stat) as f:
            times = [int(t) for t in f.readline().split()[1:9]]
        return sum(times), times[3] + times[4]  # all, idle + iowait
    try:
        total0, idle0 = ticks()
        own0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        total1, idle1 = ticks()
        own = (time.process_time() - own0) / (time.perf_counter() - wall0)  # cores this process used
    except (OSError, ValueError, IndexError):
        return None
    if total1 == total0:
        return None
    return max(0.0, (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1) - own)


def openmp_wait_policy(environ=os.environ, busy=None, looks=3, pause=0.4):
    """(OMP_WAIT_POLICY for this run, or None for OpenMP's default; why), as the run starts.
    OpenMP threads that finish their share early spin (libgomp's default): fastest on an idle
    machine, but beside another busy process the spinning threads take the cores the work needs
    (this 2-core CPU trained 3x slower than with one thread beside a busy loop; two such runs
    8-17x slower each). Where other processes keep a core busy as the run starts, the threads
    sleep instead (PASSIVE: as fast as one thread there, docs/experiments.md). That changes when threads
    wait, not what they compute: the same numbers either way (tested), unlike a thread count that
    followed the load. Busy means busy at each of `looks` readings `pause` s apart: a burst as the run
    starts (a short command) would make sleeping threads of a whole stage, whose sampling is 1.7x
    slower so (docs/reports.md, Stage times); another job stays busy through them."""
    if 'OMP_WAIT_POLICY' in environ:
        return None, f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']} as set"
    cores = os.cpu_count() or 1
    first = environ.get('OMP_NUM_THREADS', '').split(',')[0].strip()
    threads = int(first) if first.isdigit() and int(first) > 0 else cores
    if threads == 1:
        return None, 'one thread'
    for look in range(looks):
        if look:
            time.sleep(pause)
        in_use = (busy or cores_in_use)()
        if in_use is None or in_use < cores - threads + 0.5:
            return None, 'spinning while they wait: a core for each as the run started'
    return 'PASSIVE', f'sleeping while they wait: {in_use:.1f} of {cores} cores busy as the run started'


THREADS_WHY = None  # why the threads wait as they do: set by set_wait_policy
DECIDED = 'REBM_THREADS_WHY'  # set for the re-executed process: the policy is decided


def set_wait_policy(environ=os.environ, execv=os.execv, busy=None):
    """Decides the threads' wait policy as a script starts (run_main), once per process. torch,
    hence OpenMP, loaded with the script's imports, before the policy could be known: where it is
    PASSIVE the script is executed again (same PID: torchrun sees no change) with OMP_WAIT_POLICY
    set, and DECIDED saying why. The re-executed process takes both out of its environment (read:
    the processes it starts decide for themselves) and decides nothing: at most one re-execution."""
    global THREADS_WHY
    if THREADS_WHY is not None:  # decided in this process already
        return
    if DECIDED in environ:
        THREADS_WHY = environ.pop(DECIDED)
        environ.pop('OMP_WAIT_POLICY', None)
        return
    policy, THREADS_WHY = openmp_wait_policy(environ, busy)
    if policy:
        environ.update(OMP_WAIT_POLICY=policy, **{DECIDED: THREADS_WHY})
        sys.stdout.flush()
        sys.stderr.flush()
        execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # `-m job.reproduce` too


# -----------------------------------------------------------------------------
# memory: freed blocks kept for the next step, not handed back to the OS and faulted in again

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (glibc's malloc.h)
KEEP = ((M_MMAP_MAX, 0), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30))  # keep_freed_memory's
FREED_MEMORY_KEPT = None  # whether keep_freed_memory took effect in this process


def keep_freed_memory(libc=None):
    """glibc's malloc keeps what a step frees for the next step (run_main, as a script starts): every
    block from the heap (no block mapped on its own) and the heap's free top given back to the OS only
    beyond 1 GB. By default large blocks are mapped afresh and unmapped when freed, and the heap's free
    top is given back, so each step's tensors land on new pages that the kernel zero-fills on first
    touch: the addition LM's training step took 3,900 page faults, EXO's 40 steps 12 million, 14-18%
    of their CPU time in the kernel (docs/addition.md). The same arithmetic on the same values: only
    where the memory comes from. A process's resident memory stays at its high-water mark, as with
    PyTorch's GPU allocator. Returns whether it took effect (False where malloc is not glibc's)."""
    global FREED_MEMORY_KEPT
    try:
        mallopt = (libc or ctypes.CDLL(None)).mallopt  # the process's own C library
    except (OSError, AttributeError):
        FREED_MEMORY_KEPT = False
        return False
    FREED_MEMORY_KEPT = all(mallopt(param, value) == 1 for param, value in KEEP)
    return FREED_MEMORY_KEPT


# -----------------------------------------------------------------------------
# device and precision


def pick_device(device='auto'):
    """'auto': CUDA, else Apple's MPS (untested here: no Mac), else the CPU."""
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        return 'mps' if torch.backends.mps.is_available() else 'cpu'
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA GPU that torch {torch.__version__} "
                         f"can use: pass --device cpu (or auto)")
    if device == 'mps' and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available here: pass --device cpu (or auto)")
    if not (device in ('cpu', 'mps') or device.startswith('cuda')):
        raise ValueError(f"--device {device}: use auto, cpu, cuda, cuda:N or mps")
    return device


def check_compiler(device, environ=os.environ):
    """--compile on a CPU: torch.compile writes C++ kernels and builds them (inductor) at the first
    step, so a C++ compiler must be there; one line where none is, not a build error deep in it."""
    if pick_device(device).startswith('cpu') and not any(
            shutil.which(c) for c in (environ.get('CXX'), 'g++', 'c++', 'clang++') if c):
        raise ValueError("--compile: on a CPU torch.compile builds C++ kernels, and no C++ compiler "
                         "($CXX, g++, c++ or clang++) was found: install one (e.g. apt install g++), or drop "
                         "--compile")


# sampling and scoring on a CPU with bf16 units: bf16 measured 0.7x fp32 for the main job's 80-96 wide
# models (small matmuls), 1.5-1.6x for bench.py's 128-256 wide ones
CPU_BF16_MIN_WIDTH = 128


def choose_dtype(device, dtype='auto', work='train', width=None):
    """The autocast dtype for one kind of work ('train', 'sample', 'score') of models `width` wide
    (n_embd), and why, from what the hardware has and the work's shapes, never from a timing: the
    same command gives the same numbers on a busy machine as on an idle one (a timed probe
    flipped between runs with the load).
    CUDA: bf16 from compute capability 8.0 (Ampere) on; before that fp16 with a GradScaler
    (torch.cuda.is_bf16_supported() says True on a V100, which only emulates bf16).
    CPU: bf16 only where the CPU has bf16 units (without them it is emulated, ~100x slower): for
    training (1.7-2x fp32), and for sampling and scoring of models CPU_BF16_MIN_WIDTH wide or more."""
    if dtype != 'auto':
        return dtype, 'asked for'
    if device.startswith('cuda'):
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return 'bfloat16', f'compute capability {major}.{minor} has bf16 units'
        return 'float16', f'compute capability {major}.{minor} has no bf16 units: fp16 with GradScaler'
    if device != 'cpu':
        return 'float32', f'{device}: fp32 (autocast not measured there)'
    units = cpu_bf16_units()
    if not units:
        return 'float32', 'this CPU has no bf16 units: bf16 would be emulated'
    if work != 'train' and (width or 0) < CPU_BF16_MIN_WIDTH:
        return 'float32', f'{work} of {width}-wide models: bf16 is slower there, even with {units}'
    return 'bfloat16', f'this CPU has {units}'


def cpu_bf16_units(cpuinfo='/proc/cpuinfo'):
    """The CPU's bf16 instructions ('avx512_bf16', 'amx_bf16', as Linux lists its flags) where torch
    runs AVX-512 kernels ('' otherwise: other systems, or ATEN_CPU_CAPABILITY=avx2 capping them)."""
    if not torch.backends.cpu.get_cpu_capability().startswith('AVX512'):
        return ''
    try:
        with open(cpuinfo) as f:
            flags = set(re.findall(r'\b(avx512_bf16|amx_bf16)\b', f.read()))
    except OSError:
        return ''
    return ' and '.join(sorted(flags))


def autocast(device, dtype):
    """The autocast context of a dtype name or torch dtype (nothing for fp32)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.split(':')[0], dtype=dtype)


def precision(device, dtype, work='train', verbose=True, width=None):
    """(dtype, autocast context) for this work (of models `width` wide); prints the choice and why."""
    dtype, why = choose_dtype(device, dtype, work, width)
    if verbose:
        print(f"{work}: {device}, {dtype} ({why})", file=sys.stderr, flush=True)
    return dtype, autocast(device, dtype)


class Precision(NamedTuple):
    """The autocast contexts of work with two models: `lm` around the LM's sampling and scoring,
    `energy` around the energy's scoring. They can differ (choose_dtype decides by each model's
    width and work); the default is float32 for both."""
    lm: AbstractContextManager = nullcontext()
    energy: AbstractContextManager = nullcontext()


def setup(device, deterministic=False):
    """(rank, world_size, device): the device picked (with --deterministic, its deterministic kernels),
    and DDP set up under torchrun."""
    device = pick_device(device)
    if deterministic:
        set_deterministic(device)
    rank, world_size, device = setup_distributed(device)
    if deterministic and rank == 0:
        print("deterministic: on (--deterministic)", file=sys.stderr, flush=True)
    if device == 'cpu' and rank == 0:
        print(f"threads: {torch.get_num_threads()}, {THREADS_WHY or 'OpenMP default'}", file=sys.stderr,
              flush=True)
    return rank, world_size, device


def set_deterministic(device):
    """--deterministic: PyTorch's deterministic kernels where it has them (an op without one warns, once),
    attention by its math kernel on a GPU (the flash and memory-efficient backward passes add in no fixed
    order under warn_only), cuBLAS with a fixed workspace; set before the first CUDA kernel. Meant to make a
    GPU run repeat bit for bit on the same GPU and software, slower (not yet run on a GPU). A CPU run
    repeats without it; with it, its numbers are unchanged (tested), though torch.empty then writes NaN
    first."""
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.startswith('cuda'):
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


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


def teardown_distributed():
    """End torchrun's process group (also a 1-process one: NCCL warns otherwise); a no-op without one."""
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while another still writes or reduces
        dist.destroy_process_group()


def all_reduce(sums, device, world_size):
    """sums added up over the ranks (on the run's device: NCCL refuses CPU tensors)."""
    if world_size > 1:
        sums = sums.to(device)
        dist.all_reduce(sums)
    return sums


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


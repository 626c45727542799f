"""
Plumbing: a reader may skip this file. Nothing here is the method or specific to the paper; it
is what lets the scripts run on any machine and fail with one clear line:

    threads        OpenMP's wait policy, decided before torch loads (openmp_wait_policy)
    device, dtype  pick_device, choose_dtype: the precision from what the hardware has
    DDP            setup / teardown_distributed for the scripts that are not trainers (the two
                   trainers show theirs inline, as nanoGPT's train.py does)
    seeds          rng_seed, rng: one rule for every random stream
    bad input      ArgumentParser, check*, disk checks: one `error:` line, before any work (memory and
                   time: budget.py)
    writes         atomic_write(s), finite (JSON has no NaN), disk_full: the one line of a full disk
    entry point    run_main: one-line errors (REBM_DEBUG=1 shows the traceback), Ctrl-C (and SIGTERM)
                   hints, the output folders of a failed run that saved nothing removed

Scripts import it first: see openmp_wait_policy.
"""

import argparse
import errno
import fcntl
import functools
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext

import numpy as np

# -----------------------------------------------------------------------------
# threads on a shared machine: decided before torch loads, as OpenMP reads its policy only then


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


def openmp_wait_policy(environ=os.environ, busy=cores_in_use):
    """(OMP_WAIT_POLICY for this run, or None for OpenMP's default; why), as the run starts.
    OpenMP threads that finish their share early spin (libgomp's default): fastest on an idle
    machine, but beside another busy process the spinning threads take the cores the work needs
    (this 2-core CPU trained 3x slower than with one thread beside a busy loop; two such runs
    8-17x slower each). Where other processes keep a core busy as the run starts, the threads
    sleep instead (PASSIVE: as fast as one thread there, docs/experiments.md). That changes when threads
    wait, not what they compute: the same numbers either way (tested), unlike a thread count that
    followed the load."""
    if 'OMP_WAIT_POLICY' in environ:
        return None, f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']} as set"
    cores = os.cpu_count() or 1
    first = environ.get('OMP_NUM_THREADS', '').split(',')[0].strip()
    threads = int(first) if first.isdigit() and int(first) > 0 else cores
    if threads == 1:
        return None, 'one thread'
    in_use = busy()
    if in_use is None or in_use < cores - threads + 0.5:
        return None, 'spinning while they wait: a core for each as the run started'
    return 'PASSIVE', f'sleeping while they wait: {in_use:.1f} of {cores} cores busy as the run started'


WAIT_POLICY, THREADS_WHY = openmp_wait_policy()
if WAIT_POLICY:
    os.environ['OMP_WAIT_POLICY'] = WAIT_POLICY

import torch  # noqa: E402  (after the wait policy: OpenMP reads it once, as torch loads it)
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

if WAIT_POLICY:
    del os.environ['OMP_WAIT_POLICY']  # read: the processes this one starts decide for themselves

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
        raise ValueError(f"--device {device}: this machine has no CUDA GPU that torch {torch.__version__} "
                         f"can use: pass --device cpu (or auto)")
    if device == 'mps' and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available here: pass --device cpu (or auto)")
    if not (device in ('cpu', 'mps') or device.startswith('cuda')):
        raise ValueError(f"--device {device}: use auto, cpu, cuda, cuda:N or mps")
    return device


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


# micro-batches per iteration: nanoGPT's GPT-2 recipe takes 40; beyond this, a mistyped size whose
# iteration would hold its window offsets by the billion and run for days
MAX_GRAD_ACCUM = 2**16


def check_training_flags(args):
    """The optimisation flags both trainers share, in range, heads that divide the width, a
    --patience that can fire within --max_iters, and --out_dir writable (and removed if the run
    creates it and then fails before saving anything);
    --lr_decay_iters defaults to --max_iters."""
    if args.n_embd and args.n_head and not getattr(args, 'match_params', None):  # BALM: width comes later
        check_heads(args.n_embd, args.n_head)
    check(args, 'grad_accum', lambda v: v <= MAX_GRAD_ACCUM,
          f'at most {MAX_GRAD_ACCUM:,} micro-batches per iteration (a larger batch: raise --batch_size)')
    check(args, 'lr', lambda v: 0 < v < math.inf, 'a positive number')
    check(args, 'min_lr', lambda v: 0 <= v < math.inf, 'a number >= 0')
    check(args, 'weight_decay', lambda v: v < math.inf, 'a finite number >= 0')
    for name in ('dropout', 'beta1', 'beta2'):
        check(args, name, lambda v: 0 <= v < 1, 'in [0, 1)')
    if args.patience and args.max_iters < (args.patience + 1) * args.eval_interval:
        raise ValueError(f"--patience {args.patience} can never stop a run of --max_iters {args.max_iters}: "
                         f"the stopping rule needs {args.patience + 1} evaluations (--eval_interval "
                         f"{args.eval_interval}), so `converged: false` would be forced, not measured; raise "
                         f"--max_iters to at least {(args.patience + 1) * args.eval_interval} or lower "
                         f"--eval_interval")
    check_writable(args.out_dir, '--out_dir')
    new_folder(args.out_dir, keep=('ckpt.pt', 'best.pt'))  # a run that fails before saving leaves none
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters


def precision(device, dtype, work='train', verbose=True, width=None):
    """(dtype, autocast context) for this work (of models `width` wide); prints the choice and why."""
    dtype, why = choose_dtype(device, dtype, work, width)
    if verbose:
        print(f"{work}: {device}, {dtype} ({why})", flush=True)
    return dtype, autocast(device, dtype)


def setup(device):
    """(rank, world_size, device): the device picked, and DDP set up under torchrun."""
    rank, world_size, device = setup_distributed(pick_device(device))
    if device == 'cpu' and rank == 0:
        print(f"threads: {torch.get_num_threads()}, {THREADS_WHY}", flush=True)
    return rank, world_size, device


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
# --resume: the flags given must agree with the run it continues

def given_flags(argv=None):
    """The names of the flags on the command line (argv, or sys.argv): what a --resume checks."""
    return {a.split('=')[0][2:] for a in (sys.argv[1:] if argv is None else argv) if a.startswith('--')}


def resumed_dtype(dtype, saved, path):
    """The --dtype of a --resume: `saved`, the precision the checkpoint at path trained in (recorded
    with its flags), so that a run does not change precision halfway; a --dtype that contradicts it
    is refused. A checkpoint from before precision was recorded (saved None) keeps --dtype."""
    if saved in (None, 'auto'):
        return dtype
    if dtype not in ('auto', saved):
        raise ValueError(f"--dtype {dtype} contradicts {path} (trained in {saved}): --resume continues "
                         f"in the checkpoint's precision; drop --dtype, or start a new run in another "
                         f"--out_dir")
    return saved


def check_resumed_flags(args, argv, saved, fixed, path, what):
    """A --resume continues the `what` saved at path (saved: its flags) in its precision, as the
    uninterrupted run would have gone on: a flag among `fixed` (those that change the numbers) on
    the command line (argv) that contradicts it is refused, as is a contradicting --dtype; one left
    out takes the checkpoint's value. A path contradicts only if it names another file."""
    if hasattr(args, 'dtype'):  # EXO has no --dtype
        args.dtype = resumed_dtype(args.dtype, saved.get('dtype'), path)
    given = given_flags(argv)
    for name in sorted(n for n in fixed if n in saved):
        if name not in given:
            setattr(args, name, saved[name])
        elif not same_value(getattr(args, name), saved[name]):
            raise ValueError(f"--{name} {getattr(args, name)} contradicts {path} ({name} {saved[name]}): "
                             f"--resume continues that {what}; drop the flag, or start a new run in "
                             f"another --out_dir")


def same_value(a, b):
    """a == b, or two paths to one file or folder."""
    if a == b:
        return True
    return (isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b)
            and os.path.samefile(a, b))


def check_resumed_iters(max_iters, it, path):
    """--max_iters of a --resume: not below the iteration `it` that the checkpoint at path holds."""
    if max_iters < it:
        raise ValueError(f"--max_iters {max_iters} is below the {it} iterations {path} holds: --resume "
                         f"goes on from there; pass --max_iters {it} or more")


# -----------------------------------------------------------------------------
# a trainer's --out_dir: one job at a time, and what an earlier run kept there never replaced

KEPT = ('ckpt.pt', 'best.pt', 'results.json')  # a trainer's outputs worth keeping


def check_new_run(out_dir):
    """A new run (no --resume) must not replace what an earlier one kept in out_dir: best.pt as
    much as ckpt.pt."""
    ckpt = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(ckpt):
        raise ValueError(f"{ckpt} exists: pass --resume to continue it or choose another --out_dir")
    kept = [f for f in KEPT if os.path.exists(os.path.join(out_dir, f))]
    if kept:
        raise ValueError(f"{os.path.join(out_dir, kept[0])} exists (kept by an earlier run; without its "
                         f"ckpt.pt there is nothing to resume): choose another --out_dir, or delete it first")


def missing_checkpoint(out_dir):
    """The line of a --resume whose out_dir/ckpt.pt does not exist (ValueError)."""
    ckpt = os.path.join(out_dir, 'ckpt.pt')
    kept = [f for f in KEPT if os.path.exists(os.path.join(out_dir, f))]
    if kept:
        return ValueError(f"--resume: {ckpt} does not exist (nothing to resume), and {out_dir} holds "
                          f"{' and '.join(kept)} of an earlier run: start a new run in another --out_dir")
    return ValueError(f"--resume: {ckpt} does not exist: drop --resume to start a new run")


LOCKS = {}  # descriptor -> the folder it holds locked (lock_folder)


def lock_folder(path, flag='--out_dir'):
    """One job per output folder at a time: path (checked writable, created) locked with flock,
    which the kernel drops when the process ends, killed with -9 included: no stale lock. On rank 0
    only (torchrun's processes are one job); a filesystem without locks goes unlocked."""
    if int(os.environ.get('RANK', 0)) > 0:
        return
    check_writable(path, flag)
    for folder in (path, first_missing(path)):  # removed if the job fails before it wrote anything there
        if folder not in {p for p, _ in NEW_FOLDERS}:  # a trainer's is there already, with what it keeps
            new_folder(folder, keep=())
    os.makedirs(path, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise ValueError(f"{flag} {path} is in use by another job (one job per folder): wait for it to "
                             f"end, or choose another {flag}") from None
        return
    LOCKS[fd] = path


def one_job(main):
    """main, with the folders it locked (lock_folder) unlocked however it ends (in a test's process too)."""
    @functools.wraps(main)
    def locked_main(*args, **kwargs):
        held = set(LOCKS)
        try:
            return main(*args, **kwargs)
        finally:
            for fd in set(LOCKS) - held:
                del LOCKS[fd]
                os.close(fd)
    return locked_main


def micro_batches(grad_accum, world_size):
    """--grad_accum, the micro-batches of an iteration over all processes: by default one per
    process (nanoGPT scales its accumulation by the world size too), given, a multiple of them."""
    grad_accum = grad_accum or world_size
    if grad_accum % world_size:
        raise ValueError(f"--grad_accum {grad_accum} must be a multiple of the {world_size} processes "
                         f"(left out: one micro-batch per process)")
    return grad_accum


# -----------------------------------------------------------------------------
# user interface

def progress(iterable=None, quiet=False, **kw):
    return tqdm(iterable, disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True, **kw)


def write_log(log, rec):
    """One JSON line of a log.jsonl (None: not rank 0, which alone writes the log)."""
    if log is not None:
        log.write(json.dumps(finite(rec)) + '\n')
        log.flush()


def atomic_write(path, write, nbytes=None):
    """write(tmp), then rename tmp to path (atomic_writes, for one file of about nbytes if known)."""
    atomic_writes([(path, write, nbytes)])


def atomic_writes(writes):
    """write(tmp) for each (path, write, nbytes) of writes, then each tmp renamed to its path, in
    order: a reader never sees half a file, and a failed write (full disk, Ctrl-C) leaves every
    previous file as it was and no temp file behind. Where every size is known (nbytes, else None)
    the disk is checked for all of them first. An OSError names the path; a full disk is the one
    disk-full line."""
    if all(n is not None for *_, n in writes):
        check_disk(writes[0][0], sum(n for *_, n in writes))
    tmps = []
    try:
        for path, write, nbytes in writes:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmps.append(f"{path}.{os.getpid()}.tmp")
            write(tmps[-1])
        for (path, *_), tmp in zip(writes, tmps):
            os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C too
        written = os.path.getsize(tmps[-1]) if tmps and os.path.exists(tmps[-1]) else 0
        full = tmps and out_of_space(e, path, nbytes and max(0, nbytes - written))  # before the temps go
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        if not isinstance(e, (OSError, RuntimeError)):  # a full disk is a RuntimeError inside torch.save
            raise
        if full:
            raise OSError(errno.ENOSPC, disk_full(path), path) from None
        raise OSError(getattr(e, 'errno', None) or errno.EIO,
                      f"cannot write {path} ({getattr(e, 'strerror', None) or e})", path) from None


def out_of_space(e, path, remaining=None):
    """Whether a write to path failed for want of disk space: ENOSPC, or, from a writer that says
    so without an errno (torch.save's 'enforce fail ... unexpected pos', numpy's 'N requested and
    M written'), less free than the `remaining` bytes to write (None: unknown) and 1 MiB."""
    if getattr(e, 'errno', None) == errno.ENOSPC:
        return True
    if not isinstance(e, (RuntimeError, OSError)) or getattr(e, 'errno', None):
        return False
    return free_space(path) < (remaining or 0) + 2**20


def finite(obj):
    """obj with every NaN or infinite float replaced by None: JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


# -----------------------------------------------------------------------------
# bad input: one line naming the flag or file, found before any work or write

DEBUG_HELP = "Bad input stops with one 'error:' line; REBM_DEBUG=1 in the environment shows the traceback."


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, 'abc' for an int) are one `error:` line through
    run_main, like every other bad input, instead of the usage text and exit status 2."""

    def __init__(self, **kw):
        if script_command()[1] == '-m':  # the usage line as it is typed, not the file's name
            kw.setdefault('prog', ' '.join(script_command()))
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, epilog=DEBUG_HELP, **kw)

    def error(self, message):
        raise ValueError(f"{message} (see {self.prog} --help)")


def check(args, name, ok, must):
    """--name's value (None: not given) must pass ok; written so that NaN fails every rule."""
    v = getattr(args, name)
    if v is not None and not ok(v):
        raise ValueError(f"--{name} {v}: must be {must}")


def at_least(args, minimum, *names):
    for name in names:
        check(args, name, lambda v: v >= minimum, f"at least {minimum}")


def check_heads(n_embd, n_head):
    if n_embd % n_head:
        raise ValueError(f"--n_embd {n_embd} is not a multiple of --n_head {n_head}: "
                         "each head gets n_embd/n_head dims")


def nearest_existing(path):
    """path, or the nearest of its parents that exists (where it would be created)."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d


def first_missing(path):
    """The outermost folder that creating path creates (path itself if its parent exists)."""
    d = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(d)):
        d = os.path.dirname(d)
    return d


def check_writable(path, flag, folder=True):
    """Fail now rather than after the work: the path (a folder, or a file with folder=False) must
    be creatable, which is tried with a temporary file in its nearest existing folder. Nothing
    is created."""
    if not path:
        raise ValueError(f"{flag} is empty: give a {'folder' if folder else 'file'} path")
    check_name_lengths(path, flag)
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a folder: choose another path")
    if not folder and os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder: give a file path")
    d = nearest_existing(path if folder else os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(d):
        raise ValueError(f"{flag} {path}: {d} is a file, not a folder: choose another path")
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix='.rebm-write-test-')
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {d} ({e.strerror}): "
                         "choose a writable path") from None


def check_name_lengths(path, flag):
    """Each name in path within the filesystem's NAME_MAX (255 bytes on Linux), the last with room
    for the temporary name a write uses beside it (TMP_ROOM): a longer one fails only at the first
    write, in whatever temporary name that write uses."""
    d = nearest_existing(path)
    try:
        name_max = os.pathconf(d if os.path.isdir(d) else os.path.dirname(d), 'PC_NAME_MAX')
    except (OSError, ValueError):
        name_max = 255
    names = os.path.abspath(path).split(os.sep)
    for i, name in enumerate(names):
        n, room = len(os.fsencode(name)), TMP_ROOM if i == len(names) - 1 else 0
        if n > name_max - room:
            why = f"the filesystem's {name_max}, less {room} for the temporary name beside it" if room else \
                f"the filesystem's NAME_MAX"
            raise ValueError(f"{flag} {path}: the name {name[:16]}... is {n} bytes, more than the "
                             f"{name_max - room} a name may have here ({why}): choose a shorter one")


# a temporary name's extra bytes: '.NAME.' + 8 (prepare's folder), 'NAME.PID.tmp' (atomic_writes)
TMP_ROOM = 16


def named_paths(specs, flag):
    """{NAME: PATH} of a flag's NAME=PATH values: each of that form, no NAME twice (the second
    would silently replace the first)."""
    out = {}
    for spec in specs:
        name, _, path = spec.partition('=')
        if not (name and path):
            raise ValueError(f"{flag} '{spec}' must be NAME=CHECKPOINT, e.g. BIT=out/bit/best.pt")
        if name in out:
            raise ValueError(f"{flag}: the name {name} is given twice ({out[name]} and {path}): "
                             f"give each model its own name")
        out[name] = path
    return out


def check_new(path, flag, force, also=()):
    """Refuse to replace a result (and its twins, e.g. the .txt beside a .json) without --force."""
    existing = [p for p in (path, *also) if os.path.exists(p)]
    if existing and not force:
        raise ValueError(f"{flag}: {' and '.join(existing)} already exist(s): pass --force to replace, "
                         f"or choose another {flag}")


def not_a_file(path):
    """Why path cannot be read as an input file ('' if it can): it does not exist, is a folder, or
    is not a regular file (/dev/null, a pipe: 'does not exist' would send the user looking for it)."""
    if not os.path.exists(path):
        return 'does not exist'
    if os.path.isdir(path):
        return 'is a folder, not a file'
    return '' if os.path.isfile(path) else 'is not a regular file (a device, a pipe or a socket)'


# ---- a full disk: one line everywhere, found before the write where the size is known ----

def disk_full(path, needed=None, free=None):
    """The one disk-full line (ENOSPC), with the sizes where they are known."""
    if needed is None:
        return (f"the disk holding {path} is full: free some space and rerun "
                f"(what was written before is intact)")
    mb = lambda n: f"{n / 1e6:.{1 if n >= 1e5 else 3}f} MB"
    return f"the disk holding {path} is full: {mb(needed)} needed, {mb(free)} free"


def free_space(path):
    """Bytes free on the disk that holds path (or would: its nearest existing folder)."""
    return shutil.disk_usage(nearest_existing(path)).free


def check_disk(path, nbytes):
    """Refuses a write of about nbytes to path that the disk cannot hold, before it starts: an
    OSError (ENOSPC) with the one disk-full line and its sizes."""
    free = free_space(path)
    if free < nbytes:
        raise OSError(errno.ENOSPC, disk_full(path, nbytes, free) + ": free some space and rerun", path)


def check_free_space(path, nbytes, flag):
    """check_disk for the output a flag names, as bad input: before any work."""
    free = free_space(path)
    if free < nbytes:
        raise ValueError(f"{flag}: {disk_full(path, nbytes, free)}: free some space or choose another {flag}")


# -----------------------------------------------------------------------------
# the entry point

def script_command():
    """How this script was started: ['python', 'train_lm.py'] or ['python', '-m', 'job.reproduce']."""
    spec = getattr(sys.modules['__main__'], '__spec__', None)
    if spec and spec.origin == sys.argv[0]:  # python -m sets both
        return ['python', '-m', spec.name]
    return ['python', sys.argv[0]]


def rerun_command(argv, add=()):
    """The command that reruns this script with the same flags, plus those of `add` it lacks."""
    return shlex.join([*script_command(), *argv, *[a for a in add if a not in argv]])


def checkpoint_iter(path):
    """The iteration a trainer's checkpoint holds (mmap: no wait on a big one)."""
    return torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num']


def diverged(iter_num, grad_norm, out_dir):
    """A trainer's line for a step whose gradients are not finite: what to change, and what is
    kept (out_dir/ckpt.pt, where an evaluation saved one)."""
    path = os.path.join(out_dir, 'ckpt.pt')
    kept = (f"the last checkpoint saved ({path}, iteration {checkpoint_iter(path)}) is finite"
            if os.path.exists(path) else "nothing was saved (no evaluation came before)")
    return (f"the gradients are not finite at iteration {iter_num + 1} (norm {grad_norm}): training "
            f"diverged; lower --lr or --weight_decay, or clip harder (--grad_clip); {kept}")


def checkpoint_hint(argv, path, max_iters, every):
    """A trainer's Ctrl-C line: the iteration its checkpoint holds and the command that continues it."""
    if not os.path.exists(path):
        return (f"nothing was saved yet (the first checkpoint comes at iteration {every}); "
                f"rerun: {rerun_command(argv)}")
    it = checkpoint_iter(path)
    return (f"{path} holds iteration {it} of {max_iters} (saved every {every}); "
            f"resume with: {rerun_command(argv, ['--resume'])}")


def os_error_text(e):
    text = str(e.strerror or e)
    if e.filename and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    if e.errno == errno.ENOSPC:  # already the one disk-full line (check_disk, atomic_writes), or made so
        return text if ' is full: ' in text else disk_full(e.filename or 'the output')
    return text + ": check the path and its permissions"


def interrupt(signum, frame):
    raise KeyboardInterrupt


# folders a run is about to create, with the files that make one worth keeping (new_folder)
NEW_FOLDERS = []


def new_folder(path, keep):
    """path does not exist yet: if the run then fails before it saved one of `keep` there, run_main
    removes it, and the rerun starts clean (no empty output folder, no log of nothing stays)."""
    if not os.path.exists(path):
        NEW_FOLDERS.append((path, keep))


def remove_new_folders():
    """What new_folder promised, on rank 0 (the one that writes): a folder with a subfolder or a
    file of `keep` stays."""
    if int(os.environ.get('RANK', 0)) > 0:
        return
    for path, keep in NEW_FOLDERS:
        if os.path.isdir(path) and not any(os.path.isdir(os.path.join(path, f)) or f in keep
                                           for f in os.listdir(path)):
            shutil.rmtree(path, ignore_errors=True)


def run_main(main, resume_hint=None):
    """A script's entry point: bad input, and a file that cannot be read or written, exit with one
    `error:` line, not a traceback (REBM_DEBUG=1: the traceback, for a bug behind a ValueError).
    Ctrl-C exits with one `interrupted:` line that says what was saved and the command that
    resumes: resume_hint(argv) (default: nothing was saved, rerun). SIGTERM (kill, a scheduler)
    is a Ctrl-C. A failed run removes the output folders it created and saved nothing in
    (new_folder). stdout closed by its reader (`| head`): a quiet exit (stdout_closed)."""
    argv = sys.argv[1:]
    NEW_FOLDERS.clear()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        main(argv)
    except BrokenPipeError as e:
        if e.filename is not None:  # a file, not stdout: one line, as any OSError
            one_line_error()
        stdout_closed()
    except (ValueError, OSError, torch.OutOfMemoryError):
        remove_new_folders()
        if os.environ.get('REBM_DEBUG', '0') not in ('', '0'):
            raise
        one_line_error()
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut this line short
            signal.signal(sig, signal.SIG_IGN)
        if int(os.environ.get('RANK', 0)) > 0:  # under torchrun rank 0 says it, once
            sys.exit(130)
        try:
            hint = resume_hint(argv) if resume_hint else None
        except (Exception, KeyboardInterrupt):  # e.g. flags that do not parse: the rerun hint is right
            hint = None
        print(f"interrupted: {hint or f'nothing was saved; rerun: {rerun_command(argv)}'}", file=sys.stderr,
              flush=True)
        sys.exit(130)


def stdout_closed():
    """The reader of stdout went away (`| head`): exit quietly, as Unix tools do, with the status
    of a process SIGPIPE ended; stdout pointed at /dev/null so that Python's exit flush cannot
    complain again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


def wait_for_rank_0(seconds=10):
    """Bad input under torchrun, found alike by every rank: rank 0 says it, once. This rank waits
    for torchrun to end it once rank 0 has (quietly: its SIGTERM is no Ctrl-C here); it says it
    itself only if rank 0 goes on (input that only this rank found bad)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    time.sleep(seconds)


def one_line_error():
    """The exception being handled, as one `error:` line and exit status 1."""
    e = sys.exc_info()[1]
    if isinstance(e, ValueError) and int(os.environ.get('RANK', 0)) > 0:
        wait_for_rank_0()
    if isinstance(e, torch.OutOfMemoryError):
        sys.exit("error: out of GPU memory: lower the batch size (--batch_size, --chunk or --max_rows)")
    sys.exit(f"error: {os_error_text(e) if isinstance(e, OSError) else e}")

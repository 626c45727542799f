"""
The entry point and bad input: run_main (one `error:` line instead of a traceback, Ctrl-C and
SIGTERM hints, the output folders of a failed run removed), ArgumentParser (every flag declared
with its help, kind and bounds, checked as it is parsed), the flags every script shares
(common_flags) and the flag checks, and one job per output folder (lock_folder).
"""

import argparse
import collections
import errno
import fcntl
import functools
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from plumbing.device import DTYPES, keep_freed_memory, set_wait_policy
from plumbing.files import disk_full, first_missing, nearest_existing

# -----------------------------------------------------------------------------
# bad input: one line naming the flag or file, found before any work or write


DEBUG_HELP = "Bad input stops with one 'error:' line; REBM_DEBUG=1 in the environment shows the traceback."

# the flags every script shares, one default each (common_flags): --device auto everywhere
COMMON_FLAGS = dict(
    out_dir=dict(required=True, path=True, help='where the outputs go'),
    force=dict(action='store_true', help='replace the outputs of an earlier run'),
    device=dict(default='auto', help="'cpu', 'cuda', 'cuda:1', ... ('auto': CUDA, else MPS, else the CPU)"),
    deterministic=dict(action='store_true', help="PyTorch's deterministic kernels where it has them "
                       "(plumbing.set_deterministic): a GPU run repeats bit for bit, slower"),
    dtype=dict(default='auto', choices=DTYPES,
               help="autocast dtype ('auto': from the hardware, docs/using.md)"),
    seed=dict(type=int, default=1337, at_least=0, at_most=2**63 - 1,
              help='every random stream derives from it (rng_seed)'),
    quiet=dict(action='store_true', help='no progress bar'),
)


def common_flags(parser, *names, help=None, default=None):
    """Adds the shared flags `names` (of COMMON_FLAGS) to parser, in that order; help: {name: a
    script's own text}; default: {name: value} (--out_dir then optional)."""
    for name in names:
        kw = dict(COMMON_FLAGS[name], **{'help': (help or {})[name]} if name in (help or {}) else {})
        if name in (default or {}):
            kw = dict({k: v for k, v in kw.items() if k != 'required'}, default=default[name])
        parser.add_argument(f'--{name}', **kw)


# -----------------------------------------------------------------------------
# flags declared with their kind and bounds (ArgumentParser.add_argument), checked as they are parsed

UNSET = object()  # a bound not declared (a numeric flag must declare both, None: none that way)

# sizes bounded by what a machine can hold, generous: a mistyped size is refused before it allocates
MAX_SAMPLES = 2**16  # LM samples per prefix (negatives.py's bound, docs/using.md)
MAX_BEAM = 4096      # beam width: 100,000 on addition asked 26 GB; this, about 1 GB
MAX_TOKENS = 2**20   # tokens of a prefix or a continuation, a context, a width
MAX_COUNT = 2**31 - 1  # prefixes, problems, iterations, batches: what an int64 index and a run can hold


def comma_ints(text):
    """'1,4,16' -> [1, 4, 16] (sorted, each once): a list of sample counts (--ns)."""
    return sorted({int(n) for n in text.split(',') if n.strip()})


comma_ints.__name__ = 'comma-separated integers'  # argparse's "invalid ... value" line

# at_most= by the kind of size (a declaration reads at_most='samples'), or a number
SIZES = dict(samples=MAX_SAMPLES, beam=MAX_BEAM, tokens=MAX_TOKENS, count=MAX_COUNT)


# where a flag's declaration names a different attribute (dest=, the name the code and the checkpoints
# recorded before the flag's rename): {dest: flag} of the last parse, for the lines of the checks that
# name flags (check) and for --resume's flags given (plumbing.trainer.given_flags)
FLAG_OF = {}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every flag's default in --help (unless its help says it)."""

    def _get_help_string(self, action):
        text = action.help or ''
        if (action.option_strings and action.default is not argparse.SUPPRESS and action.nargs != 0
                and 'default' not in text):
            text += ' (default: %(default)s)'
        return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, 'abc' for an int) are one `error:` line through
    run_main, like every other bad input, instead of the usage text and exit status 2; its usage
    names the command as typed (script_command), and --help every default.

    Every flag is declared with help and, where it has them, its kind and bounds, which parse_args
    checks (one line naming the flag, before any work): a number (type int or float) declares a
    lower bound, at_least= (None: unbounded) or above= (strict: a rate above 0), and an upper one,
    at_most= (None: unbounded; a size bounded by memory: at_most='samples', 'beam', 'tokens' or
    'count', SIZES) or below= (strict: a probability below 1),
    and a float is refused as nan or inf unless finite=False; a comma-separated list of ints
    (type=comma_ints) has each value bounded; path=True (or a name PATH_FLAG knows): '' is refused.
    A declaration without them is refused when the parser is built (a flag cannot be added unguarded)."""

    capture = False  # parsers_of: parse_args hands the built parser back instead of parsing

    def __init__(self, **kw):
        kw.setdefault('prog', ' '.join(script_command() + PROG_SUFFIX))  # the usage line as it is typed
        kw.setdefault('formatter_class', HelpFormatter)
        kw.setdefault('allow_abbrev', False)  # a retired name (--m) is not a prefix of another (--max_rows)
        self.bounds = {}  # dest -> Bounds
        self.paths = set()  # dests of path flags
        self.flag_of = {}  # dest -> flag, where they differ (FLAG_OF)
        super().__init__(epilog=DEBUG_HELP, **kw)

    def add_argument(self, *args, at_least=UNSET, at_most=UNSET, above=UNSET, below=UNSET, finite=True,
                     path=None, **kw):
        if 'dest' in kw and args and args[0].startswith('--') and kw.get('action') is None:
            kw.setdefault('metavar', args[0][2:].upper())  # the flag's name in --help, not the dest's
        flag, numeric = args[0] if args else kw.get('dest'), kw.get('type') in (int, float, comma_ints)
        if not kw.get('help'):  # checked before argparse registers the flag
            raise TypeError(f"{flag}: declare its help (what it is, its unit)")
        if not numeric and any(b is not UNSET for b in (at_least, at_most, above, below)):
            raise TypeError(f"{flag}: bounds declared on a flag that is not a number (type=int or float)")
        if numeric:
            lo, strict_lo = one_bound(flag, at_least, above, 'at_least', 'above')
            hi, strict_hi = one_bound(flag, at_most, below, 'at_most', 'below')
        action = super().add_argument(*args, **kw)
        if numeric:
            hi = SIZES[hi] if isinstance(hi, str) else hi
            finite = finite and action.type is float
            self.bounds[action.dest] = Bounds(flag, lo, hi, finite, strict_lo, strict_hi)
        if path or (path is None and action.option_strings and PATH_FLAG.search(flag[2:])):
            self.paths.add(action.dest)
        if action.option_strings and action.dest != flag[2:]:
            self.flag_of[action.dest] = flag
        return action

    def parse_args(self, args=None, namespace=None):
        if ArgumentParser.capture:
            raise ParserBuilt(self)
        parsed = super().parse_args(args, namespace)
        FLAG_OF.clear()
        self.check_declared(parsed)
        return parsed

    def check_declared(self, parsed):
        """The declared bounds and paths of parsed's values (a subcommand's too)."""
        FLAG_OF.update(self.flag_of)
        for dest, bounds in self.bounds.items():
            value = getattr(parsed, dest, None)
            for v in value if isinstance(value, list) else [value]:
                check_bounds(v, bounds)
        for action in self._actions:
            if action.dest in self.paths:
                check_not_empty(action, getattr(parsed, action.dest, None))
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None))
                if isinstance(sub, ArgumentParser):
                    sub.check_declared(parsed)

    def error(self, message):
        if message.startswith('argument '):  # "argument --beam: invalid int value" -> "--beam: ..."
            message = message[len('argument '):]
        raise ValueError(f"{message} (see {self.prog} --help)")


class ParserBuilt(Exception):
    """parsers_of's catch: the parser a script built, at its parse_args."""

    def __init__(self, parser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(build, *args):
    """The ArgumentParser that build(*args) (a script's get_args or main) builds, without running
    anything past its parse_args: what tests/test_flags.py checks every script's flags with."""
    ArgumentParser.capture = True
    try:
        build(*args)
    except ParserBuilt as e:
        return e.parser
    finally:
        ArgumentParser.capture = False
    raise TypeError(f"{build.__qualname__} parsed no flags")


# extensions.run: the script it runs, named in that script's usage line after its own command
PROG_SUFFIX = []


# a number's declared bounds: lo, hi (None: open that way), each strict (above=, below=) or not
Bounds = collections.namedtuple('Bounds', 'flag lo hi finite strict_lo strict_hi')


def one_bound(flag, inclusive, strict, name, strict_name):
    """(the bound, whether strict) of one side of a number: exactly one of its two keywords declared."""
    if inclusive is UNSET and strict is UNSET:
        raise TypeError(f"{flag}: a number declares its bounds, at_least= or above= and at_most= or below= "
                        f"(None: unbounded)")
    if inclusive is not UNSET and strict is not UNSET:
        raise TypeError(f"{flag}: {name}= or {strict_name}=, not both")
    if strict is UNSET:
        return inclusive, False
    if not isinstance(strict, (int, float)):
        raise TypeError(f"{flag}: {strict_name}= is a number (at_least=None or at_most=None: unbounded)")
    return strict, True


def check_bounds(v, b):
    """A declared number's value: finite (nan and inf refused), within its Bounds b (None: open)."""
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return
    if b.finite and not math.isfinite(v):
        raise ValueError(f"{b.flag} {v}: must be a finite number")
    if b.lo is not None and not (v > b.lo if b.strict_lo else v >= b.lo):
        raise ValueError(f"{b.flag} {v}: must be {'above' if b.strict_lo else 'at least'} {b.lo}")
    if b.hi is not None and not (v < b.hi if b.strict_hi else v <= b.hi):
        raise ValueError(f"{b.flag} {v}: must be {'below' if b.strict_hi else 'at most'} {b.hi:,}"
                         + (' (a size bounded by what a machine can hold)' if b.hi >= 1024 else ''))


# a flag that names a file or folder (a NAME=PATH list too): '' is refused, never read as "the default"
PATH_FLAG = re.compile(r'(_dir|^out|^lm|^energy$|init_from|residual_of|negatives|^plot|copy_to|^extra_lm|'
                       r'^compare|energy_metric|^cache$|^key$|^votes$|^samples$)$')


def check_not_empty(action, value):
    values = value if isinstance(value, list) else [value]
    if action.option_strings and any(isinstance(v, str) and not v.strip() for v in values):
        raise ValueError(f"{action.option_strings[0]} '': an empty path; give a file or folder, or leave the "
                         f"flag out for its default")


def check(args, name, ok, must):
    """--name's value (None: not given) must pass ok; written so that NaN fails every rule."""
    v = getattr(args, name)
    if v is not None and not ok(v):
        raise ValueError(f"{FLAG_OF.get(name, '--' + name)} {v}: must be {must}")


def at_least(args, minimum, *names):
    for name in names:
        check(args, name, lambda v: v >= minimum, f"at least {minimum}")


def check_heads(n_embd, n_head):
    if n_embd % n_head:
        raise ValueError(f"--n_embd {n_embd} is not a multiple of --n_head {n_head}: "
                         "each head gets n_embd/n_head dims")


def check_writable(path, flag, folder=True):
    """Fail now rather than after the work: the path (a folder, or a file with folder=False) must
    be creatable, which is tried with a temporary file in its nearest existing folder. Nothing
    is created."""
    if not path:
        raise ValueError(f"{flag} is empty: give a {'folder' if folder else 'file'} path")
    check_name_lengths(path, flag)
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{flag} {path} is a symbolic link to nothing (broken, or a loop): remove it, "
                         "or choose another path")
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
                "the filesystem's NAME_MAX"
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


# -----------------------------------------------------------------------------
# one job per output folder

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


# -----------------------------------------------------------------------------
# user interface


def progress(iterable=None, quiet=False, **kw):
    return tqdm(iterable, disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True, **kw)


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
    is a Ctrl-C; under torchrun, a process whose peer is gone says so in one line (peer_lost). A
    failed run removes the output folders it created and saved nothing in
    (new_folder). stdout closed by its reader (`| head`): a quiet exit (stdout_closed). A script run
    as a program first decides its threads' wait policy (set_wait_policy: maybe re-executed) and has
    malloc keep what it frees (keep_freed_memory)."""
    if main.__module__ == '__main__':
        set_wait_policy()
        keep_freed_memory()
    argv = sys.argv[1:]
    NEW_FOLDERS.clear()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        run_to_the_end(main, argv, resume_hint)
    finally:
        if main.__module__ == '__main__':  # the process ends now (not a test calling run_main)
            signals_end_quietly()


def signals_end_quietly():
    """The script's work and its line are over: a SIGTERM or Ctrl-C while the interpreter exits
    (torchrun ending the survivors of a failed rank as its atexit callbacks run) ends the process
    with the signal's status, not a KeyboardInterrupt traceback out of an atexit callback."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))


def run_to_the_end(main, argv, resume_hint):
    """main(argv) with run_main's handling of how it ends."""
    try:
        main(argv)
    except BrokenPipeError as e:
        remove_new_folders()
        if e.filename is not None:  # a file, not stdout: one line, as any OSError
            one_line_error()
        stdout_closed()
    except (ValueError, OSError, torch.OutOfMemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not peer_lost(e):
            raise
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


def peer_lost(e):
    """A collective that failed under torchrun because another process of the job is gone (killed,
    or stopped by its own error): gloo's reset or closed connection, NCCL's aborted communicator."""
    return int(os.environ.get('WORLD_SIZE', 1)) > 1 and any(
        s in str(e) for s in ('Connection reset by peer', 'Connection closed by peer', 'NCCL'))


def one_line_error():
    """The exception being handled, as one `error:` line and exit status 1."""
    e = sys.exc_info()[1]
    if isinstance(e, RuntimeError):  # peer_lost
        sys.exit(f"error: rank {os.environ.get('RANK', 0)}: another process of this torchrun job stopped "
                 f"(see its own line, or the signal that killed it); rerun the command (with --resume where "
                 f"a checkpoint was saved)")
    if isinstance(e, ValueError) and int(os.environ.get('RANK', 0)) > 0:
        wait_for_rank_0()
    if isinstance(e, torch.OutOfMemoryError):
        sys.exit("error: out of GPU memory: lower the batch size (--batch_size, --chunk or --max_rows)")
    sys.exit(f"error: {os_error_text(e) if isinstance(e, OSError) else e}")

"""
What the two trainers (train_lm.py, nce_train.py) share besides their loop: the flags, their
checks and --resume's, the output folder (RunDir: one job, log.jsonl, results.json, the progress
bar), and the lines of a diverged or interrupted run.
"""

import json
import os
import sys
import time

from plumbing.device import check_compiler
from plumbing.files import checked_load, checkpoint_iter, finite, save_checkpoints, write_json, write_text
from plumbing.run import (FLAG_OF, ArgumentParser, check_heads, check_writable, common_flags,
                          lock_folder, new_folder, progress, rerun_command, run_main)


def training_parser(description, out_dir, **defaults):
    """The parser of a trainer, with the flags both share (optimisation, evaluation, system), at
    the trainer's defaults; each adds its own."""
    p = ArgumentParser(description=description)
    a = p.add_argument
    common_flags(p, 'out_dir', help=dict(out_dir='checkpoints, log and results go here'),
                 default=dict(out_dir=out_dir))
    a('--resume', action='store_true', help='continue from out_dir/ckpt.pt (exactly)')
    a('--batch_size', type=int, default=16, at_least=1, at_most='count',
      help='per micro-batch per process: sequences (train_lm.py), positives with their negatives '
           '(nce_train.py)')
    a('--grad_accum', type=int, default=None, at_least=1, at_most=MAX_GRAD_ACCUM,
      help='micro-batches per iteration, summed over processes (default: one per process)')
    a('--max_iters', type=int, at_least=1, at_most='count',
      help='iterations of the run (a cap where it stops early)')
    a('--lr', type=float, above=0, at_most=None, help='peak learning rate')
    a('--min_lr', type=float, at_least=0, at_most=None, help='learning rate at the end of the cosine decay')
    a('--warmup_iters', type=int, at_least=0, at_most='count', help='iterations of linear warm-up')
    a('--lr_decay_iters', type=int, default=None, at_least=1, at_most='count',
      help='end of the cosine decay (default: max_iters)')
    a('--weight_decay', type=float, default=0.1, at_least=0, at_most=None, help='AdamW weight decay')
    a('--beta1', type=float, default=0.9, at_least=0, below=1, help="AdamW's beta1, in [0, 1)")
    a('--beta2', type=float, default=0.99, at_least=0, below=1, help="AdamW's beta2, in [0, 1)")
    a('--grad_clip', type=float, default=1.0, at_least=0, at_most=None,
      help='clip gradients at this norm (0: off)')
    a('--eval_interval', type=int, at_least=1, at_most='count',
      help='evaluate on the selection split, and checkpoint, every this many iterations')
    a('--patience', type=int, default=0, at_least=0, at_most='count',
      help='early stopping: stop once the best selection figure has improved by less than --min_rel_delta '
           'over the last this many evaluations (0: off); best.pt holds the weights of the best')
    a('--min_rel_delta', type=float, default=0.0, at_least=0, at_most=None,
      help='early stopping: the smallest relative improvement that counts (0.001: 0.1%%; 0: any)')
    a('--log_interval', type=int, default=10, at_least=1, at_most='count',
      help='log every this many iterations')
    common_flags(p, 'device', 'deterministic', 'dtype', help=dict(
        dtype="autocast dtype ('auto': bf16 on GPUs from compute capability 8.0, fp16 + GradScaler before; "
              "on a CPU bf16 where it has bf16 units; float16 on a CPU is emulated, slow, for tests)"))
    a('--compile', action='store_true', help='torch.compile the model')
    common_flags(p, 'seed', 'quiet')
    p.set_defaults(**defaults)
    return p


# micro-batches per iteration: nanoGPT's GPT-2 recipe takes 40; beyond this, a mistyped size whose
# iteration would hold its window offsets by the billion and run for days
MAX_GRAD_ACCUM = 2**16


def check_training_flags(args, argv, fixed, saved_flags, load=checked_load, sources=None):
    """Beyond the bounds training_parser declares (each flag's own): heads that divide the
    width, a --patience that can fire within --max_iters, a C++ compiler for --compile on a CPU, and
    --out_dir writable (and removed if the run creates it and then fails before saving anything);
    --lr_decay_iters defaults to --max_iters, --grad_accum to one micro-batch per process. With
    --resume, those given (argv) agree with the checkpoint (check_resume: fixed, saved_flags; load
    reads it, checked), and args.sources = sources(args), the hashes of its inputs, those it recorded."""
    if args.n_embd and args.n_head and not getattr(args, 'match_params', None):  # BALM: width comes later
        check_heads(args.n_embd, args.n_head)
    check_patience(args.patience, args.max_iters, args.eval_interval)
    if args.compile:
        check_compiler(args.device)
    check_writable(args.out_dir, '--out_dir')
    new_folder(args.out_dir, keep=('ckpt.pt', 'best.pt'))  # a run that fails before saving leaves none
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    if args.resume:
        check_resume(args, argv, fixed, saved_flags, load)
    record_sources(args, sources)
    args.grad_accum = micro_batches(args.grad_accum, int(os.environ.get('WORLD_SIZE', 1)))


def record_sources(args, sources):
    """args.sources = sources(args), the hashes of the run's inputs (recorded in ckpt.pt with args),
    checked against those of the run a --resume continues."""
    args.sources = sources(args) if sources else {}
    resumed = vars(args).pop('resumed', None)
    if resumed is not None:
        check_sources(resumed, args, os.path.join(args.out_dir, 'ckpt.pt'))


def check_patience(patience, max_iters, eval_interval):
    """A --patience that can fire within --max_iters."""
    if patience and max_iters < (patience + 1) * eval_interval:
        raise ValueError(f"--patience {patience} can never stop a run of --max_iters {max_iters}: "
                         f"the stopping rule needs {patience + 1} evaluations (--eval_interval "
                         f"{eval_interval}), so `converged: false` would be forced, not measured; raise "
                         f"--max_iters to at least {(patience + 1) * eval_interval} or lower "
                         f"--eval_interval")


# -----------------------------------------------------------------------------
# --resume: the flags given must agree with the run it continues

def given_flags(argv=None):
    """The names of the flags on the command line (argv, or sys.argv), as the run's args (and its
    checkpoint) name them (a renamed flag: its dest, FLAG_OF): what a --resume checks."""
    dest_of = {flag[2:]: dest for dest, flag in FLAG_OF.items()}
    names = {a.split('=')[0][2:] for a in (sys.argv[1:] if argv is None else argv) if a.startswith('--')}
    return {dest_of.get(n, n) for n in names}


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
    out takes the checkpoint's value. A path contradicts only if it names another file, and not at
    all where the checkpoint recorded its content's hash (a copied or moved run: check_sources
    compares the contents)."""
    args.dtype = resumed_dtype(args.dtype, saved.get('dtype'), path)
    given, by_content = given_flags(argv), saved.get('sources') or {}
    for name in sorted(n for n in fixed if n in saved):
        if name not in given:
            setattr(args, name, saved[name])
        elif name not in by_content and not same_value(getattr(args, name), saved[name]):
            raise ValueError(f"{FLAG_OF.get(name, '--' + name)} {getattr(args, name)} contradicts {path} "
                             f"({name} {saved[name]}): "
                             f"--resume continues that {what}; drop the flag, or start a new run in "
                             f"another --out_dir")


def same_value(a, b):
    """a == b, or two paths to one file or folder."""
    if a == b:
        return True
    return (isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b)
            and os.path.samefile(a, b))


def check_resume(args, argv, fixed, saved_flags, load=checked_load):
    """A trainer's --resume continues out_dir/ckpt.pt (read by load): its flags among `fixed` given
    (argv) must agree with saved_flags(checkpoint) (None: not this trainer's kind of checkpoint,
    which its builder then names), and --max_iters not be below its iteration."""
    path = os.path.join(args.out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        raise missing_checkpoint(args.out_dir)
    ckpt = load(path)
    saved = saved_flags(ckpt) if isinstance(ckpt, dict) else None
    args.resumed = ckpt if saved is not None else None  # its inputs checked by content next
    if saved is not None:
        check_resumable(ckpt, path)
        check_resumed_flags(args, argv, saved, fixed, path, 'run')
        check_resumed_iters(args.max_iters, ckpt['iter_num'], path)


RESUMABLE = ('iter_num', 'optimizer', 'scaler', 'args')  # what ckpt.pt holds beyond best.pt's model


def check_resumable(ckpt, path):
    """ckpt.pt holds the training state a --resume continues: not a best.pt (the weights alone)."""
    missing = [k for k in RESUMABLE if k not in ckpt]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)} (a best.pt copied over it?), so --resume "
                         f"cannot continue it: restore the run's own ckpt.pt, or start a new run in another "
                         f"--out_dir")


def check_sources(ckpt, args, path):
    """A --resume reads what its checkpoint was made from, by content: args.sources {flag: hash of
    what the flag names now} against those ckpt's args recorded (a checkpoint from before they
    were: accepted)."""
    recorded = ckpt.get('args', {}).get('sources') or {}
    for flag, digest in args.sources.items():
        if recorded.get(flag, digest) != digest:
            raise ValueError(f"--{flag} {getattr(args, flag)} is not what {path} was trained on (content "
                             f"hash {recorded[flag]} there, {digest} here: another input, or changed since): "
                             f"--resume continues that run on the same inputs; pass those, or start a new "
                             f"run in another --out_dir")


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


def micro_batches(grad_accum, world_size):
    """--grad_accum, the micro-batches of an iteration over all processes: by default one per
    process (nanoGPT scales its accumulation by the world size too), given, a multiple of them."""
    grad_accum = grad_accum or world_size
    if grad_accum % world_size:
        raise ValueError(f"--grad_accum {grad_accum} must be a multiple of the {world_size} processes "
                         f"(left out: one micro-batch per process)")
    return grad_accum


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


# -----------------------------------------------------------------------------
# the output folder of a run

def trim_log(path, iter_num):
    """log.jsonl where a run starts at iter_num (a --resume): the lines a killed attempt wrote after
    that checkpoint are dropped, as the resumed run logs those iterations again (and a line the kill
    cut short)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get('iter', 0) <= iter_num:
                keep.append(json.dumps(rec) + '\n')
    write_text(''.join(keep), path)


class RunDir:
    """A trainer's --out_dir: one job at a time (lock_folder), and a new run (no --resume) replaces
    nothing an earlier one kept there; log.jsonl (rank 0 writes it), the progress bar, the
    throughput of each training line, and results.json."""

    def __init__(self, args):
        lock_folder(args.out_dir)
        if not args.resume:
            check_new_run(args.out_dir)  # best.pt as much as ckpt.pt
        self.path, self.log, self.bar = args.out_dir, None, None

    def start(self, master, iter_num, max_iters, tokens_per_iter, quiet):
        if master:
            os.makedirs(self.path, exist_ok=True)
            trim_log(os.path.join(self.path, 'log.jsonl'), iter_num)
            self.log = open(os.path.join(self.path, 'log.jsonl'), 'a')
        self.tokens_per_iter, self.start_iter, self.last_iter = tokens_per_iter, iter_num, iter_num
        self.t0 = self.t_start = time.time()
        self.bar = progress(total=max_iters, initial=iter_num, quiet=quiet or not master)

    def log_train(self, rec):
        """A training line of log.jsonl (rec: iter, loss, ...), with the tokens/s since the last one."""
        now = time.time()
        rec['tokens_per_s'] = (rec['iter'] - self.last_iter) * self.tokens_per_iter / (now - self.t0)
        self.t0, self.last_iter = now, rec['iter']
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        self._write(rec)

    def log_eval(self, rec, line):
        """An evaluation's line of log.jsonl, and `line` printed (rank 0)."""
        self._write(rec)
        if self.log is not None:
            self.bar.write(line)

    def _write(self, rec):
        if self.log is not None:
            self.log.write(json.dumps(finite(rec)) + '\n')
            self.log.flush()

    def timing(self, iter_num):
        """The seconds this run trained, and its tokens per second."""
        seconds = time.time() - self.t_start
        return dict(train_time_s=seconds,
                    tokens_per_s=(iter_num - self.start_iter) * self.tokens_per_iter / max(seconds, 1e-9))

    def close(self, results=None):
        """The bar and log.jsonl closed; results written to results.json (rank 0)."""
        self.bar.close()
        if self.log is not None:
            self.log.close()
            if results is not None:
                write_json(results, os.path.join(self.path, 'results.json'))

    def learning_curve(self):
        """The selection loss against iterations and tokens seen, from log.jsonl (resumed runs
        included): the convergence evidence that results.json carries."""
        with open(os.path.join(self.path, 'log.jsonl')) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        curve = {r['iter']: dict(iter=r['iter'], tokens=r.get('tokens'), select_loss=r['select_loss'])
                 for r in recs if 'select_loss' in r}
        return [curve[k] for k in sorted(curve)]

    def save(self, state, optimizer, scaler, improved, also=()):
        """ckpt.pt, the state with the optimizer's and scaler's (everything --resume needs); best.pt,
        the state without them, when the selection figure improved; and copies at the names of
        `also`. Saved together (save_checkpoints): the disk is checked for all of them first, and
        ckpt.pt goes in first, so a --resume can always continue."""
        names = (['best.pt'] if improved else []) + list(also)
        save_checkpoints([(dict(state, optimizer=optimizer.state_dict(), scaler=scaler.state_dict()),
                           os.path.join(self.path, 'ckpt.pt'))]
                         + [(state, os.path.join(self.path, name)) for name in names])

    def diverged(self, iter_num, grad_norm):
        return ValueError(diverged(iter_num, grad_norm, self.path))




def run_trainer(main, get_args):
    """run_main for a trainer: its Ctrl-C line says which iteration ckpt.pt holds and the command
    that resumes it."""
    def resume_hint(argv):
        args = get_args(argv)
        path = os.path.join(args.out_dir, 'ckpt.pt')
        return checkpoint_hint(argv, path, args.max_iters, args.eval_interval)
    run_main(main, resume_hint)

"""
The main job's scheduler: stages run like make, one at a time in the terminal or, with --jobs N, N
at a time in the background with a log each. Stage times go to timings.json, their spans (start and
end, seconds since the epoch) to spans.json: the job's wall time is their union (wall_seconds).

"Done" is decided by provenance, not by the presence or age of files: <out_dir>/provenance.json
records, for each stage, what made it (its flags, the run folder written as <out>, and the hashes
of the outputs of the stages it read) and the hashes of its outputs (its done file and best.pt). A
stage is skipped when this run would make it from the same, resumed when it began from the same
and has not finished, and otherwise starts over (its folder kept as <folder>.old, or .old.2, ...: a
folder set aside earlier is never replaced). An output
whose hash is not the recorded one (copied from another run, edited) is refused in one line.
"""

import contextlib
import ctypes
import errno
import os
import re
import signal
import subprocess
import sys
import time

from data import read_json
from plumbing import LOCKS, file_hash, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stages run from the repo root
FIX = 'delete it to rerun its stage'
PROVENANCE = 'provenance.json'
FREE_FLAGS = ('--resume', '--force', '--quiet')  # they change no number


def finished(path):
    """A stage's output exists (a negatives dir's meta.json says it is complete, a data dir's that
    it has the selection split)."""
    if not os.path.exists(path):
        return False
    if not path.endswith('meta.json'):
        return True
    meta = read_json(path, FIX)
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is {type(meta).__name__}, not a meta.json's object: {FIX}")
    return meta.get('complete', True) and 'select' in meta.get('num_tokens', {'select': 0})


def inside(path, folder):
    return os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep)


def stage_flags(cmd, out_dir):
    """A stage's command as far as it changes numbers: FREE_FLAGS left out, and the run folder
    written <out> (a run folder moved or renamed is the same run)."""
    out = re.escape(out_dir)
    return [re.sub(rf'(^|=){out}(?=/|$)', r'\1<out>', c).rstrip('/') or c for c in cmd if c not in FREE_FLAGS]


def flag_values(flags):
    """['x.py', '--seed', '7', '--energy', 'A=a', 'B=b'] -> {'the command': 'x.py', '--seed': '7',
    '--energy': 'A=a B=b'}"""
    values, key = {'the command': []}, 'the command'
    for f in flags:
        if f.startswith('--'):
            key, values[f] = f, []
        else:
            values[key].append(f)
    return {k: ' '.join(v) or '(set)' for k, v in values.items()}


def difference(rec, want):
    """What differs between a stage's record and what this run would make it from, in words
    (None: nothing)."""
    if rec is None:
        return "no record of what made it"
    old, new = flag_values(rec['flags']), flag_values(want['flags'])
    for k in list(new) + [k for k in old if k not in new]:
        if old.get(k) != new.get(k):
            return f"{k} {old.get(k, '(not given)')} -> {new.get(k, '(not given)')}"
    return next((f"stage '{d}' is not the one it was made from (made again since, or the record edited)"
                 for d, h in want['inputs'].items() if rec['inputs'].get(d) != h), None)


def read_records(path):
    """provenance.json: {stage: {'flags': [...], 'inputs': {stage: {path: hash}}, 'outputs': {path:
    hash} or None}} ({} where there is none yet)."""
    if not os.path.exists(path):
        return {}
    records = read_json(path, 'delete it (every stage of the run then starts over)')
    ok = isinstance(records, dict) and all(
        isinstance(r, dict) and isinstance(r.get('flags'), list) and isinstance(r.get('inputs'), dict)
        and isinstance(r.get('outputs'), (dict, type(None))) for r in records.values())
    if not ok:
        raise ValueError(f"{path} is not a table of stage records: delete it (every stage of the run "
                         f"then starts over)")
    return records


def check_chain(out_dir, name):
    """For readers of a run (job.read_report): out_dir/name, where a stage of the job recorded it,
    is the file it wrote, and every stage it was made from, up the chain, is the one the run now
    holds (none made again since). A folder without provenance.json is not checked."""
    records = read_records(os.path.join(out_dir, PROVENANCE))
    path, name = os.path.join(out_dir, name), os.path.normpath(name)
    stage = next((s for s, r in records.items() if name in (r['outputs'] or {})), None)
    if stage is None:
        return
    if os.path.isfile(path) and file_hash(path) != records[stage]['outputs'][name]:
        raise ValueError(f"{path}: not the file stage '{stage}' wrote in this run (copied from another run, "
                         f"or edited: its hash is not the one in {PROVENANCE}); delete it and rerun "
                         f"python -m job.reproduce with this --out_dir")
    todo, seen = [stage], set()
    while todo:
        s = todo.pop()
        seen.add(s)
        for dep, outs in records[s]['inputs'].items():
            if dep in records and records[dep]['outputs'] != outs:
                raise ValueError(f"{path}: made from another '{dep}' than the one in {out_dir} (a mix of two "
                                 f"runs: '{dep}' was made again since); rerun python -m job.reproduce with "
                                 f"this --out_dir: it remakes what is stale")
            if dep in records and dep not in seen:
                todo.append(dep)


class Pipeline:
    """Runs stages in order, like make: a stage is skipped when provenance.json says it was made
    from what this run would make it from (see the module's docstring).

    jobs = 1 (the default): each stage runs in the terminal, one after another, in the order of
    the calls. jobs > 1 (make -j): `run` declares the stage and returns; a stage starts in the
    background once the stages it depends on have ended and a slot is free, the one with the
    longest critical path first (`costs`: seconds per stage, e.g. a measured run's), and writes
    <dir of timings>/<stage>.log on `threads` threads; a `wide` stage (one that would otherwise run
    alone on one thread at the end of the critical path) takes every slot: it starts once nothing
    runs, on jobs x threads, and nothing starts beside it. Its thread count is the stage's, never
    the schedule's. Code that reads a stage's outputs calls wait() first (wait() is also what runs
    the queue)."""

    def __init__(self, timings_path, jobs=1, threads=None, costs=None):
        self.timings_path, self.done, self.folders, self.jobs = timings_path, {}, {}, jobs
        self.threads, self.wide = threads, set()
        self.deps, self.queue, self.costs = {}, {}, costs or {}  # queue: declared, not started
        self.out_dir = os.path.dirname(timings_path) or '.'
        self.timings = read_json(timings_path, 'delete it (it only records stage times) and rerun') \
            if os.path.exists(timings_path) else {}
        if not isinstance(self.timings, dict):
            raise ValueError(f"{timings_path} is not a table of stage times: delete it and rerun")
        self.spans_path = os.path.join(self.out_dir, 'spans.json')
        self.spans = read_json(self.spans_path, 'delete it (it only records stage times) and rerun') \
            if os.path.exists(self.spans_path) else {}
        if not isinstance(self.spans, dict) or not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(t, (int, float)) for t in v)
                for v in self.spans.values()):
            raise ValueError(f"{self.spans_path} is not a table of stage spans: delete it (it only records "
                             f"stage times) and rerun")
        self.records_path = os.path.join(self.out_dir, PROVENANCE)
        self.records = read_records(self.records_path)
        self.running = {}  # stage -> (process, start time, its log or None: the terminal)

    def run(self, name, cmd, done, deps=(), folder=None, wide=False):
        """Declare a stage (cmd: its command, or a function returning it, called once `deps` have
        ended: a command that reads what they wrote). It starts as soon as its deps have ended (a dep
        never declared counts as ended) and a slot is free (wide: every slot; jobs = 1: at once, in
        the terminal, to its end); skipped if done, resumed if half-done and made from the same,
        started over otherwise (its folder kept as .old)."""
        self.done[name], self.folders[name], self.deps[name] = done, folder, tuple(deps)
        if wide:
            self.wide.add(name)
        self.queue[name] = cmd
        self.dispatch()

    def priority(self, name):
        """The stage's critical path: its cost plus the longest chain of costs among the declared
        stages that need it (costs: the job's measured stage seconds; 0 where none is known)."""
        needs = [n for n, d in self.deps.items() if name in d]
        return self.costs.get(name, 0) + max(map(self.priority, needs), default=0)

    def dispatch(self):
        """Starts ready stages (their deps ended) while fewer than `jobs` run: the longest critical
        path first, then the order of declaration (make -j's order, by the path instead of the file);
        a wide stage first waits for the running ones to end, and none starts beside it."""
        while len(self.running) < self.jobs and not self.wide & self.running.keys():
            pending = self.queue.keys() | self.running.keys()
            ready = [n for n in self.queue if not set(self.deps[n]) & pending]
            if not ready:
                return
            name = max(ready, key=lambda n: (self.priority(n), -list(self.queue).index(n)))
            if name in self.wide and self.running:
                return
            self.launch(name, self.queue.pop(name))

    def launch(self, name, cmd):
        """Runs the stage unless done (see run)."""
        cmd, done, deps = cmd() if callable(cmd) else cmd, self.done[name], self.deps[name]
        if not inside(done, self.out_dir):  # the prepared data, shared by runs: used as it is
            if finished(done):
                say(f"[{name}] done already ({done} exists): skipped")
                return
        else:
            want, rec = self.provenance(cmd, deps), self.records.get(name)
            why = difference(rec, want)
            if why is None and finished(done):
                if rec['outputs'] is None:  # it finished, but the job stopped before recording it
                    self.record(name)
                self.check_outputs(name)
                say(f"[{name}] done already ({done}, made from the same inputs): skipped")
                return
            cmd = self.clear(name, cmd, why)
            self.records[name] = dict(want, outputs=None)  # begun: a stop resumes it, if made from the same
            write_json(self.records, self.records_path)
        if self.jobs == 1:  # in the terminal, to its end
            self.start(name, cmd)
            self.wait_one()
            return
        os.makedirs(os.path.dirname(self.timings_path) or '.', exist_ok=True)
        self.start(name, cmd, os.path.join(os.path.dirname(self.timings_path), f'{name}.log'))

    def clear(self, name, cmd, why):
        """The command to run: a stage made from something else (`why`) starts over, its folder
        kept as folder.old (so no --resume); one made from the same (why None) resumes."""
        folder, done = self.folders[name], self.done[name]
        if why and folder and os.path.isdir(folder):
            kept = keep_aside(folder)
            say(f"[{name}] {why} since {folder} was written: kept as {kept}, starting over")
            return [c for c in cmd if c != '--resume']
        if why and os.path.exists(done):
            say(f"[{name}] {why} since {done} was written: making it again")
        return cmd

    def provenance(self, cmd, deps):
        """What a stage is made from: its flags that change numbers, the outputs of its deps."""
        return dict(flags=stage_flags(cmd, self.out_dir), inputs={d: self.outputs(d) for d in deps})

    def outputs(self, name):
        """{path: hash} of a stage's done file, and in its folder the best.pt and the negatives'
        log-probabilities (logp.bin: any other draw, or a damaged file, changes them) (paths in the run
        folder relative to it, so a moved run folder is the same run)."""
        folder = self.folders.get(name)
        files = [self.done[name]] + [os.path.join(folder, f) for f in ('best.pt', 'logp.bin') if folder]
        return {os.path.relpath(f, self.out_dir) if inside(f, self.out_dir) else f: file_hash(f)
                for f in files if os.path.isfile(f)}

    def record(self, name):
        self.records[name]['outputs'] = self.outputs(name)
        write_json(self.records, self.records_path)

    def check_outputs(self, name):
        """A done stage's outputs are the ones it recorded: one line naming a file copied from
        another run or edited since."""
        now, folder = self.outputs(name), self.folders[name] or self.done[name]
        for f, h in self.records[name]['outputs'].items():
            if f not in now:
                raise ValueError(f"{os.path.join(self.out_dir, f)}, which stage '{name}' wrote, is missing; "
                                 f"delete {folder} to rerun that stage")
            if now[f] != h:
                raise ValueError(f"{os.path.join(self.out_dir, f)} is not the file stage '{name}' wrote in "
                                 f"this run (copied from another run, or edited: its hash is not the one "
                                 f"in {self.records_path}); delete {folder} to rerun that stage")

    def start(self, name, cmd, log=None):
        say(f"[{name}] $ python {' '.join(cmd)}" + (f"  > {log}" if log else ''))
        # Ctrl-C is for this process alone: it kills the stages (safe: every write is atomic and every
        # stage resumes) and says the one command that continues, rather than a stage's own
        # the stage holds the job's --out_dir lock too (one open file, one flock): while any process
        # of the job lives, a rerun is refused at the door, even one whose stage outlived a kill -9
        job = os.getpid()
        with open(log, 'w') if log else contextlib.nullcontext() as f:
            proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, env=self.stage_env(name), stdout=f,
                                    stderr=subprocess.STDOUT if log else None, pass_fds=tuple(LOCKS),
                                    preexec_fn=lambda: stage_setup(job))
        self.running[name] = (proc, time.time(), log)

    def stage_env(self, name):
        """jobs > 1: the stage's threads, `threads` (a wide stage: every slot's), from --jobs and the
        declaration alone, never the load (threads change float rounding). jobs = 1: the job's own."""
        if self.jobs == 1:
            return None
        threads = self.threads * (self.jobs if name in self.wide else 1)
        return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED='1')

    def wait(self, *names):
        """Until the stages among `names` (none named: all declared) have ended."""
        names = set(names) or set(self.done)
        while True:
            self.dispatch()
            if not (self.queue.keys() | self.running.keys()) & names:
                return
            if not self.running:  # only a cycle of deps leaves queued stages with none running
                raise RuntimeError(f"stages {sorted(self.queue)} wait for each other: {self.deps}")
            self.wait_one()

    def wait_one(self):
        """Until a running stage ends: its time recorded; if it failed, the others stopped and one line."""
        while not (ended := [n for n, (proc, _, _) in self.running.items() if proc.poll() is not None]):
            time.sleep(0.1)
        name = ended[0]
        proc, t0, log = self.running.pop(name)
        if proc.returncode in (128 + signal.SIGPIPE, -signal.SIGPIPE) and not log:
            # a stage in the terminal (--jobs 1) ended by a closed stdout (`| head`): the job's stdout is
            # the same pipe, so the job ends as the stage did, quietly with status 141 (run_main)
            self.stop()
            raise BrokenPipeError(errno.EPIPE, f"stage '{name}': its stdout, the job's, was closed")
        if proc.returncode != 0:
            self.stop()
            sys.exit(f"error: stage '{name}' failed ({why_failed(proc.returncode, log)}); fix it and rerun: "
                     f"finished stages are skipped")
        if name in self.records:
            self.record(name)
        end = time.time()
        self.timings[name], self.spans[name] = round(end - t0, 1), [round(t0, 1), round(end, 1)]
        write_json(self.timings, self.timings_path)
        write_json(self.spans, self.spans_path)
        if log:
            say(f"[{name}] finished in {self.timings[name]:.0f}s (its output: {log})")

    def stop(self):
        """Kills the running stages (Ctrl-C, a failed stage, an error): none outlives the job."""
        for proc, _, _ in self.running.values():
            proc.kill()
        for proc, _, _ in self.running.values():
            proc.wait()
        self.running.clear()


def keep_aside(folder):
    """Renames folder to the first free name of folder.old, folder.old.2, folder.old.3, ...: a folder
    set aside earlier is never replaced (each holds work: another seed's LM, a finished run's).
    Returns the new name."""
    kept, n = f'{folder}.old', 1
    while os.path.lexists(kept):
        n += 1
        kept = f'{folder}.old.{n}'
    os.rename(folder, kept)  # the name was free a moment ago; a race with another job is kept out by the lock
    return kept


def say(line):
    """The job's diagnostics ("[stage] ..." lines) go to stderr, as a Unix tool's do: stdout is
    for results (the tables of the end), so `| head` or `> file` take those alone."""
    print(line, file=sys.stderr, flush=True)


def wall_seconds(spans):
    """The job's wall time: the length of the union of its stages' [start, end] spans (with --jobs > 1
    they overlap; the pauses of a job stopped and resumed are not counted)."""
    total, reach = 0.0, float('-inf')
    for start, end in sorted(spans.values()):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return round(total, 1)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stage_setup(job):
    """In a stage's process, before it runs: Ctrl-C is the job's alone (it ends the stages and
    says how to continue), and the stage dies with the job (process `job`; a kill -9 of the job
    alone leaves no orphan writing into the run; every write is atomic and every stage resumes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the job's stop() alone
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job:  # the job died between the fork and prctl: no signal will come
        os._exit(1)


def why_failed(returncode, log):
    """How a stage ended: the signal that killed it, else its log's first `error:` line (the
    reason; what follows it is often a consequence), else its log's last line."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else -returncode
        return f"killed by {name}" + (f"; its log: {log}" if log else '')
    if not log:
        return "its message is above"
    with open(log, 'rb') as f:
        lines = [l.strip() for l in re.split(r'[\r\n]', f.read().decode(errors='replace')) if l.strip()]
    error = next((l for l in lines if l.startswith('error:')), None)
    return f"its log {log} says: {error[:300]}" if error else \
        f"its log {log} ends: {lines[-1][:300] if lines else '(nothing)'}"

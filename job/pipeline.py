"""
The main job's scheduler: stages run like make (skipped when done and newer than what they depend
on, resumed when half done), one at a time in the terminal or, with --jobs N, N at a time in the
background with a log each. Stage times go to timings.json.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from data import read_json
from plumbing import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stages run from the repo root
FIX = 'delete it to rerun its stage'


def finished(path):
    """A stage's output exists (a negatives dir's meta.json says it is complete, a data dir's that
    it has the selection split)."""
    if not os.path.exists(path):
        return False
    if not path.endswith('meta.json'):
        return True
    meta = read_json(path, FIX)
    return meta.get('complete', True) and 'select' in meta.get('num_tokens', {'select': 0})


def newest_mtime(folder):
    return max((os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs), default=0)


class Pipeline:
    """Runs stages in order, like make: a stage is skipped when its `done` file exists and is
    newer than the `done` files of the stages it depends on.

    jobs = 1 (the default): each stage runs in the terminal, one after another. jobs > 1 (make -j):
    `run` waits for the stages the new one depends on and for a free slot, starts it in the
    background and returns; it writes <dir of timings>/<stage>.log and runs on `threads` threads.
    Stages start in the order of the calls. Code that reads a stage's outputs calls wait() first."""

    def __init__(self, timings_path, jobs=1, threads=None):
        self.timings_path, self.done, self.jobs = timings_path, {}, jobs
        self.timings = read_json(timings_path, 'delete it (it only records stage times) and rerun') \
            if os.path.exists(timings_path) else {}
        if not isinstance(self.timings, dict):
            raise ValueError(f"{timings_path} is not a table of stage times: delete it and rerun")
        self.running = {}  # stage -> (process, start time, its log or None: the terminal)
        # a stage's threads follow --jobs alone, never the load (threads change float rounding)
        self.env = None if jobs == 1 else dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED='1')

    def run(self, name, cmd, done, deps=(), folder=None):
        """Run the stage unless done. Its folder, if older than what it depends on (a model it
        used was retrained), is kept as folder.old and the stage starts over instead of resuming."""
        self.done[name] = done
        if deps:
            self.wait(*deps)  # with jobs > 1: what it reads is written
        newest_dep = max((os.path.getmtime(self.done[d]) for d in deps), default=0)
        if finished(done) and os.path.getmtime(done) >= newest_dep:
            print(f"[{name}] done already ({done} exists): skipped")
            return
        if folder and os.path.isdir(folder) and newest_mtime(folder) < newest_dep:
            shutil.rmtree(folder + '.old', ignore_errors=True)
            os.replace(folder, folder + '.old')
            print(f"[{name}] its inputs changed since {folder} was written: kept as {folder}.old, "
                  "starting over")
            cmd = [c for c in cmd if c != '--resume']
        if self.jobs == 1:  # in the terminal, to its end
            self.start(name, cmd)
            self.wait(name)
            return
        while len(self.running) >= self.jobs:
            self.wait_one()
        os.makedirs(os.path.dirname(self.timings_path) or '.', exist_ok=True)
        self.start(name, cmd, os.path.join(os.path.dirname(self.timings_path), f'{name}.log'))

    def start(self, name, cmd, log=None):
        print(f"[{name}] $ python {' '.join(cmd)}" + (f"  > {log}" if log else ''), flush=True)
        # Ctrl-C is for this process alone: it kills the stages (safe: every write is atomic and every
        # stage resumes) and says the one command that continues, rather than a stage's own
        with open(log, 'w') if log else contextlib.nullcontext() as f:
            proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT if log else None,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.running[name] = (proc, time.time(), log)

    def wait(self, *names):
        """Until the running stages among `names` (none named: all) have ended."""
        while self.running.keys() & set(names or self.running):
            self.wait_one()

    def wait_one(self):
        """Until a running stage ends: its time recorded; if it failed, the others stopped and one line."""
        while not (ended := [n for n, (proc, _, _) in self.running.items() if proc.poll() is not None]):
            time.sleep(0.1)
        name = ended[0]
        proc, t0, log = self.running.pop(name)
        if proc.returncode != 0:
            self.stop()
            where = f"its log {log} ends: {last_line(log)}" if log else "its message is above"
            sys.exit(f"error: stage '{name}' failed ({where}); fix it and rerun: finished stages are skipped")
        self.timings[name] = round(time.time() - t0, 1)
        write_json(self.timings, self.timings_path)
        if log:
            print(f"[{name}] finished in {self.timings[name]:.0f}s (its output: {log})", flush=True)

    def stop(self):
        """Kills the running stages (Ctrl-C, a failed stage, an error): none outlives the job."""
        for proc, _, _ in self.running.values():
            proc.kill()
        for proc, _, _ in self.running.values():
            proc.wait()
        self.running.clear()


def last_line(log):
    """The last line a stage wrote to its log (progress bars' carriage returns count as line ends)."""
    with open(log, 'rb') as f:
        f.seek(max(0, os.path.getsize(log) - 4096))
        lines = [l.strip() for l in re.split(r'[\r\n]', f.read().decode(errors='replace')) if l.strip()]
    return lines[-1][:300] if lines else '(nothing)'

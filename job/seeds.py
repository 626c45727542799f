"""
The addition table over seeds: every model trained again at each seed on the same data, its
accuracy.json (extensions/addition_eval.py) read from each run, and per row the exact match at each
seed, their mean and spread (the sample SD over seeds); then the decoders of job.claims compared
on all seeds at once. A problem is the unit (the seeds share the problems): per problem, the
difference of the two decoders' exact matches averaged over the seeds, a paired t-test over
problems, Holm (1979) over the comparisons; McNemar's exact p at each seed beside it. Then the
seed as the unit (seed_level): the per-seed differences t-tested over seeds (df = seeds - 1) and by
the exact sign test, each with Holm over the family: what holds whatever the training seed.

    python -m job.seeds --seeds 1,2,3,4,5,6,7,8,9,10 --jobs 2   # trains each seed, then the table
    python -m job.seeds --seeds 1,2,3,4,5,6,7,8,9,10 --lesson   # the lesson's seeds (minutes each)
    python -m job.seeds --seeds 1,2,3,4,5,6,7,8,9,10 --lesson --digits 6   # the method alone, 6 digits
    python -m job.seeds out-seeds/seed1 out-seeds/seed2 ...       # the table of runs already made

With --lesson each seed is the lesson (python -m job.lesson --seed S: 4-digit problems, the LM, its
negatives, a UNIT and the accuracy table, a few minutes a seed) instead of the addition job: the
joint model against the LM's decoders, without BALM, RALM, TaiLr or EXO; with --digits 6 the lesson
runs the addition job's own problems, LM, negatives, UNIT and table (job.lesson --digits 6: the method
alone). The seeds share the problems (each job's default --data_seed); the first job prepares them
before another starts.

With --seeds, each seed's job (python -m job.reproduce --data addition --seed S --out_dir
<runs_dir>/seedS, its --jobs and --recipe) runs first, --at_once of them at a time, each on cores //
--at_once threads (on one GPU they share it; on a CPU, 1 with --jobs 2, or a core each: --jobs 1
--at_once 2 on two cores, the same numbers but EXO's, which --jobs 2 runs on both cores), each into
its folder and log (<runs_dir>/seedS.log); a rerun of the same command skips what is done and
resumes what was stopped, as job.reproduce does. Writes the JSON and, beside it, the same as a
table (.txt), and every seed's per-problem outcomes (_outcomes.json.gz), from which the comparisons
can be recomputed; with --plot, exact match by the longest carry chain and by the lookahead
(extensions/carry.py), a PNG.
"""

import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.seeds")
from data import load_meta, read_json
from extensions.carry import carry_lines, plot_carry
from job import ACCURACY, ACCURACY_FIX, decoder_pairs, read_report
from job.configs import SIZE_FLAGS, lesson_recipe, size_flags
from job.pipeline import ROOT
from job.stats import ALPHA, format_log_p, holm, holm_log, mcnemar, p_of, paired, sign_test_log_p
from plumbing import (ArgumentParser, atomic_write, check_writable, comma_ints, common_flags, run_main,
                      write_json, write_text)

POLL_S = 1.0  # how often train_seeds looks for a seed's job that has ended


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('runs', nargs='*',
                   help="the --out_dir of each seed's run of job.reproduce --data addition (or --seeds)")
    p.add_argument('--seeds', type=comma_ints, default=None, at_least=0, at_most=2**63 - 1,
                   help="train these seeds first (job.reproduce --data addition --seed S, or job.lesson "
                        "with --lesson), each into <runs_dir>/seedS: the runs")
    p.add_argument('--runs_dir', default=None, path=True,
                   help="with --seeds: where each seed's run goes (default: out-seeds/, out-seeds-lesson/ "
                        "with --lesson, out-seeds-lesson6/ with --digits 6)")
    p.add_argument('--lesson', action='store_true',
                   help="with --seeds: each seed runs the lesson (python -m job.lesson), not the addition "
                        "job")
    p.add_argument('--digits', type=int, default=4, choices=(4, 6), at_least=4, at_most=6,
                   help="with --lesson: each lesson's --digits (6: the addition job's recipe, the method "
                        "alone)")
    p.add_argument('--jobs', type=int, default=None, at_least=1, at_most=1024,
                   help="with --seeds: each job's --jobs (default: 2; 1 with --lesson, a chain of stages)")
    p.add_argument('--at_once', type=int, default=1, at_least=1, at_most=64,
                   help="with --seeds: seeds trained at a time, each job on cores // --at_once threads "
                        "(OMP_NUM_THREADS; cores: $OMP_NUM_THREADS if set, else torch's default): on 2 "
                        "cores, 2 with --jobs 1 trains two seeds side by side on a core each")
    p.add_argument('--recipe', default='cpu', choices=['cpu', 'gpu'],
                   help="with --seeds: each job's --recipe")
    size_flags(p, "with --seeds, each job's flag")
    p.add_argument('--quick', action='store_true', help="with --seeds: each job's --quick (a smoke test)")
    p.add_argument('--out', default=None,
                   help='the JSON (the table: .txt beside it; default: out/seeds_addition.json, '
                        'out/seeds_lesson.json with --lesson, out/seeds_lesson6.json with --digits 6)')
    p.add_argument('--plot', default=None,
                   help="a PNG of exact match by the problem's longest carry chain and by its lookahead, "
                        "mean over the seeds (needs matplotlib)")
    common_flags(p, 'seed', 'quiet', 'deterministic', help=dict(
        seed='unused: nothing here is random', quiet="with --seeds: each job's --quiet",
        deterministic="with --seeds: each job's --deterministic"))
    args = p.parse_args(argv)
    if args.seeds is not None:
        if args.runs:
            raise ValueError("give either --seeds (trained here) or the runs' folders, not both")
        args.runs_dir = args.runs_dir or 'out-seeds' + '-lesson' * args.lesson + '6' * (args.digits == 6)
        args.jobs = args.jobs or (1 if args.lesson else 2)
        args.runs = [os.path.join(args.runs_dir, f'seed{s}') for s in args.seeds]
    if args.lesson:
        check_lesson_flags(args)
    elif args.digits != 4:
        raise ValueError("--digits is the lesson's (with --lesson); the addition job is 6 digits already: "
                         "drop --digits, or add --lesson")
    lesson = 'lesson' + '6' * (args.digits == 6)
    args.out = args.out or f"out/seeds_{lesson if args.lesson else 'addition'}.json"
    if len(args.runs) < 2:
        raise ValueError(f"{len(args.runs)} run: a spread over seeds needs at least 2 runs' --out_dir")
    check_writable(args.out, '--out', folder=False)
    if args.plot is not None:
        check_writable(args.plot, '--plot', folder=False)
    return args


def check_lesson_flags(args):
    """--lesson trains --seeds with the lesson's recipe: one line naming a flag that says otherwise."""
    recipe = [f'--{f}' for f in SIZE_FLAGS if getattr(args, f)] + ['--recipe gpu'] * (args.recipe == 'gpu')
    if recipe:
        raise ValueError(f"--lesson: {', '.join(recipe)} set the addition job's recipe, not the lesson's; "
                         f"drop them")
    if args.seeds is None:
        raise ValueError("--lesson: it trains the lesson's --seeds; give them, or the runs' folders without "
                         "--lesson")
    try:
        lesson_recipe(args.quick, args.digits)
    except ValueError as e:
        raise ValueError(f'--lesson {e}') from None


def seed_command(args, seed, run):
    """One seed's addition job (or lesson): the models' --seed, the data's default --data_seed (shared)."""
    job = (['job.lesson', '--digits', str(args.digits)] if args.lesson
           else ['job.reproduce', '--data', 'addition', '--recipe', args.recipe])
    return ([sys.executable, '-m', *job, '--seed', str(seed), '--out_dir', run, '--jobs', str(args.jobs)]
            + ['--quick'] * args.quick + ['--quiet'] * args.quiet + ['--deterministic'] * args.deterministic
            + [x for f in SIZE_FLAGS if getattr(args, f)
               for x in (f'--{f}', str(getattr(args, f)))])


def prepared(args):
    """Whether the problems every seed's job shares are prepared (their meta.json): the job's, and with
    --test_problems above its test split the accuracy table's (job.reproduce's accuracy_data). Until
    then one job runs, so that two never prepare the same folder at once."""
    done = lambda data_dir: os.path.exists(os.path.join(ROOT, data_dir, 'meta.json'))
    if args.lesson or not done('data/addition'):
        return done(lesson_recipe(args.quick, args.digits)[1] if args.lesson else 'data/addition')
    n = args.test_problems
    return not n or n <= load_meta(os.path.join(ROOT, 'data/addition'))['num_docs']['test'] or done(
        f'data/addition_test{n}')


def job_env(args):
    """Each seed's job on cores // --at_once threads (OMP_NUM_THREADS), as job.reproduce gives each
    stage cores // --jobs: the jobs at once never hold more threads than the cores."""
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, torch.get_num_threads() // args.at_once)))


def train_seeds(args):
    """Each seed's addition job, --at_once at a time (the next starts as soon as any ends), each into its
    folder and log; one line naming the log of a job that failed (a rerun resumes it)."""
    os.makedirs(args.runs_dir, exist_ok=True)
    todo, running, ready = list(zip(args.seeds, args.runs)), [], False
    while todo or running:
        ready = ready or prepared(args)  # read until the first job has prepared the problems, not after
        while todo and len(running) < (args.at_once if ready else 1):
            seed, run = todo.pop(0)
            cmd = seed_command(args, seed, run)
            print(f"[seed {seed}] $ python {' '.join(cmd[1:])}  > {run}.log", file=sys.stderr, flush=True)
            with open(f'{run}.log', 'w') as log:
                running.append((seed, run, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                            env=job_env(args))))
        ended = [r for r in running if r[2].poll() is not None]
        if not ended:
            time.sleep(POLL_S)
        for seed, run, proc in ended:
            running.remove((seed, run, proc))
            if proc.returncode != 0:
                for *_, other in running:
                    other.kill()
                raise ValueError(f"seed {seed}'s job failed (its log: {run}.log); rerun this command: what "
                                 f"is done is kept, a stopped stage resumes")
            print(f"[seed {seed}] done: {run}", file=sys.stderr, flush=True)


def data_hash(run):
    """The hash of the prepared data that run's LM trained on (its provenance.json)."""
    prov = read_json(os.path.join(run, 'provenance.json'), 'rerun it with python -m job.reproduce')
    return prov.get('lm', {}).get('inputs', {}).get('prepare')


def read_runs(runs):
    """accuracy.json of each run, checked to be of different seeds on the same data and problems."""
    accs = [read_report(run, 'accuracy.json', ACCURACY_FIX, ACCURACY) for run in runs]
    hashes = [data_hash(run) for run in runs]
    if hashes[0] is None or any(h != hashes[0] for h in hashes):
        raise ValueError(f"{', '.join(runs)}: not trained on the same data (their provenance.json's "
                         f"prepared data differ); rerun them with one --data_seed")
    for key in ('split', 'num_prefixes', 'ns'):
        if any(a.get(key) != accs[0].get(key) for a in accs):
            raise ValueError(f"{', '.join(runs)}: their accuracy.json differ in {key}; rerun "
                             f"extensions.addition_eval with the same flags on each")
    seeds = [a.get('seed') for a in accs]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"{', '.join(runs)}: two runs of the same --seed {seeds}; give one run per seed")
    return accs, seeds


def joint_energies(accs):
    """The energy of each seed's joint model, by the folder of accuracy.json's --energy ('bit' or 'unit':
    the job's stronger on the selection split, job.reproduce.stronger_energy); None where not recorded."""
    return [os.path.basename(os.path.dirname(a['energy'])) if a.get('energy') else None for a in accs]


def spread(values):
    values = [float(v) for v in values]
    return dict(per_seed=values, mean=statistics.fmean(values), sd=statistics.stdev(values),
                min=min(values), max=max(values))


def rows_over_seeds(accs):
    """Each row of accuracy.json (model, method, n) with its exact match and P(correct) over seeds."""
    out = []
    for i, row in enumerate(accs[0]['rows']):
        rows = [a['rows'][i] for a in accs]
        if any((r['model'], r['method'], r['n']) != (row['model'], row['method'], row['n']) for r in rows):
            raise ValueError("the runs' accuracy.json list different rows; rerun extensions.addition_eval "
                             "with the same flags on each")
        out.append(dict(model=row['model'], method=row['method'], n=row['n'],
                        exact=spread(r['exact'] for r in rows),
                        **({'p_correct': spread(r['p_correct'] for r in rows)}
                           if all(r.get('p_correct') is not None for r in rows) else {})))
    return out


def comparisons(accs):
    """decoder_pairs over all seeds: the per-problem difference averaged over seeds, t-tested over
    problems, Holm over the family; each seed's McNemar p and difference beside it. Each p-value is
    kept as its log (log_p ...) and as p where a double holds it (p_of: None below 2.2e-308, which
    10,000 problems reach)."""
    out = []
    for what, (m1, c1), (m2, c2) in decoder_pairs(accs[0]):
        a = np.array([acc['per_problem'][m1][c1] for acc in accs], dtype=np.float64)
        b = np.array([acc['per_problem'][m2][c2] for acc in accs], dtype=np.float64)
        per_seed = [mcnemar(x, y) for x, y in zip(a, b)]
        row = paired((a - b).mean(axis=0))
        out.append(dict(row, p=p_of(row['log_p']), what=what, better=[m1, c1], worse=[m2, c2],
                        diff_per_seed=[r['diff'] for r in per_seed],
                        mcnemar_p_per_seed=[p_of(r['log_p']) for r in per_seed],
                        mcnemar_log_p_per_seed=[r['log_p'] for r in per_seed]))
    tested = [r for r in out if r['log_p'] is not None]  # a difference equal on every problem has no t
    for row in out:
        row.update(p_holm=None, log_p_holm=None, holds_holm=None)
    for row, log_p_holm in zip(tested, holm_log([r['log_p'] for r in tested])):
        row.update(p_holm=p_of(log_p_holm), log_p_holm=log_p_holm,
                   holds_holm=bool(row['diff'] > 0) if log_p_holm < math.log(ALPHA) else None)
    return seed_level(out)


def seed_level(out):
    """Each comparison with the seed as the unit: its per-seed differences (diff_per_seed) by a
    paired t over seeds and by the exact sign test (seeds better against seeds worse, ties left
    out), each with Holm over the family. Three seeds cannot pass the sign test (p >= 0.25)."""
    for c in out:
        d = c['diff_per_seed']
        t = paired(d) if len(d) > 1 else {}
        better, worse = sum(x > 0 for x in d), sum(x < 0 for x in d)
        c['seed_level'] = dict(t_p=t.get('p'), t_df=t.get('df'), sign=[better, worse],
                               sign_p=math.exp(sign_test_log_p(better, worse)))
    for key in ('t_p', 'sign_p'):  # Holm over the comparisons with a p (a t needs a spread over seeds)
        tested = [c for c in out if c['seed_level'][key] is not None]
        for c, p_holm in zip(tested, holm([c['seed_level'][key] for c in tested])):
            c['seed_level'][f'{key}_holm'] = p_holm
    return out


def fmt(result):
    seeds = ', '.join(map(str, result['seeds']))
    lines = [f"exact match on {result['split']} ({result['num_prefixes']} problems) at seeds {seeds}: "
             f"mean (SD) [min, max]"]
    if any(result.get('energies') or ()):
        lines.append("the joint model's energy at each seed: " + ', '.join(
            f'{s} {e}' for s, e in zip(result['seeds'], result['energies'])))
    for r in result['rows']:
        e = r['exact']
        lines.append(f"  {r['model']:8s} {r['method']:28s} {e['mean']:.3f} ({e['sd']:.3f}) "
                     f"[{e['min']:.3f}, {e['max']:.3f}]")
    lines.append("decoders compared on every seed: per-problem difference averaged over seeds, paired t over "
                 "problems, Holm")
    for c in result['comparisons']:
        per_seed = ' '.join(f'{d:+.3f}' for d in c['diff_per_seed'])
        p = (f"p {format_log_p(c['log_p'])}  p_holm {format_log_p(c['log_p_holm'])}" if c['log_p'] is not None
             else 'p n/a (the same difference on every problem)')
        lines.append(f"  {c['what']:48s} {c['diff']:+.3f} ({c['se']:.3f})  {p}  per seed {per_seed}")
    lines.append("the seed as the unit: paired t over the per-seed differences, Holm; exact sign test, Holm")
    for c in result['comparisons']:
        s = c['seed_level']
        t = (f"t p {s['t_p']:.2g}, Holm {s['t_p_holm']:.2g}" if s.get('t_p_holm') is not None
             else 't: no spread')
        lines.append(f"  {c['what']:48s} {t}; sign {s['sign'][0]}-{s['sign'][1]} p {s['sign_p']:.2g}, "
                     f"Holm {s['sign_p_holm']:.2g}")
    return '\n'.join(lines + carry_lines(result.get('by_carry_chain'))
                     + carry_lines(result.get('by_lookahead'), 'lookahead')) + '\n'


def mean_by(accs, key):
    """Exact match by the problem's longest carry chain (key 'by_carry_chain') or lookahead
    ('by_lookahead'), mean over seeds of each seed's table (addition_eval's; the seeds share the problems,
    so it is also the mean over seeds and problems): {model: {column: {value: mean}}}, and the count of
    problems at each value; None for runs from before it was recorded."""
    if any(key not in a for a in accs):
        return None
    tables = [a[key]['exact'] for a in accs]
    exact = {model: {col: {int(c): statistics.fmean(t[model][col][c] for t in tables) for c in by}
                     for col, by in cols.items()} for model, cols in tables[0].items()}
    return dict(count={int(c): n for c, n in accs[0][key]['count'].items()}, exact=exact)


def outcomes_path(out):
    return os.path.splitext(out)[0] + '_outcomes.json.gz'


def write_outcomes(accs, seeds, path):
    """Every seed's per-problem outcomes (accuracy.json's per_problem, the problems' carry chains and
    lookahead), each model's parameters and each seed's energy, gzipped JSON: what the comparisons are
    recomputed from (read_outcomes)."""
    data = dict(seeds=seeds, energies=joint_energies(accs), split=accs[0]['split'], ns=accs[0]['ns'],
                carry_chain=accs[0].get('carry_chain'),
                lookahead=accs[0].get('lookahead'),
                params={r['model']: r.get('params') for r in accs[0]['rows']},
                per_problem={str(s): a['per_problem'] for s, a in zip(seeds, accs)})

    def write(tmp):
        with gzip.open(tmp, 'wt') as f:
            json.dump(data, f)
    atomic_write(path, write)


def read_outcomes(path):
    """write_outcomes' file as the accs comparisons() takes: [{'ns', 'per_problem', 'rows'}] in seed
    order, rows holding each model's parameters (decoder_pairs: EXO against BALM at BALM's size)."""
    with gzip.open(path, 'rt') as f:
        data = json.load(f)
    rows = [dict(model=m, params=n) for m, n in data.get('params', {}).items()]
    return [dict(ns=data['ns'], per_problem=data['per_problem'][str(s)], rows=rows) for s in data['seeds']]


def main(argv=None):
    args = get_args(argv)
    if args.seeds is not None:
        train_seeds(args)
    accs, seeds = read_runs(args.runs)
    chains = mean_by(accs, 'by_carry_chain')
    if args.plot and chains is None:
        raise ValueError("--plot: an accuracy.json without carry chains (made before they were recorded): "
                         "rerun that run's job (python -m job.reproduce) to remake it")
    result = dict(runs=args.runs, seeds=seeds, energies=joint_energies(accs), split=accs[0]['split'],
                  num_prefixes=accs[0]['num_prefixes'],
                  rows=rows_over_seeds(accs), comparisons=comparisons(accs), by_carry_chain=chains,
                  by_lookahead=mean_by(accs, 'by_lookahead'))
    table = fmt(result)
    print(table, end='')
    write_json(result, args.out)
    write_text(table, os.path.splitext(args.out)[0] + '.txt')
    write_outcomes(accs, seeds, outcomes_path(args.out))
    if args.plot:
        plot_carry(dict(result, ns=accs[0]['ns'], split=f"{result['split']}, mean over {len(seeds)} seeds"),
                   args.plot)


if __name__ == '__main__':
    run_main(main)

"""
The lesson, the first thing `bash run.sh` shows (about four minutes on an idle 2-core CPU): a
residual energy fixes the sums its language model gets wrong.

4-digit addition, the sum written most-significant digit first (data/addition/prepare.py): a
left-to-right LM must decide each digit of the sum before it has seen the carries from the digits
to its right, while an energy reads the whole line and only has to check it. Five stages, each the
command a user would type (printed before it runs; job/configs.py's LESSON has the sizes):

    prepare 50,000 problems -> the base LM (train_lm.py) -> 16 LM samples of 20,000 training problems,
    NCE's negatives (negatives.py) -> a UNIT energy, a copy of the LM trained by NCE (nce_train.py) ->
    every decoder on 1,000 test problems (extensions/addition_eval.py)

then one table: exact match on the test problems of the LM's decoders (greedy; majority vote and
log-prob rerank of n samples) and of the joint model's among the same n samples (Algorithm 1: one
resampled with probability ∝ exp(-E); the joint mode: argmax log P_LM - E), each compared with the
joint mode on the same problems by McNemar's exact test; and a figure of exact match against n.
Like job.reproduce, a finished stage is skipped and a stopped one resumes.

    python -m job.lesson                  # out-lesson/ (job.reproduce runs it first, into out/lesson)
    python -m job.lesson --quick          # tiny sizes: a test that every stage runs
    python -m job.lesson --digits 6       # the addition job's recipe: 13.2 min, idle 2-core AMD EPYC
"""

import os
import sys
import time
from types import SimpleNamespace

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.lesson")
import torch

from data import load_meta, read_json
from plumbing import (ArgumentParser, common_flags, lock_folder, one_job, rerun_command, run_main, write_json,
                      write_text)

from job.configs import lesson_recipe
from job.pipeline import FIX, ROOT, Pipeline
from job.stages import check_made_with, device_flags, flags, negatives, nce, prepare_command
from job.stats import format_p, mcnemar, mean_se

# the table's rows: (label, the decoder's per-problem column in accuracy.json), at n = the largest n
ROWS = [('LM greedy', 'greedy_exact'),
        ('LM majority vote of n', 'majority_{n}_exact'),
        ('LM log-prob rerank of n', 'rerank_{n}_exact'),
        ('joint model: Algorithm 1 of n', 'a1_{n}_exact'),
        ('joint model: mode of n', 'mode_{n}_exact')]


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('--quick', action='store_true', help='tiny sizes (a test that every stage runs)')
    common_flags(p, 'out_dir', default=dict(out_dir=None), help=dict(
        out_dir='where the stages write (default: out-lesson/; out-lesson6/ with --digits 6, '
                'out-quick-lesson/ with --quick)'))
    common_flags(p, 'seed', 'quiet', 'device', 'deterministic', 'dtype', help=dict(
        quiet='no progress bars in the stages', device='passed to every stage',
        deterministic='passed to every stage', dtype='passed to every stage'))
    p.add_argument('--data_dir', default=None,
                   help='where the problems are prepared (default: data/lesson; data/addition with '
                        '--digits 6, data/lesson_quick with --quick)')
    p.add_argument('--data_seed', type=int, default=1337, at_least=0, at_most=2**63 - 1,
                   help="the seed of the problems drawn (apart from --seed, the models')")
    p.add_argument('--jobs', type=int, default=1, at_least=1, at_most=1024,
                   help='stages run at once, like make -j (the lesson is a chain: 1 is as fast)')
    p.add_argument('--digits', type=int, default=4, choices=(4, 6), at_least=4, at_most=6,
                   help="6: the addition job's problems, LM, negatives, UNIT and accuracy table (its own "
                        "recipe: the method alone, without its baselines and EXO; docs/addition.md)")
    args = p.parse_args(argv)
    _, data_dir = lesson_recipe(args.quick, args.digits)  # one line if the two flags disagree
    default_out = 'out-quick-lesson' if args.quick else 'out-lesson' + '6' * (args.digits == 6)
    args.out_dir = args.out_dir or default_out
    args.data_dir = args.data_dir or data_dir
    return args


@one_job  # --out_dir's lock released however main ends
def main(argv=None):
    args = get_args(argv)
    lock_folder(os.path.join(ROOT, args.out_dir), '--out_dir')
    run(args, args.out_dir, args.data_dir)


def run(args, out, data_dir):
    """The lesson's stages into `out` on the problems prepared into `data_dir` (args: quick, digits, seed,
    data_seed, device, dtype, quiet, jobs), then its table (printed, and lesson.json / lesson.txt in
    `out`)."""
    cfg, _ = lesson_recipe(args.quick, args.digits)
    path = lambda *a: os.path.join(out, *a)
    pipe = Pipeline(path('timings.json'), args.jobs, threads=max(1, torch.get_num_threads() // args.jobs))
    common = ['--seed', str(args.seed)] + (['--quiet'] if args.quiet else [])
    precision = device_flags(args) + ['--dtype', args.dtype]

    def stage(name, cmd, done, deps=(), folder=None):
        pipe.run(name, cmd + common + precision, done, deps, folder)

    t0 = time.time()
    try:
        prep = SimpleNamespace(data='addition', data_dir=data_dir, cfg=cfg, data_seed=args.data_seed,
                               quiet=args.quiet, tokenizer='char')  # job.reproduce's own check and command
        if os.path.exists(os.path.join(data_dir, 'meta.json')):
            check_made_with(prep, load_meta(data_dir))  # never problems drawn with other flags
        pipe.run('prepare', prepare_command(prep), os.path.join(data_dir, 'meta.json'))
        pipe.wait('prepare')
        resume = ['--resume'] if os.path.exists(path('lm', 'ckpt.pt')) else []
        stage('lm', ['train_lm.py', '--data_dir', data_dir, '--out_dir', path('lm')] + flags(cfg['lm'])
              + resume,
              path('lm', 'results.json'), ['prepare'], path('lm'))
        lm, neg = path('lm', 'best.pt'), cfg['neg']
        negatives(stage, path, lm, neg, 'neg', neg['train_prefixes'], neg['select_prefixes'], ['lm'])
        nce(stage, path, 'unit', lm, 'neg', lm, cfg['unit'], ['lm'])
        pipe.run('addition_eval', ['-m', 'extensions.addition_eval', '--lm', lm,
                                   '--energy', path('unit', 'best.pt'), '--out', path('accuracy.json'),
                                   '--plot', path('fig_lesson.png'), '--force', '--quiet']
                 + flags(cfg['accuracy']) + common[:2] + device_flags(args),
                 path('accuracy.json'), ['lm', 'unit'])
        pipe.wait()
    finally:
        pipe.stop()
    table = lesson_table(read_json(path('accuracy.json'), FIX))
    write_json(dict(table, seconds=round(time.time() - t0, 1), seed=args.seed, data_seed=args.data_seed),
               path('lesson.json'))
    text = format_lesson(table)
    write_text(text + '\n', path('lesson.txt'))
    print('\n' + text + f"\n-> {path('lesson.json')}, figure {path('fig_lesson.png')}", flush=True)
    return table


def lesson_table(acc):
    """The lesson's rows from addition_eval's per-problem outcomes at the largest n: each decoder's
    exact match and its standard error, and McNemar's exact test of the joint mode against it (the
    same problems, the same n samples); Algorithm 1 against the LM's greedy sum too."""
    n, per = max(acc['ns']), acc['per_problem']
    col = lambda key: per['JOINT' if key[:2] in ('a1', 'mo') else 'BASE LM'][key.format(n=n)]
    mode = col('mode_{n}_exact')
    rows = []
    for label, key in ROWS:
        test = mcnemar(mode, col(key))
        rows.append(dict(decoder=label, column=key.format(n=n), exact=sum(col(key)) / len(mode),
                         exact_se=mean_se(col(key))['se'],
                         mode_minus=test['diff'], p=test['p'], discordant=test['discordant']))
    a1_vs_greedy = mcnemar(col('a1_{n}_exact'), col('greedy_exact'))
    oracle = sum(col('oracle_{n}_exact')) / len(mode)
    return dict(n=n, num_prefixes=len(mode), split=acc['split'], rows=rows, any_of_n=oracle,
                a1_minus_greedy=a1_vs_greedy['diff'], a1_vs_greedy_p=a1_vs_greedy['p'])


def format_lesson(t):
    lines = [f"The lesson: exact sums on {t['num_prefixes']:,} held-out {t['split']} problems, "
             f"n = {t['n']} LM samples each (McNemar's exact test, paired by problem)",
             f"{'decoder':<32} {'exact (SE)':>15} {'mode minus it':>14} {'p':>9}"]
    for r in t['rows']:
        versus = '' if r['column'].startswith('mode') else f"{r['mode_minus']:>+14.3f} {format_p(r['p']):>9}"
        label = r['decoder'].replace('of n', f"of {t['n']}")
        lines.append(f"{label:<32} {r['exact']:>8.3f} ({r['exact_se']:.3f}) {versus}".rstrip())
    lines.append(f"any of the {t['n']} LM samples correct: {t['any_of_n']:.3f}; Algorithm 1 minus LM greedy: "
                 f"{t['a1_minus_greedy']:+.3f} (p {format_p(t['a1_vs_greedy_p'])})")
    return '\n'.join(lines)


def resume_hint(argv):
    return f"finished stages are kept and a stopped one resumes; continue with: {rerun_command(argv)}"


if __name__ == '__main__':
    run_main(main, resume_hint)

"""
The main job: the paper's Table 1 on the bundled Shakespeare corpus, end to end, on a CPU, after
the lesson (job/lesson.py: minutes, into <out_dir>/lesson; --skip_lesson leaves it out).

    prepare -> BASE LM -> BALM -> MLM pretraining of the BIT body -> negatives (train, select) ->
    JOINT BIT (NCE) -> JOINT UNIT (NCE) -> RALM and a TaiLr LM (each LM early-stopped on the selection
    split) -> the talk's metric energy (Ji et al., ICLR 2024) -> joint PPL of every model on val and
    test (Eq. 4), the bounds' calibration against many samples, per-step PPL (Eq. 5) and the
    bounds as n grows -> joint samples and analyses -> the paper's claims C1-C7 and the talk's
    T1-T3 measured (claims.py) -> figures

Each stage is the command a user would type (printed before it runs); the recipes are in
job/configs.py, the scheduler in job/pipeline.py. Like make, but by content: a stage made from
what this run would make it from (its number-changing flags, the hashes of what it read, recorded
in <out_dir>/provenance.json) is skipped, a half-done one resumes, and one made from anything else
(another --seed, a retrained model) starts over, its old folder kept as <folder>.old (.old.2, ...: never
replaced); an output
copied from another run or edited is refused in one line. Everything
lands in --out_dir: checkpoints, results.json (one row per model and split), claims.json, the
figures, and timings.json. --ordering adds Fig. 4: each snapshot of the base LM along its
training with its own negatives and BIT, beside BALM at the same step.

--jobs N (like make -j; on a GPU the stages share it; default 1, 2 with --quick): a stage starts as
soon as those it depends on have ended and fewer than N run, the one heading the longest chain of
measured stage times first (job.configs.STAGE_SECONDS: the critical path LM -> negatives -> energies
-> EXO before the baselines), each on cores // N threads (OMP_NUM_THREADS; the lesson, first, and
the chain's last long stage, the addition job's EXO or Shakespeare's Table 1, run alone on every
core: wide), its output in <out_dir>/<stage>.log; the terminal gets each command and one line as it
ends (--jobs 1: each stage in the terminal, on every core). A failed stage stops the others and
names its log; Ctrl-C stops them all. Threads change float rounding, so a stage's thread count
follows --jobs and the cores, never timing: the numbers depend on them (on 2 cores, --jobs 2 gives
those of OMP_NUM_THREADS=1 --jobs 1 but for the wide stages' and what reads them), never on the
schedule.

    python -m job.reproduce                      # 46-58 min on an idle 2-core AMD EPYC with bf16 (README)
    python -m job.reproduce --quick              # 91 s there, tiny models: the CI smoke test
    python -m job.reproduce --jobs 2             # two stages at a time, each on half the cores
    python -m job.reproduce --quick --tokenizer gpt2   # the paper's BPE through every stage, tiny
    python -m job.reproduce --data addition      # a task with a known answer, and EXO (docs/addition.md)
"""

import importlib.util
import os
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.reproduce")
import torch

from data import load_meta, problem_windows, read_json
from job import NUMBER, read_report
from energy import Energy
from model import GPT, GPTConfig
from plumbing import (ArgumentParser, check_compiler, check_writable, common_flags, lock_folder, one_job,
                      pick_device, rerun_command, run_main, write_json)

from job.configs import (ADDITION, ADDITION_QUICK, DEFAULT, QUICK, QUICK_GPT2, RELATIVE_TIME, STAGE_SECONDS,
                         SIZE_FLAGS, large_batch, size_flags)
from job.pipeline import FIX, ROOT, Pipeline, wall_seconds
from job.stages import check_made_with, device_flags, flags, negatives, nce, prepare_command


def lm_params(lm, vocab_size):
    """Parameters of the base LM (train_lm.py's count, on the meta device): BALM's target needs no
    trained LM, so BALM may train beside it (--jobs)."""
    with torch.device('meta'):
        return GPT(GPTConfig(**{k: lm[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size')},
                             vocab_size=vocab_size)).num_params()


def energy_params(lm, vocab_size):
    """Parameters of an energy of the LM's shape (counted on the meta device), the largest one here
    (UNIT's): BALM's target is LM + this."""
    with torch.device('meta'):
        cfg = GPTConfig(**{k: lm[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size')},
                        vocab_size=vocab_size + 1, causal=False)
        return Energy(cfg).num_params()


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument('--quick', action='store_true',
                   help='tiny models and budgets (a smoke test of every stage)')
    p.add_argument('--ordering', action='store_true',
                   help="also Fig. 4: BALM's and JOINT BIT's gains over the base LM along its training "
                        "(~15 min more)")
    p.add_argument('--tokenizer', default='char', choices=['char', 'gpt2'],
                   help="gpt2: the paper's BPE (with --quick: tiny models, a test of the path; "
                        "data in data/shakespeare_gpt2)")
    p.add_argument('--data', default='shakespeare', choices=['shakespeare', 'addition'],
                   help='the corpus prepared and its sizes (addition: docs/addition.md)')
    common_flags(p, 'out_dir', default=dict(out_dir=None), help=dict(
        out_dir='default: out/ (out-quick/, out-quick-gpt2/ with --quick; out-addition/, out-quick-addition/ '
                'for --data addition)'))
    p.add_argument('--data_dir', default=None,
                   help='default: data/shakespeare (data/shakespeare_gpt2 for gpt2), data/addition')
    common_flags(p, 'seed', 'quiet', 'device', 'deterministic', 'dtype', help=dict(
        quiet='no progress bars in the stages', device='passed to every stage',
        deterministic='passed to every stage that takes --device',
        dtype="passed to every stage that takes it ('auto': each chooses from the hardware and its models' "
              "width, never from a timing); addition_eval runs in fp32, as EXO's evaluations"))
    p.add_argument('--data_seed', type=int, default=1337, at_least=0, at_most=2**63 - 1,
                   help="the seed of the data's preparation (splits, addition's problems), apart from --seed "
                        "(the models'), so that runs at several seeds train and test on the same data")
    p.add_argument('--recipe', default='cpu', choices=['cpu', 'gpu'],
                   help="gpu (with --data addition): the energies' batches 4x for half the steps, as a "
                        "GPU wants (job/configs.py large_batch; docs/addition.md): a recipe of its own")
    size_flags(p, 'with --data addition')
    p.add_argument('--jobs', type=int, default=None, at_least=1, at_most=1024,
                   help="stages run at once, like make -j (on a GPU: sharing it). 1 (the default): one "
                        "after another, each on every core, in the terminal; 2 with --quick, whose tiny "
                        "stages are bound by process starts, not arithmetic (measured: docs/reports.md). "
                        "N > 1: a stage starts once those it needs have ended (the longest chain of stage "
                        "times first), on cores // N threads (OMP_NUM_THREADS; cores: $OMP_NUM_THREADS if "
                        "set, else torch's default; the lesson and the last long stage, the addition job's "
                        "EXO or Shakespeare's Table 1: alone, on every core), its output in <out_dir>/<stage>"
                        ".log. Threads change float rounding: the per-stage count follows --jobs and the "
                        "cores, never timing, so the numbers depend on them, never on the schedule")
    p.add_argument('--compile', action='store_true',
                   help="passed to the trainers (train_lm.py, nce_train.py): torch.compile their models. "
                        "Another rounding, so other models; on a CPU it needs a C++ compiler and was slower "
                        "(docs/reports.md): for a GPU, where their steps are bound by launches")
    p.add_argument('--skip_lesson', action='store_true',
                   help="skip the lesson (python -m job.lesson, into <out_dir>/lesson) that the Shakespeare "
                        "job runs first")
    args = p.parse_args(argv)
    args.lesson = args.data == 'shakespeare' and not args.skip_lesson
    if args.jobs is None:
        args.jobs = min(2, torch.get_num_threads()) if args.quick else 1
    gpt2, add = args.tokenizer == 'gpt2', args.data == 'addition'
    if add and (gpt2 or args.ordering):
        raise ValueError("--data addition is char-level, without --ordering: drop --tokenizer / --ordering")
    if args.recipe == 'gpu' and not add:
        raise ValueError("--recipe gpu is the addition job's (measured there): add --data addition")
    args.cfg = recipe(args, add, gpt2)
    args.out_dir = args.out_dir or default_out_dir(args, add, gpt2)
    args.data_dir = args.data_dir or ('data/addition' if add else
                                      'data/shakespeare_gpt2' if gpt2 else 'data/shakespeare')
    return args


def default_out_dir(args, add, gpt2):
    """out, out-quick, out-addition-gpu, out-addition-lm7000-e16000, ...: a folder a recipe."""
    return ('out' + ('-quick' if args.quick else '') + ('-gpt2' if gpt2 else '')
            + ('-addition' if add else '') + ('-gpu' if args.recipe == 'gpu' else '')
            + (f'-lm{args.lm_max_iters}' if args.lm_max_iters else '')
            + (f'-e{args.energy_max_iters}' if args.energy_max_iters else '')
            + (f'-test{args.test_problems}' if args.test_problems else ''))


def recipe(args, add, gpt2):
    """The stages' settings (job/configs.py) that the flags choose: --quick's, --recipe gpu's, and the
    addition job's sizes: the LM's budget (--lm_max_iters, the cosine ending 500 steps before, as the
    default's), the energies' (--energy_max_iters, the cosine to the end, as the default's) and the
    accuracy table's problems (--test_problems)."""
    cfg = ((ADDITION_QUICK if add else QUICK_GPT2 if gpt2 else QUICK) if args.quick
           else ADDITION if add else DEFAULT)
    if args.recipe == 'gpu':
        cfg = large_batch(cfg)
    for flag in SIZE_FLAGS:
        if getattr(args, flag) is not None and not add:
            raise ValueError(f"--{flag} is the addition job's (measured there): add --data addition")
    if args.lm_max_iters is not None:
        n = args.lm_max_iters
        cfg = dict(cfg, lm=dict(cfg['lm'], max_iters=n, lr_decay_iters=n - 500))
    if args.energy_max_iters is not None:
        cfg = dict(cfg, **{e: dict(cfg[e], max_iters=args.energy_max_iters) for e in ('unit', 'bit')})
    if args.test_problems is not None:
        cfg = dict(cfg, accuracy=dict(cfg['accuracy'], num_prefixes=args.test_problems))
    return cfg


def check_data_dir(args):
    """--data_dir: prepared data of --tokenizer (used as it is), or a folder the Shakespeare
    preparation may write into: new, or holding only what it writes. Never the user's own text."""
    d = os.path.join(ROOT, args.data_dir)
    meta_path = os.path.join(d, 'meta.json')
    if os.path.exists(meta_path):
        meta = load_meta(d)  # one line for a meta.json that is not one (a list, edited, not JSON)
        tokenizer = meta.get('tokenizer')
        if tokenizer != args.tokenizer:
            raise ValueError(f"--data_dir {args.data_dir} holds {tokenizer} data, not --tokenizer "
                             f"{args.tokenizer}: pass the matching --tokenizer, or another --data_dir")
        check_data_kind(args, problem_windows(meta))
        check_made_with(args, meta)
        return
    corpus = os.path.join(ROOT, 'data', args.data)
    if os.path.isfile(os.path.join(d, 'prepare.py')) and os.path.realpath(d) != os.path.realpath(corpus):
        raise ValueError(f"--data_dir {args.data_dir} is another corpus's folder (its prepare.py), where "
                         f"--data {args.data} would prepare its own data: pass the --data of that corpus, "
                         f"or another --data_dir")
    ours = ('prepare.py', '__pycache__', '.bin', '.tmp', '.whl')  # the corpus folder and what it writes
    others = sorted(f for f in os.listdir(d) if not f.endswith(ours)) if os.path.isdir(d) else []
    if others:
        raise ValueError(f"--data_dir {args.data_dir} holds no prepared data but other files "
                         f"({others[0]}): this job would prepare Shakespeare into it. For your own text run "
                         f"python -m data.text.prepare {args.data_dir} --out_dir data/mine, then --data_dir "
                         f"data/mine")
    check_writable(d, '--data_dir')


def check_data_kind(args, windows):
    """Prepared data of the kind --data expects: text for shakespeare, addition problems whose
    windows (problem_windows) are the ones this job's sizes use for addition."""
    where = f"--data_dir {args.data_dir}"
    if args.data != 'addition':
        if windows:
            raise ValueError(f"{where} holds addition problems, not text: pass --data addition, or a "
                             f"--data_dir of text (default data/shakespeare)")
        return
    if not windows:
        raise ValueError(f"{where} holds text, not addition problems (data/addition/prepare.py): pass "
                         f"--data shakespeare, or a --data_dir of addition problems (default data/addition)")
    want = (args.cfg['neg']['prefix_len'], args.cfg['neg']['gen_len'])
    if windows != want:
        digits = lambda w: w[1] - 2
        raise ValueError(f"{where} holds {digits(windows)}-digit problems, but --data addition's sizes are "
                         f"for {digits(want)} digits: prepare them with python -m data.addition.prepare "
                         f"--digits {digits(want)} --out_dir <a new folder>, and pass that --data_dir")


@one_job  # --out_dir's lock released however main ends
def main(argv=None):
    args = get_args(argv)
    device = pick_device(args.device)  # every stage would fail on it
    if args.compile:
        check_compiler(device)  # every trainer would fail on it
    check_data_dir(args)
    lock_folder(os.path.join(ROOT, args.out_dir), '--out_dir')  # one job per folder (checked writable first)
    pipe = Pipeline(os.path.join(args.out_dir, 'timings.json'), args.jobs,
                    threads=max(1, torch.get_num_threads() // args.jobs), costs=STAGE_SECONDS[args.data])
    try:
        if args.lesson:
            lesson(pipe, args)
        stages(args, pipe)
    finally:
        pipe.stop()  # with --jobs > 1: no stage outlives the job (Ctrl-C, an error)


def lesson(pipe, args):
    """The lesson (python -m job.lesson, into <out_dir>/lesson): the energy fixing its LM in minutes, its
    table on screen before the hour of Table 1. Wide with --jobs N: it runs alone first anyway, so on every
    core, and its numbers are those of `python -m job.lesson` (README's table) whatever --jobs."""
    out = os.path.join(args.out_dir, 'lesson')
    pipe.run('lesson', ['-m', 'job.lesson', '--out_dir', out, '--seed', str(args.seed), '--data_seed',
                        str(args.data_seed), '--dtype', args.dtype] + device_flags(args)
             + ['--quick'] * args.quick + ['--quiet'] * args.quiet, os.path.join(out, 'lesson.json'),
             folder=out, wide=True)
    pipe.wait('lesson')
    if args.jobs > 1:  # its output went to its log
        print(open(os.path.join(out, 'lesson.txt')).read(), flush=True)
    print("Next, the paper's Table 1 on Shakespeare (README: 46-58 min on an idle 2-core CPU; Ctrl-C "
          "keeps what is done, and a rerun resumes)\n", flush=True)


def stages(args, pipe):
    """The job's stages, declared in order (--jobs 1: the order they run; --jobs N: by the critical path)."""
    cfg, out = args.cfg, args.out_dir
    path = lambda *a: os.path.join(out, *a)
    common = ['--seed', str(args.seed)] + (['--quiet'] if args.quiet else [])

    def stage(name, cmd, done, deps=(), folder=None, wide=False):  # a script stage: seed, device, dtype
        compiled = ['--compile'] * (args.compile and cmd[0] in ('train_lm.py', 'nce_train.py'))
        pipe.run(name, cmd + common + device_flags(args) + ['--dtype', args.dtype] + compiled, done, deps,
                 folder, wide)

    lm, neg = cfg['lm'], cfg['neg']
    vocab = prepare_data(pipe, args)
    lm_ckpt = path('lm', 'best.pt')  # every later stage uses the LMs' best weights on the selection split

    def train(name, extra, deps, objective='lm', **changes):  # changes: to the LM's flags
        stage(name, ['train_lm.py', '--data_dir', args.data_dir, '--out_dir', path(name),
                     '--objective', objective] + flags(dict(lm, **changes)) + extra + resumed(path(name)),
              path(name, 'results.json'), deps, path(name))

    train('lm', [], ['prepare'])
    print_estimate(pipe.timings, cfg is DEFAULT and args.jobs == 1)
    # BALM and the MLM need the data alone (with --jobs 2 they train beside the LM)
    train('balm', ['--match_params', str(lm_params(lm, vocab) + energy_params(lm, vocab))], ['prepare'],
          **cfg['balm'])
    # the BIT body (smaller than the UNIT) is pretrained as a masked LM on the corpus, from scratch
    train('mlm', ['--final_eval', '0'], ['prepare'], objective='mlm', **cfg['mlm'])
    negatives(stage, path, lm_ckpt, neg, 'neg', neg['train_prefixes'], neg['select_prefixes'], ['lm'])
    for kind, init in (('bit', 'mlm'), ('unit', 'lm')):
        nce(stage, path, kind, lm_ckpt, 'neg', path(init, 'best.pt'), cfg[kind], [init])

    def script(name, cmd, done, deps, folder=None, wide=False, dtype=False):  # seed, device; --dtype if asked
        pipe.run(name, lambda: cmd() + common + device_flags(args) + ['--dtype', args.dtype] * dtype,
                 done, deps, folder, wide)

    if 'exo' in cfg:  # the energy folded back into an LM (extensions/exo.py): one more LM in Table 1
        exo(script, path, lm_ckpt, neg, cfg)
    train('ralm', ['--residual_of', lm_ckpt], ['lm'], **cfg['residual'])
    train('tailr', ['--init_from', lm_ckpt], ['lm'], objective='tailr', **cfg['tailr'])
    # the talk's metric energy, where the config fits one
    metric = metric_energies(stage, path, lm_ckpt, neg, cfg['metrics']) if 'metrics' in cfg else []
    evaluate(stage, path, lm_ckpt, neg, cfg, metric, [f"EXO={path('exo', 'best.pt')}"] * ('exo' in cfg))
    if 'accuracy' in cfg:  # before the claims: its decoders' paired tests are claims (D1, ...)
        accuracy(script, path, lm_ckpt, cfg, accuracy_data(pipe, args))
    pipe.run('claims', ['-m', 'job.claims', '--out_dir', out, '--seed', str(args.seed)], path('claims.json'),
             ['estimate_ppl', 'samples', 'samples_untruncated'] + ['addition_eval'] * ('accuracy' in cfg))
    if args.ordering:
        ordering(stage, pipe, path, args, cfg)
    figures(pipe, out, args)
    pipe.wait()
    report(out, pipe.timings, wall_seconds(pipe.spans), args.data_dir)
    if readme_run(args):
        publish(out)


def prepare_data(pipe, args):
    """The corpus prepared from its own seed (--data_seed) and waited for: its vocabulary size."""
    pipe.run('prepare', prepare_command(args), os.path.join(args.data_dir, 'meta.json'))
    pipe.wait('prepare')
    return load_meta(os.path.join(ROOT, args.data_dir))['vocab_size']


def evaluate(stage, path, lm_ckpt, neg, cfg, metric, extra_lm=()):
    """Table 1 and Figs. 1-2 left (estimate_ppl.py: every model on val and test, Eq. 4-5), then
    joint samples and their analyses (sample.py: Figs. 2 right and 3). Where no EXO runs wide at the
    end (Shakespeare), Table 1 is the last long stage, alone once every model is trained: with --jobs N
    it runs wide, on every core (on one thread it left the second core idle for its 536 s)."""
    plug_in = ['-m', 'extensions.run'] if metric else []  # its launcher loads the metric energy
    stage('estimate_ppl', [*plug_in, 'estimate_ppl.py', '--lm', lm_ckpt, '--split', 'val,test',
                           '--energy', f"UNIT={path('unit', 'best.pt')}", f"BIT={path('bit', 'best.pt')}",
                           *metric,
                           '--extra_lm', f"RALM={path('ralm', 'best.pt')}", f"BALM={path('balm', 'best.pt')}",
                           f"TAILR={path('tailr', 'best.pt')}", *extra_lm,
                           '--prefix_len', str(neg['prefix_len']), '--gen_len', str(neg['gen_len']),
                           '--per_step', 'BIT',
                           '--out', path('ppl.json'), '--force'] + flags(cfg['ppl']), path('ppl.json'),
          ['lm', 'balm', 'ralm', 'bit', 'unit', 'tailr'] + (['metrics'] if metric else [])
          + (['exo'] if extra_lm else []), wide=not extra_lm)
    # Figs. 2 right and 3, claims C6 and C7: Algorithm 1 (top-k proposals), and beside it the joint
    # model itself (untruncated proposals: LM samples reweighted by exp(-E))
    for name, top_k in (('samples', []), ('samples_untruncated', ['--top_k', '0'])):
        stage(name, ['sample.py', '--lm', lm_ckpt, '--energy', path('bit', 'best.pt'), '--split', 'test',
                     '--prefix_len', str(neg['prefix_len']), '--gen_len', str(neg['gen_len']), *top_k,
                     '--out', path(f'{name}.json'), '--force'] + flags(cfg['samples']),
              path(f'{name}.json'), ['lm', 'bit'])


NCE_RESULTS = {'held_out_gain': NUMBER, 'held_out_acc': NUMBER, 'held_out_gain_enumerated?': NUMBER}


def stronger_energy(path):
    """'bit' or 'unit': the energy whose joint model gains more on the selection split's held-out
    prefixes (nce_train.py's held_out_gain_enumerated, log Z by energy.logz_enumerate: Eq. 4's
    held_out_gain fails where the energy is sharp): the one EXO distils and the accuracy table uses."""
    res = {k: read_report(os.path.dirname(path(k)), os.path.join(k, 'results.json'), FIX, NCE_RESULTS)
           for k in ('bit', 'unit')}
    gain = {k: r.get('held_out_gain_enumerated', r['held_out_gain']) for k, r in res.items()}
    return max(gain, key=gain.get)


def exo(script, path, lm_ckpt, neg, cfg):
    """EXO (Ji et al., ICML 2024, from the talk): BALM fine-tuned towards the joint model LM + the
    stronger energy (chosen once both have ended) by the reverse KL over K samples per prefix (its
    own, with --on_policy), best.pt chosen on the selection split: compared with BALM at its size.
    The last long stage of the critical path (only the evaluations need it), so with --jobs N it
    runs wide: alone, on every core."""
    script('exo', lambda: ['-m', 'extensions.exo', '--lm', lm_ckpt,
                           '--energy', path(stronger_energy(path), 'best.pt'),
                           '--init_from', path('balm', 'best.pt'),
                           '--prefix_len', str(neg['prefix_len']), '--gen_len', str(neg['gen_len']),
                           '--out_dir', path('exo')] + flags(cfg['exo']) + resumed(path('exo'), ['--force']),
           path('exo', 'results.json'), ['lm', 'bit', 'unit', 'balm'], path('exo'), wide=True, dtype=True)


def resumed(folder, otherwise=()):
    """--resume where a stopped run left its ckpt.pt (the scheduler drops it, and keeps the folder aside,
    when the stage is made from something else), else `otherwise`."""
    return ['--resume'] if os.path.exists(os.path.join(folder, 'ckpt.pt')) else list(otherwise)


def accuracy_data(pipe, args):
    """The accuracy table's data: the job's, or with --test_problems above its test split, the same
    preparation with the extra test problems (data.addition.prepare --extra_test_problems: every other
    split, and the first test problems, as the job's) into <data_dir>_test<N>: (addition_eval's flags,
    the stages it needs)."""
    n = args.cfg['accuracy']['num_prefixes']
    have = load_meta(os.path.join(ROOT, args.data_dir))['num_docs']['test']
    if n <= have:
        return [], []
    out = f'{args.data_dir.rstrip("/")}_test{n}'
    pipe.run('prepare_test', prepare_command(args, out_dir=out) + ['--extra_test_problems', str(n - have)],
             os.path.join(out, 'meta.json'))
    return ['--data_dir', out], ['prepare_test']


def accuracy(script, path, lm_ckpt, cfg, data):
    """The known answer (addition): exact-match and per-digit accuracy and P(correct sum) of every
    model, and of the joint model LM + the stronger energy (chosen once both have ended) by each
    decoder among n LM samples (extensions/addition_eval.py), and its figure, on data: (accuracy_data)."""
    data_flags, deps = data
    script('addition_eval', lambda: ['-m', 'extensions.addition_eval', '--lm', lm_ckpt,
                                     '--energy', path(stronger_energy(path), 'best.pt'),
                                     '--extra_lm', f"BALM={path('balm', 'best.pt')}",
                                     f"EXO={path('exo', 'best.pt')}", f"TAILR={path('tailr', 'best.pt')}",
                                     *data_flags, '--out', path('accuracy.json'),
                                     '--plot', path('fig_accuracy.png'), '--force'] + flags(cfg['accuracy']),
           path('accuracy.json'), ['lm', 'bit', 'unit', 'balm', 'exo', 'tailr'] + deps)


def metric_energies(stage, path, lm_ckpt, neg, mc):
    """The talk's metric energy E = mu . f (metric_ebm.py), fitted on the selection split: on the
    metrics alone (metrics/energy.pt) and with the BIT energy as one more metric (the talk's
    aggregation: energy_aggregate.pt); then the talk's table of decoding methods on test. Returns
    estimate_ppl's --energy entries of the two."""
    stage('metrics', ['-m', 'extensions.metric_ebm', '--lm', lm_ckpt, '--prefix_len', str(neg['prefix_len']),
                      '--gen_len', str(neg['gen_len']), '--energy_metric', f"BIT={path('bit', 'best.pt')}",
                      '--out_dir', path('metrics'), '--table', '--compare', f"BIT={path('bit', 'best.pt')}",
                      '--extra_lm', f"TAILR={path('tailr', 'best.pt')}", '--force']
          + flags(mc), path('metrics', 'results.json'), ['lm', 'bit', 'tailr'])
    return [f"METRICS={path('metrics', 'energy.pt')}",
            f"METRICS+BIT={path('metrics', 'energy_aggregate.pt')}"]


def ordering(stage, pipe, path, args, cfg):
    """Fig. 4: for each snapshot of the base LM (train_lm.py --snapshots) and its best weights,
    that LM's own negatives and BIT, scored on val beside BALM at the same step: the gain of each
    over that base LM as it trains. Writes ordering.json."""
    oc, neg = cfg['ordering'], cfg['neg']
    pipe.wait('lm', 'balm')
    lm_res = read_json(path('lm', 'results.json'), FIX)
    curve = {c['iter']: c['select_loss'] for c in lm_res['curve']}
    steps = [i for i in sorted({int(x) for x in str(cfg['lm'].get('snapshots', '')).split(',') if x})
             if os.path.exists(path('lm', f'iter_{i}.pt')) and i != lm_res['best_iter']]
    names = {}
    for it in steps + [lm_res['best_iter']]:
        tag = 'best' if it == lm_res['best_iter'] else f'iter_{it}'
        lm_ckpt = path('lm', f'{tag}.pt')
        balm = (path('balm', f'iter_{it}.pt') if os.path.exists(path('balm', f'iter_{it}.pt'))
                else path('balm', 'best.pt'))
        name = f'ord_{tag}'
        negatives(stage, path, lm_ckpt, neg, f'{name}_neg', oc['train_prefixes'], oc['select_prefixes'],
                  ['lm'])
        nce(stage, path, 'bit', lm_ckpt, f'{name}_neg', path('mlm', 'best.pt'),
            dict(cfg['bit'], max_iters=oc['bit_iters']), ['mlm'], out_name=f'{name}_bit')
        stage(f'{name}_ppl', ['estimate_ppl.py', '--lm', lm_ckpt, '--split', 'val',
                              '--energy', f"BIT={path(f'{name}_bit', 'best.pt')}",
                              '--extra_lm', f'BALM={balm}',
                              '--prefix_len', str(neg['prefix_len']), '--gen_len', str(neg['gen_len']),
                              '--num_prefixes', str(oc['num_prefixes']),
                              '--num_samples', str(oc['num_samples']),
                              '--calib_prefixes', '0', '--out', path(f'{name}_ppl.json'), '--force'],
              path(f'{name}_ppl.json'), [f'{name}_bit', 'balm'])
        names[it] = name
    pipe.wait(*(f'{name}_ppl' for name in names.values()))
    points = []
    for it, name in names.items():
        rows = {r['model']: r for r in read_json(path(f'{name}_ppl.json'), FIX)['rows']}
        points.append(dict(iter=it, base_select_loss=curve[it], base_ppl=rows['BASE LM']['ppl'],
                           balm_gain=rows['BALM']['gain_nats_per_token'],
                           balm_gain_se=rows['BALM']['gain_se'],
                           joint_gain=rows['JOINT BIT']['gain_nats_per_token'],
                           joint_gain_se=rows['JOINT BIT']['gain_se']))
    write_json(dict(split='val', energy='BIT', num_prefixes=oc['num_prefixes'], num_samples=oc['num_samples'],
                    points=points), path('ordering.json'))
    pipe.done['ordering'] = path('ordering.json')


def figures(pipe, out, args):
    if importlib.util.find_spec('matplotlib') is None:  # run.sh installs it; the core and CI do without
        print("[figures] skipped: matplotlib is not installed (pip install matplotlib, or bash run.sh)",
              file=sys.stderr)
        return
    pipe.run('figures',
             ['-m', 'job.figures', '--out_dir', out]
             + (['--copy_to', 'assets/figures'] if readme_run(args) else []),
             os.path.join(out, 'fig3_loglik.png'), ['claims'] + (['ordering'] if args.ordering else []))


def readme_run(args):
    """The default run into out/: its figures, claims.json and results.json are README's (assets/)."""
    return not args.quick and args.out_dir == 'out' and args.data == 'shakespeare'


def publish(out):
    """README's and docs/reports.md's numbers, copied to assets/ (a test checks README's table
    against them): claims, Table 1 and stage times, the talk's table, Fig. 4's points."""
    for name, to in (('claims.json', 'claims.json'), ('results.json', 'results.json'),
                     (os.path.join('metrics', 'results.json'), 'metrics.json'),
                     ('ordering.json', 'ordering.json')):
        if os.path.exists(os.path.join(out, name)):
            write_json(read_json(os.path.join(out, name), FIX), os.path.join(ROOT, 'assets', to))


def print_estimate(timings, default):
    """Once the LM stage has measured this machine: the whole run's expected duration."""
    if default and 'lm' in timings:
        total = timings['lm'] * sum(RELATIVE_TIME.values())
        print(f"estimated total: ~{total / 60:.0f} min on this machine "
              f"(the LM stage took {timings['lm']:.0f}s; "
              f"README lists each stage's time on its machines)", file=sys.stderr, flush=True)


def stage_profile(out, timings):
    """Per stage: its seconds, its share of the stages' sum and, for a trainer (its results.json
    has tokens_per_s and train_time_s), the tokens it trained on and their rate. With --jobs > 1
    the stages overlap: the shares are of the summed stage time, not of the wall time."""
    total = sum(timings.values()) or 1.0
    rows = []
    for stage, seconds in timings.items():
        path = os.path.join(out, stage, 'results.json')
        r = read_report(out, os.path.join(stage, 'results.json'), FIX) if os.path.isfile(path) else {}
        rate, train_s = r.get('tokens_per_s'), r.get('train_time_s')
        number = lambda v: isinstance(v, (int, float))
        tokens = rate * train_s if number(rate) and number(train_s) else None
        rows.append(dict(stage=stage, seconds=seconds, share=seconds / total, tokens=tokens,
                         tokens_per_s=rate if tokens is not None else None))
    return rows


def format_profile(rows):
    lines = ['stage                 seconds  share  tokens (M)  tokens/s']
    for r in rows:
        tok = f"{r['tokens'] / 1e6:10.1f}  {r['tokens_per_s']:8,.0f}" if r['tokens'] is not None else ''
        lines.append(f"{r['stage']:20s} {r['seconds']:8.1f}  {r['share']:5.1%}  {tok}".rstrip())
    return '\n'.join(lines)


def report(out, timings, wall_s, data_dir):
    """results.json: the Table-1 rows, the calibration of the log Z bounds, the energies' held-out
    gains and NCE accuracies, and the stage times; prints ppl.txt (estimate_ppl.py's table) with them."""
    ppl = read_report(out, 'ppl.json', FIX, dict(rows=[dict(model=str)], splits=dict(test=dict(
        num_samples=NUMBER, num_prefixes=NUMBER))))
    keep = ('model', 'params', 'split', 'ppl', 'ppl_low', 'ppl_high', 'gain_nats_per_token', 'gain_se',
            'ppl_enumerated', 'gain_enumerated', 'gain_enumerated_se', 'eq4_flagged', 'eq4_ess',
            'scored_mass')
    rows = [{k: r[k] for k in keep if k in r} for r in ppl['rows']]
    lm = read_report(out, os.path.join('lm', 'results.json'), FIX, dict(val_loss=NUMBER))
    nce = {k: read_report(out, os.path.join(k, 'results.json'), FIX, NCE_RESULTS) for k in ('bit', 'unit')}
    gain, acc = ({k: r[f'held_out_{f}'] for k, r in nce.items()} for f in ('gain', 'acc'))
    test, profile = ppl['splits']['test'], stage_profile(out, timings)
    write_json(dict(rows=rows, base_lm_val_loss=lm['val_loss'], held_out_gain=gain, held_out_nce_acc=acc,
                    timings_s=timings, wall_s=wall_s, profile=profile,
                    claims=read_report(out, 'claims.json', FIX, dict(claims=dict))['claims'],
                    calibration=test.get('calibration'), num_samples=test['num_samples'],
                    num_prefixes=test['num_prefixes']),
               os.path.join(out, 'results.json'))
    print(f"\nTable 1 ({data_dir}; val and test only reported, the selection split chose best.pt)")
    print(open(os.path.join(out, 'ppl.txt')).read().rstrip())
    print(f"held-out joint gain over the LM (selection split, nats/token): BIT {gain['bit']:.5f}, UNIT "
          f"{gain['unit']:.5f}; NCE accuracy BIT {acc['bit']:.3f}, UNIT {acc['unit']:.3f}")
    print(f"\nWhere the time went: {wall_s / 60:.1f} min wall, {sum(timings.values()) / 60:.1f} min of "
          "stages (stage seconds; with --jobs > 1 they overlap: shares of their sum)\n"
          + format_profile(profile))
    if os.path.exists(os.path.join(out, 'metrics', 'results.txt')):
        print("\nThe talk's metric energy (metric_ebm.py): mu, the moments, "
              "and the decoding methods' metrics\n"
              + open(os.path.join(out, 'metrics', 'results.txt')).read().rstrip())
    print("\nThe paper's claims (claims.py) and the talk's (T1-T3)\n"
          + open(os.path.join(out, 'claims.txt')).read().rstrip())
    print(f"-> {out}/results.json, {out}/claims.json, {out}/ppl.json, {out}/samples.json, "
          f"figures {out}/fig*.png")


def resume_hint(argv):
    return f"finished stages are kept and a stopped one resumes; continue with: {rerun_command(argv)}"


if __name__ == '__main__':
    run_main(main, resume_hint)

"""What several test files share, defined once: running the scripts, tiny models and exact
references, corpora, the flags of the tiny runs. The test files (test_all.py too) import these
helpers by name; the fixtures built from them (the tiny trained checkpoints, each trained once a run,
whichever files run) are in tests/conftest.py, which pytest serves to every file under tests/.
"""

import ast
import contextlib
import copy
import csv
import itertools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from extensions import metrics
from data.text import prepare as text_prepare
from energy import Energy
from model import GPT, GPTConfig
from plumbing import Precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root: the tests run from there
SCRIPTS = os.path.join(ROOT, 'tests', 'scripts')  # the child scripts the tests run, each by its path

torch.set_num_threads(1)  # tiny models gain nothing from threads, and a busy machine makes them spin


# -----------------------------------------------------------------------------
# shared helpers and fixtures (used by more than one section)

# running the scripts

def run_script(args, timeout=300, env=None):
    """Run a python script/module of the repo as a subprocess from the repo root."""
    env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_scripts(arg_lists, timeout=300):
    """run_script for several independent commands at once (they are mostly python start-up)."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    procs = [subprocess.Popen([sys.executable, *a], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for a in arg_lists]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


# the setup's diagnostics, on stderr since issue 57 (item 5): threads, precision, the time estimate
DIAGNOSTIC = re.compile(r"threads: \d+, |[\w ]+: (cpu|cuda[:\d]*|mps), \w+ \(|.*: ~.* by a crude estimate$")


def without_diagnostics(stderr):
    """stderr's lines less the setup's diagnostics (DIAGNOSTIC): the lines a test counts."""
    return [line for line in stderr.strip().splitlines() if not DIAGNOSTIC.match(line)]


def assert_clean_error(res, *fragments):
    """Non-zero exit and exactly one 'error: ...' line on stderr (beside the setup's diagnostics),
    no traceback."""
    lines = without_diagnostics(res.stderr)
    assert res.returncode != 0, res.stdout + res.stderr
    assert len(lines) == 1 and lines[0].startswith('error:'), res.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        recs = [json.loads(l) for l in f]
    losses = {r['iter']: r['loss'] for r in recs if 'loss' in r}
    vals = {r['iter']: r.get('select_loss', r.get('held_out_loss'))
            for r in recs if 'select_loss' in r or 'held_out_loss' in r}
    return losses, vals


# tiny models and exact references

def tiny_gpt(vocab_size=11, block_size=32, std=0.3, seed=0, n_layer=2, n_head=2, n_embd=32, **config):
    """A tiny random GPT in eval mode. Weights are drawn wider than GPT-2's init (std 0.02) so
    that attention and next-token distributions are far from uniform: a test that compares
    distributions must be able to see a wrong one."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                          n_head=n_head, n_embd=n_embd, **config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


def t_log_density(x, df):
    """log of Student's t density with df degrees of freedom at x (an array), in float64: the tests'
    reference for job/stats.py's t tails, integrated by them apart from it."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return log_c - (df + 1) / 2 * np.log1p(np.asarray(x, dtype=np.float64) ** 2 / df)


def logprobs64(model, seqs):
    """float64 log-softmax of the full (uncached) forward: (B, T, V)."""
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        return F.log_softmax(m64(seqs)[0].double(), dim=-1)


def rand_energy(V, seed=2, head_std=2.0, block_size=8, pool='continuation', causal=False):
    """A tiny Energy with random weights everywhere, the head included (it starts at zero, which
    is E = 0). With V = 4 and seed 2 the weights w = exp(-E) of 3-token continuations have a
    relative variance of 0.1-5 depending on the prefix, and the joint model is far from P_LM."""
    torch.manual_seed(seed)
    e = Energy(GPTConfig(block_size=block_size, vocab_size=V, n_layer=1, n_head=2, n_embd=16,
                         causal=causal), pool)
    with torch.no_grad():
        for p in e.body.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
        e.head.weight.normal_(0.0, head_std)
        e.head.bias.fill_(0.3)
    return e.eval()


NULL = contextlib.nullcontext()
FP32 = Precision()  # the two models' autocast (plumbing.Precision): float32


# corpora and checkpoints

def prepare_corpus(dir_, files, tokenizer='char', extra=()):
    """Write {name: text} into dir_/raw and prepare it into dir_/data with data/text/prepare.py."""
    raw = dir_ / 'raw'
    raw.mkdir(parents=True)
    for name, text in files.items():
        (raw / name).write_text(text, encoding='utf-8')
    out = dir_ / 'data'
    text_prepare.main([str(raw), '--out_dir', str(out), '--tokenizer', tokenizer, *extra])
    return str(out)


# the device of the tiny runs: the CPU; job/gpu_check.sh runs the DDP and fp16 tests on a GPU
DEVICE = os.environ.get('REBM_TEST_DEVICE', 'cpu')


TRAIN_FLAGS = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--block_size', '16',
               '--batch_size', '4', '--eval_iters', '2', '--warmup_iters', '2', '--quiet',
               '--print_samples', '0', '--device', DEVICE, '--dtype', 'float32']


CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 60


CPU = ['--quiet', '--device', DEVICE, '--dtype', 'float32']


NEG_FLAGS = ['--prefix_len', '6', '--gen_len', '4', '--num_samples', '3', *CPU]


NCE_FLAGS = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--batch_size', '4', '--warmup_iters', '2',
             '--eval_prefixes', '10', *CPU]


# the flags of the bad-input tests' tiny runs (tests/test_bad_input.py, test_interruptions.py,
# test_full_disk.py): the CPU always, whatever REBM_TEST_DEVICE says
CLI_CPU = ['--device', 'cpu', '--dtype', 'float32', '--quiet']


CLI_TRAIN = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--block_size', '16', '--batch_size', '4',
             '--eval_iters', '2', '--warmup_iters', '2', '--print_samples', '0', *CLI_CPU]


CLI_NEG = ['--prefix_len', '6', '--gen_len', '4', '--num_samples', '3', *CLI_CPU]


CLI_NCE = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--batch_size', '4', '--warmup_iters', '1',
           '--eval_prefixes', '8', *CLI_CPU]


EVAL_P, EVAL_L = 8, 4  # the prefix and continuation lengths of the command-line tests


def ppl_argv(lm, energy, out, *extra):
    return ['--lm', lm, '--energy', f'BIT={energy}', '--split', 'val,test', '--prefix_len', str(EVAL_P),
            '--gen_len', str(EVAL_L), '--num_prefixes', '5', '--num_samples', '8', '--chunk', '2',
            '--device', 'cpu', '--dtype', 'float32', '--quiet', '--out', str(out), *extra]


# ---- negatives ----

def neg_files(d):
    names = ('tokens.bin', 'logp.bin', 'logq.bin', 'pos_logp.bin', 'pos_logq.bin', 'done.bin', 'offsets.npy',
             'meta.json')
    return {f: open(os.path.join(d, f), 'rb').read() for f in names}


# ---- sampling ----

def sample_argv(lm, energy, out):
    return ['--lm', lm, '--energy', energy, '--split', 'test', '--num_prefixes', '3',
            '--prefix_len', str(EVAL_P), '--gen_len', str(EVAL_L), '--num_samples', '6', '--top_k', '5',
            '--candidate_samples', '3',
            '--candidates', '6', '--keep', '4', '--table_k', '3', '--autoregressive',
            '--device', 'cpu', '--dtype', 'float32', '--quiet', '--out', str(out)]


# ---- metric EBM and TaiLr ----

def enumerable_problem(seed=0, B=2, V=3, L=3):
    """Every continuation of length L over V tokens for B prefixes: P_LM and p_data per prefix
    (float64), and K = 3 metrics of each continuation (two of them rep/tr, one random)."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))
    log_p = torch.log_softmax(torch.randn(B, len(seqs), generator=g, dtype=torch.float64), -1)
    p_data = torch.softmax(2 * torch.randn(B, len(seqs), generator=g, dtype=torch.float64), -1)
    f = torch.stack([metrics.repetition(seqs, 1, V), metrics.token_repetition(seqs, 0, 1),
                     torch.randn(len(seqs), generator=g, dtype=torch.float64)], 1)
    return log_p, p_data, f.expand(B, -1, -1).contiguous()


# ---- baselines/pipeline ----

# figures.py draws the paper's figures from the main job's JSON; matplotlib is its own dependency.

def fake_main_job_json(out_dir):
    """A small ppl.json and samples.json with the fields estimate_ppl.py and sample.py write."""
    row = lambda lo, hi: dict(model='JOINT BIT', ppl_low=lo, ppl_high=hi)
    ppl = dict(splits={'test': dict(
        num_prefixes=8, base_ppl=6.5,
        # JSON keys are strings
        sweep={'2': [row(6.30, 6.40)], '4': [row(6.34, 6.43)], '12': [row(6.37, 6.41)]},
        per_step=dict(energy='BIT', num_prefixes=8, step_samples=8, position=[1, 2, 3],
                      base_ppl=[7.0, 6.5, 6.6], joint_ppl_low=[6.8, 6.3, 6.0], joint_ppl_high=[6.9, 6.4, 6.1],
                      last_step_exact_ppl=6.07, gain=[0.03, 0.02, 0.01], gain_se=[0.005, 0.005, 0.01]))})
    rng_ = np.random.default_rng(0)
    recs = [dict(lm_logp=dict(gold=-120 + rng_.normal(), base=-100 + rng_.normal(),
                              joint=-104 + rng_.normal()),
                 gold_energy=rng_.normal() - 1, joint_energy=rng_.normal() - 1, logz=-1.5) for _ in range(12)]
    samples = dict(args=dict(gen_len=64), samples=recs,
                   unique_ngrams=dict(gold=[90, 100, 100, 100], base=[89, 100, 100, None],
                                      joint=[84, 99, 100, 100]))
    claim = dict(diff=0.01, se=0.005, holds=None)
    claims = dict(claims=dict(C4=dict(claim, last_step_gain_exact=0.004, last_step_gain_se=0.006),
                              C5=dict(claim, below_reference=claim, above_reference=claim), C7=claim,
                              # a NaN SE is written as null
                              C6=dict(claim, se=None, prefixes=12, n=[2, 4, 6, 8],
                                      unique_pct=dict(gold=[5, 45, 79, 93], base=[5, 42, 80, 96],
                                                      joint=[5, 43, 80, 95]))))
    for name, obj in (('ppl.json', ppl), ('samples.json', samples), ('claims.json', claims)):
        with open(os.path.join(out_dir, name), 'w') as f:
            json.dump(obj, f)


# ---- human evaluation ----

HE_SAMPLES = [dict(prefix=f'prefix {i}', base=f'base {i}', joint=f'joint {i}', worst=f'worst {i}',
                   gold=f'gold {i}')
              for i in range(8)]


def simulate_votes(items, rater_prefs):
    """Raters read the texts: rater_prefs[rater](i, sides) -> the system name they pick or 'equal'."""
    votes = []
    for rater, pref in rater_prefs.items():
        for it in items:
            sides = {it['A'].split()[0]: 'A', it['B'].split()[0]: 'B'}
            pick = pref(int(it['prefix'].split()[1]), sides)
            votes.append((rater, str(it['item']), 'equal' if pick == 'equal' else sides[pick]))
    return votes


def prefs_good(i, sides):  # joint on prefixes 0-4, equal on 5, base on 6-7; the real text on checks
    if 'gold' in sides:
        return 'gold'
    return 'joint' if i < 5 else 'equal' if i == 5 else 'base'


def prefs_bad(i, sides):  # always the joint model, even over real text: fails the attention checks
    return 'joint'


def prefs_half(i, sides):  # the real text on checks; else joint on even prefixes, base on odd ones
    return 'gold' if 'gold' in sides else 'joint' if i % 2 == 0 else 'base'


def write_samples(path, samples=HE_SAMPLES):
    path.write_text(json.dumps(dict(samples=samples)))
    return str(path)


def exported_votes(out_dir):
    """The exported items.jsonl and the votes of the three simulated raters on it."""
    jsonl = [json.loads(l) for l in (out_dir / 'items.jsonl').read_text().splitlines()]
    for it in jsonl:
        it['item'] = int(it['item'])
    return jsonl, simulate_votes(jsonl, dict(r1=prefs_good, r2=prefs_bad, r3=prefs_half))


HAND_KEY = dict(systems=['joint', 'base'], items={
    **{str(i): dict(A=a, B=b, check=False) for i, (a, b) in enumerate(
        [('joint', 'base'), ('base', 'joint'), ('joint', 'base'), ('joint', 'base'), ('base', 'joint'),
         ('joint', 'base'), ('base', 'joint'), ('joint', 'base'), ('joint', 'base'), ('base', 'joint'),
         ('joint', 'base'), ('joint', 'base')])},
    'c0': dict(A='gold', B='joint', check=True), 'c1': dict(A='base', B='gold', check=True)})


# item: votes of r1, r2, r3 and r4 (A, B, '=' for equal, '_' for none); r4 fails check c0 and is dropped
HAND_VOTES = {'0': 'AAA', '1': 'BBA', '2': 'A=A', '3': 'AB=', '4': 'B==', '5': '===', '6': 'AAB', '7': 'BBB',
              '8': 'A_AB', '9': 'B=_A', '10': '___B', '11': 'AAB', 'c0': 'AAAB', 'c1': 'BBB='}


def hand_votes():
    votes = []
    for item, s in HAND_VOTES.items():
        for rater, c in zip(('r1', 'r2', 'r3', 'r4'), s.ljust(4, '_')):
            if c != '_':
                votes.append((rater, item, 'equal' if c == '=' else c))
    return votes


def write_hand_key_and_votes(d):
    """HAND_KEY and hand_votes() as human_eval.py score reads them: (key.json, votes.csv)."""
    key_path, votes_path = d / 'key.json', d / 'votes.csv'
    key_path.write_text(json.dumps(HAND_KEY))
    with open(votes_path, 'w', newline='') as f:
        csv.writer(f).writerows([('rater', 'item', 'choice'), *hand_votes()])
    return key_path, votes_path


# ---- CLI ----

UNWRITABLE = '/proc/rebm-nowhere'  # no one can create anything under /proc, root included


# ---- each case below is one test id ----

def dir_snapshot(d):
    """{file: (bytes, mtime)} of everything under d: 'nothing was overwritten' is equality."""
    snap = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, 'rb') as fh:
                snap[os.path.relpath(p, d)] = (fh.read(), os.stat(p).st_mtime_ns)
    return snap


# ---- layout ----

def python_files():
    """{path: parsed module} of the repo's tracked .py files (every .py file outside hidden and
    cache folders where this is not a git checkout)."""
    res = subprocess.run(['git', 'ls-files', '*.py'], cwd=ROOT, capture_output=True, text=True)
    paths = res.stdout.split() if res.returncode == 0 else []
    if not paths:
        for root, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith('.') and d != '__pycache__'
                       and not os.path.exists(os.path.join(root, d, 'pyvenv.cfg'))]
            paths += [os.path.relpath(os.path.join(root, f), ROOT).replace(os.sep, '/')
                      for f in files if f.endswith('.py')]
    trees = {}
    for p in sorted(paths):
        with open(os.path.join(ROOT, p), encoding='utf-8') as f:
            trees[p] = ast.parse(f.read(), p)
    return trees


def is_test(path):
    return path == 'test_all.py' or path.startswith('tests/')


# ---- shared by the method's test files ----


# run_ddp_and_single runs each trainer under tests/scripts/ddp_recorder.py: as the process group
# closes it saves the rank's parameters, so that the test sees whether DDP left every rank with the
# same weights; every all_reduce and broadcast must hand over a tensor on the run's device (--device),
# as NCCL requires

def run_ddp_and_single(script, main, flags, tmp_path):
    """Run a trainer with 2 gloo processes and in-process alone (6 iterations, evals at 3 and 6);
    assert their per-iteration train and val losses agree, and that DDP left both ranks with the
    same parameters (ddp_recorder.py saves each rank's). Returns (ddp dir, single dir, the single
    run's results, its train losses)."""
    ddp, single, params = str(tmp_path / 'ddp'), str(tmp_path / 'single'), tmp_path / 'params'
    params.mkdir()
    res = run_script(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                      os.path.join(SCRIPTS, 'ddp_recorder.py'), script, '--out_dir', ddp, *flags],
                     env=dict(PARAMS_DIR=str(params), PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stdout + res.stderr
    assert '2 process(es)' in res.stdout
    p0, p1 = (torch.load(params / f'rank{r}.pt', weights_only=True) for r in (0, 1))
    assert p0.numel() > 0 and torch.equal(p0, p1)  # every rank ends with the same weights
    r1 = main(['--out_dir', single, *flags])
    (ld, vd), (ls, vs) = read_log(ddp), read_log(single)
    assert sorted(ld) == sorted(ls) == list(range(1, 7)) and sorted(vd) == sorted(vs) == [3, 6]
    for it in ls:
        assert abs(ld[it] - ls[it]) < 1e-4, (it, ld[it], ls[it])
    for it in vs:
        assert abs(vd[it] - vs[it]) < 1e-4, (it, vd[it], vs[it])
    return ddp, single, r1, ls


# peaked after token 0, flat after tokens 1 and 3: the top-2 mass depends on the previous token
BIGRAM = [[3.0, 2.0, -2.0, -3.0], [0.3, 0.0, 0.2, 0.1], [-1.0, 0.5, 1.5, 0.2], [0.25, 0.2, -0.1, 0.3]]


# the docs' numbers (tests/test_docs.py, tests/test_doc_results.py)

def read(path):
    """A doc's text with every run of whitespace one space: a number wrapped over two lines still matches."""
    return ' '.join(open(os.path.join(ROOT, path), encoding='utf-8').read().split())


WORDS = {'two': 2, 'three': 3, 'four': 4, 'five': 5}


def number(text):
    return WORDS[text.lower()] if text.lower() in WORDS else float(text.replace(',', ''))


def mismatches(claims, docs, tolerance=1e-9, close=None, table='CLAIMS', source='the code'):
    """Each claim of `claims` whose regex finds nothing in its doc (docs: {doc: its text}), or a value
    other than the code's (relative tolerance; or close(said, value), e.g. rounds_to), as one line."""
    close = close or (lambda s, w: abs(number(s) - w) <= tolerance * w)
    bad = []
    for doc, pattern, want in claims:
        found = re.findall(pattern, docs[doc])
        if not found:
            bad.append(f'{doc}: no text matches {pattern!r}: reword the row of {table} with the doc')
        for said in found:
            said = (said,) if isinstance(said, str) else said
            if not all(close(s, w) for s, w in zip(said, want, strict=True)):
                shown = want if source == 'the code' else [float(f'{w:.6g}') for w in want]
                bad.append(f'{doc}: {pattern!r} says {list(said)}, {source} {shown}')
    return bad


# committed results (assets/*.json) and the docs that state them

def asset(name):
    return json.load(open(os.path.join(ROOT, 'assets', name), encoding='utf-8'))


def by(rows, *keys):
    return {tuple(r[k] for k in keys): r for r in rows}


def rounds_to(said, value):
    """Whether the doc's `said` is `value` to the digits it gives ('0.0013' for 0.00125..., '6,250' for
    6250)."""
    said = said.replace(',', '')
    digits = len(said.split('.')[1]) if '.' in said else 0
    return abs(float(said) - value) <= 0.5 * 10 ** -digits * (1 + 1e-9) + 1e-12


def json_mismatches(claims, docs):
    return mismatches(claims, docs, close=rounds_to, table='JSON_CLAIMS', source='assets/')


def claimed_docs(claims):
    """The text of each doc a claims table names, by its path."""
    return {d: read(d) for d in {c[0] for c in claims}}


def assert_json_claims_hold(claims, at_least):
    """Every row of a claims table from assets/: the doc states the asset's numbers to its digits."""
    assert len(claims) >= at_least
    bad = json_mismatches(claims, claimed_docs(claims))
    assert not bad, '\n'.join(bad)


class Declared:
    """A pipeline that runs nothing: {stage: its command} as declared (a command decided once its deps
    have ended stays a function), up to the job's end (a wait() for every stage: its report not wanted)."""
    class End(Exception):
        pass

    timings, spans = {}, []

    def __init__(self, *args, **kwargs):
        self.cmds = {}

    def run(self, name, cmd, *rest, **kwargs):
        self.cmds[name] = cmd

    def wait(self, *names):
        if not names:
            raise Declared.End

    def stop(self):
        pass


def job_commands(argv=()):
    """{stage: its command} of `python -m job.reproduce argv` as it would print them, without running
    anything (the data's vocabulary stands in as 65 characters; no extra test problems are prepared)."""
    from job import reproduce
    pipe, saved = Declared(), (reproduce.prepare_data, reproduce.print_estimate, reproduce.accuracy_data)
    reproduce.prepare_data, reproduce.print_estimate, reproduce.accuracy_data = (
        lambda pipe, args: 65), (lambda *a: None), (lambda pipe, args: ([], []))
    try:
        reproduce.stages(reproduce.get_args(['--out_dir', 'out', *argv]), pipe)
    except Declared.End:
        pass
    finally:
        reproduce.prepare_data, reproduce.print_estimate, reproduce.accuracy_data = saved
    return pipe.cmds

"""Every script's flags, from their declarations (issue 54 item 4, issue 57 item 1): one vocabulary
(a concept has one flag name, a flag name one concept), help and its default in --help for every
flag, and every number and path bounded where it is declared (plumbing.run.ArgumentParser), probed
with nan, inf, -1, 0 and 10^12 and with '' in-process, without running any script."""

import ast
import glob
import importlib
import math
import os
import subprocess
import sys

import pytest

from plumbing import ArgumentParser, comma_ints, parser_of

from tests.common import ROOT, without_diagnostics

# the scripts with flags, each a module and the function that builds and parses them (argv: [])
SCRIPTS = {
    'train_lm.py': ('train_lm', 'get_args'), 'negatives.py': ('negatives', 'get_args'),
    'nce_train.py': ('nce_train', 'get_args'), 'estimate_ppl.py': ('estimate_ppl', 'get_args'),
    'sample.py': ('sample', 'get_args'),
    'job/bench.py': ('job.bench', 'get_args'), 'job/claims.py': ('job.claims', 'get_args'),
    'job/figures.py': ('job.figures', 'get_args'), 'job/human_eval.py': ('job.human_eval', 'main'),
    'job/reproduce.py': ('job.reproduce', 'get_args'), 'job/seeds.py': ('job.seeds', 'get_args'),
    'job/lookahead.py': ('job.lookahead', 'get_args'), 'job/exo_budget.py': ('job.exo_budget', 'get_args'),
    'job/lesson.py': ('job.lesson', 'get_args'),
    'extensions/addition_eval.py': ('extensions.addition_eval', 'get_args'),
    'extensions/exact_logz.py': ('extensions.exact_logz', 'get_args'),
    'extensions/exo.py': ('extensions.exo', 'get_args'),
    'extensions/metric_ebm.py': ('extensions.metric_ebm', 'get_args'),
    'data/addition/prepare.py': ('data.addition.prepare', 'main'),
    'data/cc_news/prepare.py': ('data.cc_news.prepare', 'main'),
    'data/shakespeare/prepare.py': ('data.shakespeare.prepare', 'main'),
    'data/text/prepare.py': ('data.text.prepare', 'main'),
}
LAUNCHERS = {'extensions/run.py'}  # runs a script of SCRIPTS with that script's own flags

# one name per concept (docs/using.md, "One vocabulary of flags"): concept -> (flag, its type)
VOCABULARY = {
    'LM samples per prefix (the main count)': ('num_samples', int),
    'LM samples per prefix for log Z': ('logz_samples', int),
    'comma-separated sample counts': ('ns', comma_ints),
    'prefixes (problems) taken, evenly spaced': ('num_prefixes', int),
    'prefixes per batch': ('chunk', int),
    'the split (comma-separated where several)': ('split', None),
    'tokens of a prefix': ('prefix_len', int),
    'tokens of a continuation': ('gen_len', int),
    'top-k truncation (0: untruncated)': ('top_k', int),
    'beam width of the known set': ('beam', int),
    'sequences per forward': ('max_rows', int),
    "an energy's checkpoint (NAME=CKPT where several)": ('energy', None),
    "the energy's body (bit | unit)": ('body', None),
    'samples printed at the end': ('print_samples', int),
    "metric_ebm's samples that fit mu": ('fit_samples', int),
    "A.1's LM completions per candidate": ('candidate_samples', int),
}
# the other names the concepts above had (issue 54): none may come back
ALIASES = {'n', 'm', 'K', 'max_prefixes', 'prefixes', 'prompts', 'select_prompts', 'sample_prompts',
           'estimate_prefixes', 'estimate_samples', 'splits', 'check_splits', 'sweep', 'batch', 'prompt_len',
           'new_tokens', 'train', 'val', 'test'}
# the defaults of one concept, the same wherever a script gives one
SHARED_DEFAULTS = {'prefix_len': 128, 'gen_len': 64, 'device': 'auto', 'top_k': {0, 10}}

HUGE = {int: '1000000000000', float: '1e12', comma_ints: '1000000000000'}

# sizes that allocate in proportion (samples, beams, widths, lengths, batches): each declares an
# at_most, so that a mistyped size is refused before the allocator's traceback (issue 57); sample.py's
# --num_samples is drawn in chunks of --max_rows, bounded by its time estimate instead
MEMORY_BOUNDED = {'num_samples', 'logz_samples', 'ns', 'beam', 'fit_samples', 'candidate_samples', 'reps',
                  'eval_samples', 'forward_samples', 'num_neg', 'calib_samples', 'step_samples',
                  'last_step_samples', 'n_embd', 'n_layer', 'n_head', 'block_size', 'prefix_len', 'gen_len',
                  'chunk', 'max_rows', 'grad_accum', 'batch_size', 'context', 'energy_embd', 'matmul_size',
                  'dpi', 'digits', 'train_problems', 'select_problems', 'val_problems', 'test_problems',
                  'extra_test_problems'}
TIME_BOUNDED = {('sample.py', 'num_samples')}


def parsers():
    """{script: its parser}, built in-process (parser_of stops each at its parse_args)."""
    out = {}
    for script, (module, builder) in SCRIPTS.items():
        out[script] = parser_of(getattr(importlib.import_module(module), builder), [])
    return out


PARSERS = parsers()


def commands(parser, prefix=()):
    """(the argv that reaches parser's flags, parser) for it and each subcommand's parser."""
    subs = [a for a in parser._actions if a.__class__.__name__ == '_SubParsersAction']
    if not subs:
        return [(list(prefix), parser)]
    return [c for name, sub in subs[0].choices.items() for c in commands(sub, [*prefix, name])]


def flags():
    """(script, argv of the subcommand, its parser, action) of every declared flag."""
    return [(script, argv, p, a) for script, top in PARSERS.items() for argv, p in commands(top)
            for a in p._actions if a.option_strings and a.dest != 'help']


def parse(script, argv, parser, action, *given):
    """The script's parse of the subcommand argv with parser's required flags filled, and `given`."""
    return PARSERS[script].parse_args(required(parser, argv, action) + list(given))


def required(parser, argv, skip):
    """argv plus placeholders for parser's required flags and positionals (but `skip`)."""
    out = list(argv)
    for a in parser._actions:
        if a is skip or a.dest == 'help':
            continue
        if not a.option_strings:
            out.append('x')
        elif a.required:
            out += [a.option_strings[0], 'x']
    return out


FLAGS = flags()
IDS = [f"{s}:{' '.join(argv)}{' ' if argv else ''}{a.option_strings[0]}" for s, argv, _, a in FLAGS]


def test_every_script_with_flags_is_here():
    """A script added with flags is checked here too: every file with a __main__ block outside
    tests/ is in SCRIPTS (or launches one of them)."""
    scripts = set()
    for path in glob.glob(os.path.join(ROOT, '**', '*.py'), recursive=True):
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(('tests', '.')) or os.sep + '.' in rel:
            continue
        tree = ast.parse(open(path, encoding='utf-8').read())
        if any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body):
            scripts.add(rel)
    assert scripts == set(SCRIPTS) | LAUNCHERS, scripts ^ (set(SCRIPTS) | LAUNCHERS)
    assert len(FLAGS) >= 300, len(FLAGS)


def test_one_vocabulary():
    """No script uses a retired alias; each name of VOCABULARY has one type everywhere; a flag name
    shared by scripts has one type (a count is never a path or a kind); the body kind is --body, and
    --energy is a checkpoint (never a choice among kinds); --pool is only nce_train's positions."""
    used = {}
    for script, _, _, a in FLAGS:
        name = a.option_strings[0][2:]
        assert name not in ALIASES, f"{script}: --{name} is a retired alias (docs/using.md's vocabulary)"
        used.setdefault(name, {})[script] = a
    for concept, (name, kind) in VOCABULARY.items():
        assert name in used, f'{concept}: --{name} is in no script'
        for script, a in used[name].items():
            assert a.type is kind, f'{script}: --{name} ({concept}) is of type {a.type}, not {kind}'
    for name, by_script in used.items():
        kinds = {(a.type, a.nargs == 0) for a in by_script.values()}
        assert len(kinds) == 1, f'--{name} means different things: {by_script}'
        for script, a in by_script.items():
            if name in SHARED_DEFAULTS and not a.required and a.default is not None:
                want = SHARED_DEFAULTS[name]
                assert a.default in (want if isinstance(want, set) else {want}), (script, name, a.default)
    assert all(a.choices is None for a in used['energy'].values())
    assert set(used['pool']) == {'nce_train.py'} and used['pool']['nce_train.py'].choices
    assert used['body']['nce_train.py'].choices == ['bit', 'unit']
    for script, a in used['top_k'].items():  # 0 untruncated, or refused: never a default of None
        lo = PARSERS[script].bounds[a.dest].lo
        assert a.default is not None and lo in (0, 1), (script, a.default, lo)


@pytest.mark.parametrize('script,argv,parser,action', FLAGS, ids=IDS)
def test_help_and_default(script, argv, parser, action):
    """Every flag says what it is, and --help shows its default (a switch: off)."""
    assert action.help and action.help.strip(), f'{script}: {action.option_strings[0]} has no help'
    if action.nargs != 0:
        text = parser._get_formatter()._expand_help(action)
        assert 'default' in text, f'{script}: --help does not show the default of {action.option_strings[0]}'


@pytest.mark.parametrize('script,argv,parser,action', FLAGS, ids=IDS)
def test_numbers_within_their_declared_bounds(script, argv, parser, action):
    """nan, inf, -1, 0 and 10^12 for every number: accepted only within its declared bounds
    (finite, at_least or above, at_most or below), else refused by the parse with one ValueError that
    starts with the flag's name (run_main's `error:` line)."""
    if action.type not in HUGE:
        assert action.dest not in parser.bounds or action.type is None
        return
    flag = action.option_strings[0]
    assert action.dest in parser.bounds, f'{script}: {flag} is a number without declared bounds'
    b = parser.bounds[action.dest]
    assert action.type is float or b.lo is not None, f'{script}: {flag}, a count, declares no at_least'
    if flag[2:] in MEMORY_BOUNDED and (script, flag[2:]) not in TIME_BOUNDED:
        assert b.hi is not None, f'{script}: {flag} allocates in proportion but declares no at_most'
    for text in ('nan', 'inf', '-1', '0', HUGE[action.type]):
        try:
            args = parse(script, argv, parser, action, flag, text)
        except ValueError as e:
            assert str(e).startswith(flag), f'{script}: {flag} {text}: {e}'
            continue
        values = getattr(args, action.dest)
        for v in values if isinstance(values, list) else [values]:
            assert not b.finite or math.isfinite(v), f'{script}: {flag} {text} accepted'
            above_lo = b.lo is None or (v > b.lo if b.strict_lo else v >= b.lo)
            assert above_lo and (b.hi is None or (v < b.hi if b.strict_hi else v <= b.hi)), \
                f'{script}: {flag} {text} accepted'


@pytest.mark.parametrize('script,argv,parser,action', FLAGS, ids=IDS)
def test_paths_are_never_empty(script, argv, parser, action):
    """A flag that names a file or folder (declared path=True, or by its name: plumbing.run.PATH_FLAG)
    refuses '' naming the flag, rather than reading it as "the default"."""
    name = action.option_strings[0][2:]
    path_like = name in {'lm', 'energy', 'out', 'out_dir', 'data_dir', 'cache', 'key', 'votes', 'samples',
                         'plot', 'init_from', 'residual_of', 'negatives', 'held_out_negatives', 'extra_lm',
                         'compare', 'energy_metric', 'copy_to', 'wheel_dir', 'runs_dir'}
    assert path_like == (action.dest in parser.paths), f'{script}: --{name} path declaration'
    if not path_like:
        return
    with pytest.raises(ValueError) as e:
        parse(script, argv, parser, action, f'--{name}', '')
    assert str(e.value).startswith(f"--{name} '': an empty path"), str(e.value)


def test_declarations_are_enforced():
    """A number without bounds, or a flag without help, is refused when the parser is built: no
    flag can be added unguarded. And the checks bite: nan, a value past at_most, a strict bound's own
    value (above=, below=), ''."""
    p = ArgumentParser(prog='probe')
    with pytest.raises(TypeError, match='--k: a number declares its bounds'):
        p.add_argument('--k', type=int, default=1, help='a count')
    with pytest.raises(TypeError, match='--k: a number declares its bounds'):
        p.add_argument('--k', type=float, default=1, at_least=0, help='a count')
    with pytest.raises(ValueError, match='unrecognized arguments: --m'):  # no prefix of --max_rows
        parser_of(importlib.import_module('sample').get_args, []).parse_args(['--m', '3'])
    with pytest.raises(TypeError, match='--w: declare its help'):
        p.add_argument('--w', default='x')
    with pytest.raises(TypeError, match='not a number'):
        p.add_argument('--s', default='x', at_least=0, help='a name')
    with pytest.raises(TypeError, match='not a number'):
        p.add_argument('--s', default='x', below=1, help='a name')
    with pytest.raises(TypeError, match='at_least= or above=, not both'):
        p.add_argument('--k', type=float, default=1, at_least=0, above=0, at_most=None, help='a step')
    with pytest.raises(TypeError, match='below= is a number'):
        p.add_argument('--k', type=float, default=1, at_least=0, below=None, help='a rate')
    p.add_argument('--t', type=float, default=1.0, at_least=0, at_most=2, help='a rate')
    p.add_argument('--r', type=float, default=0.5, above=0, below=1, help='a probability, in (0, 1)')
    p.add_argument('--out', default='o.json', help='a file')
    assert p.parse_args(['--r', '1e-300']).r == 1e-300 and p.parse_args(['--r', '0.999']).r == 0.999
    for argv, line in ((['--t', 'nan'], '--t nan: must be a finite number'),
                       (['--t', '3'], '--t 3.0: must be at most 2'),
                       (['--t', '-1'], '--t -1.0: must be at least 0'),
                       (['--r', '0'], '--r 0.0: must be above 0'),
                       (['--r', '1'], '--r 1.0: must be below 1'),
                       (['--out', ''], "--out '': an empty path"),
                       (['--t', 'x'], "--t: invalid float value: 'x'")):
        with pytest.raises(ValueError) as e:
            p.parse_args(argv)
        assert str(e.value).startswith(line), str(e.value)


@pytest.mark.parametrize('argv,usage', [
    (['-m', 'extensions.run', 'sample.py', '--help'], 'usage: python -m extensions.run sample.py [-h]'),
    (['-m', 'job.figures', '--help'], 'usage: python -m job.figures [-h]'),
])
def test_usage_names_the_command_typed(argv, usage):
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert res.returncode == 0 and res.stdout.startswith(usage), res.stdout[:200] + res.stderr[-500:]
    assert '(default: ' in res.stdout


@pytest.mark.parametrize('argv,flag', [
    (['-m', 'extensions.exact_logz', '--lm', '{tmp}/missing.pt', '--energy', '{tmp}/e.pt',
      '--out', '{tmp}/out/x.json', '--cache', '{tmp}/cache'], '{tmp}/missing.pt'),
    (['-m', 'extensions.addition_eval', '--lm', '{tmp}/missing.pt', '--out', '{tmp}/out/x.json',
      '--device', 'cpu'], '{tmp}/missing.pt'),
    (['-m', 'job.human_eval', 'score', '--key', '{tmp}/key.json', '--votes', '{tmp}/votes.csv',
      '--out', '{tmp}/out/r.json'], '{tmp}/'),
])
def test_missing_paths_refused_in_one_line(tmp_path, argv, flag):
    """A path that does not exist (checked after the parse, in main): one `error:` line naming it,
    no traceback, a failing status, nothing written."""
    fill = [a.format(tmp=tmp_path) for a in argv]
    res = subprocess.run([sys.executable, *fill], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS='1'))
    lines = without_diagnostics(res.stderr)  # the threads and precision lines apart
    assert res.returncode != 0 and 'Traceback' not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith('error: ') and flag.format(tmp=tmp_path) in lines[0], lines
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)

"""The layout: every file is a script, a module or a test; scripts import modules, never another
script; the method imports no wing (job/, extensions/) and no test; the top level is the method and
one support package; every function fits on a screen; the README's numbers come from the committed
run; every documented command runs as written.
"""

import ast
import collections
import json
import os
import re
import statistics

from job.stats import format_p
from tests.common import ROOT, assert_clean_error, is_test, python_files, run_scripts


# ==== layout: scripts import modules, never another script's plumbing; every function fits on a screen ====

EXTERNAL_MODULES = {'pytest', 'pip'}  # `python -m X` that is not the repo's


SUBCOMMANDS = {'export', 'score', 'estimate_ppl.py', 'sample.py'}  # human_eval's; extensions.run's


def documented_commands():
    """Every command that README.md and docs/*.md tell a reader to run, as {(script, subcommand):
    {command: its flags}}: `python SCRIPT.py`, `python -m MODULE`, torchrun's `--nproc_per_node N
    SCRIPT.py` and `bash run.sh` (its flags go to job.reproduce), up to a comment, a pipe or the end of
    the inline code (lines continued by `\\` joined); and every file the README's table names."""
    docs = ['README.md'] + sorted(f'docs/{f}' for f in os.listdir(os.path.join(ROOT, 'docs'))
                                  if f.endswith('.md') and f != 'experiments.md')  # dated: their day's
    lines = []
    for d in docs:
        for line in open(os.path.join(ROOT, d), encoding='utf-8').read().replace('\\\n', ' ').splitlines():
            if lines and lines[-1].replace('```', '').count('`') % 2:  # inline code goes on here
                lines[-1] += ' ' + line
            else:
                lines.append(line)
    commands = collections.defaultdict(dict)
    for line in lines:
        for script, rest in re.findall(r'(?:python|--nproc_per_node \d+|bash) (-m [\w.]+|[\w/.]+\.py|run\.sh)'
                                       r'([^`#|&;\n]*)', line):
            if script.split()[-1] in EXTERNAL_MODULES:
                continue
            words = rest.split()
            sub = words[0] if words and words[0] in SUBCOMMANDS else None
            key = ('-m job.reproduce' if script == 'run.sh' else script, sub)
            commands[key][f'{script}{rest}'.strip()] = [w.split('=')[0] for w in words if w.startswith('--')]
    readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    cells = re.findall(r'^\| (`[^|]+)\|', readme, re.M)  # the Files table's first column
    return commands, [f for cell in cells for f in re.findall(r'`([\w/.]+)`', cell)]


def help_flags(help_text):
    """The flags an argparse --help lists under its options (not those its description quotes)."""
    options = re.split(r'^(?:options|optional arguments):$', help_text, maxsplit=1, flags=re.M)[-1]
    return {f for line in options.splitlines() if re.match(r'  -', line)
            for f in re.findall(r'--[\w-]+', re.split(r'\s{2,}', line.strip())[0])}


def test_every_documented_command_runs():
    """What the README and docs/ tell a reader to run exists, as written (a wing script as a module:
    `python job/x.py` stops), answers --help, and takes each flag the command gives it; every file
    the README's table lists exists."""
    commands, files = documented_commands()
    assert len(commands) >= 15 and len(files) >= 10, (commands, files)
    keys = sorted(commands, key=str)
    helps = run_scripts([[*script.split(), *([sub] if sub else []), '--help'] for script, sub in keys])
    stale = []
    assert len(helps) == len(keys)
    for key, res in zip(keys, helps):
        assert res.returncode == 0 and 'usage:' in res.stdout, (key, res.stderr[-500:])
        takes = help_flags(res.stdout)
        stale += [f'{cmd}: {f}' for cmd, flags in commands[key].items() for f in flags if f not in takes]
    assert not stale, f'documented flags that the script does not take: {stale}'
    assert not [f for f in files if not os.path.exists(os.path.join(ROOT, f))]


def test_a_wing_script_run_as_a_file_says_how_to_run_it():
    """The scripts in folders (job/, extensions/, data/*/) run as modules from the repo root: run as
    a file, each stops with one line that gives its `python -m` command, before any work."""
    wings = [p for p, t in python_files().items() if '/' in p and is_script(t)]
    assert len(wings) >= 12, wings
    helps = run_scripts([[p, '--help'] for p in wings])
    assert len(helps) == len(wings)
    for path, res in zip(wings, helps):
        assert_clean_error(res, f"python -m {path[:-3].replace('/', '.')}")


README_MODELS = {'BASE LM': 'BASE LM', 'RALM': 'RALM', 'BALM': 'BALM', 'TaiLr LM': 'TAILR'}


def readme_table_rows():
    """README's Table 1 as {model: [params, val PPL, test PPL, gain (SE), reduction]} (cells as text)."""
    readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    rows = {}
    table1 = readme.split('## Where the energy helps')[0]
    for line in re.findall(r'^\| (?:BASE|RALM|BALM|TaiLr|JOINT).*\|$', table1, re.M):
        cells = [c.strip() for c in line.strip('|').split('|')]
        name = cells[0].split(' (')[0]
        rows[README_MODELS.get(name, name)] = cells[1:]
    return readme, rows


def test_readme_numbers_come_from_the_committed_run():
    """Every number of README's Table 1 (params, val and test PPL or joint range, gain and SE,
    reduction), the LMs' stopping steps, the main job's times and the addition section's accuracies
    equal the committed JSON of the run they describe (assets/results.json, claims.json,
    seeds_addition.json)."""
    readme, rows = readme_table_rows()
    res = json.load(open(os.path.join(ROOT, 'assets', 'results.json')))
    lms = json.load(open(os.path.join(ROOT, 'assets', 'claims.json')))['lms']
    runs = {(r['model'], r['split']): r for r in res['rows']}
    assert len(rows) >= 8 and {m for m, _ in runs} == set(rows), (sorted(rows), sorted(runs))
    base = runs['BASE LM', 'test']['ppl']
    for model, cells in rows.items():
        val, test = runs[model, 'val'], runs[model, 'test']
        ppl = lambda r: f"{r['ppl']:.3f}" if 'ppl' in r else f"{r['ppl_low']:.3f}-{r['ppl_high']:.3f}"
        want = [f"{test['params'] / 1e6:.2f}M", ppl(val), ppl(test)]
        if model != 'BASE LM':
            want += [f"{test['gain_nats_per_token']:.4f} ({test['gain_se']:.4f})",
                     f"{100 * (1 - test.get('ppl', test.get('ppl_high')) / base):.2f}%"]
        assert cells[:len(want)] == want, (model, cells, want)
    c1 = json.load(open(os.path.join(ROOT, 'assets', 'claims.json')))['claims']['C1']
    prose = ' '.join(readme.split())
    assert f"{c1['diff']:.4f} (SE {c1['se']:.4f})" in prose
    reports = open(os.path.join(ROOT, 'docs', 'reports.md'), encoding='utf-8').read()
    check_recipes(' '.join(reports.split()))
    minutes = lambda t: sum(s for stage, s in t.items() if not stage.startswith('ord_')) / 60  # not Fig. 4's
    slowest = json.load(open(os.path.join(ROOT, 'assets', 'time_main_job_jobs.json')))['runs']['jobs_1']
    span = f"{minutes(res['timings_s']):.0f}-{slowest['wall_s'] / 60:.0f}"  # --jobs 1, by the day
    assert f"{span} min idle on a 2-core AMD EPYC" in prose
    for name, m in lms.items():  # "BASE LM (...; step 4,000)"
        if name in ('BASE', 'RALM', 'BALM'):
            assert re.search(rf'^\| {name}[^|]*step {m["best_step"]:,}\)', readme, re.M), name
    check_readme_addition(readme)


def test_readme_lesson_is_the_committed_run():
    """README's lesson table: each cell is assets/lesson.json's run of `bash run.sh` (its decoders' exact
    match, SE, the joint mode's lead and McNemar's p), and its minutes the median of the measured runs."""
    readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    lesson = json.load(open(os.path.join(ROOT, 'assets', 'lesson.json')))
    rows = {r['decoder']: r for r in lesson['readme_run']['rows']}
    section = readme.split('## What the lesson shows')[1].split('\n## ')[0]
    line = lambda start: next(l for l in section.splitlines() if l.startswith(f'| {start}'))
    cell = lambda r: f"{r['exact']:.3f} ({r['exact_se']:.3f})"
    lead = lambda r: f"{r['mode_minus']:+.3f} ({format_p(r['p'])})"
    for name in ('LM greedy', 'joint model: Algorithm 1 of n'):
        assert f"{cell(rows[name])} | {lead(rows[name])}" in line(name.replace(' n', ' 64')), name
    both = [rows['LM majority vote of n'], rows['LM log-prob rerank of n']]
    assert (f"{both[0]['exact']:.3f} / {both[1]['exact']:.3f} | {both[0]['mode_minus']:+.3f} / "
            f"{both[1]['mode_minus']:+.3f}") in line('LM majority vote')
    assert f"**{cell(rows['joint model: mode of n'])}**" in line('**joint model: mode')
    minutes = statistics.median(r['to_table_s'] for r in lesson['runs'] if r['dtype'] == 'auto') / 60
    assert f"table is up in {minutes:.1f} min" in ' '.join(section.split()), minutes


def check_recipes(prose):
    """docs/reports.md's before -> after of the energy recipe: each joint model's test gain (SE) under the
    earlier recipe on the same LM and prefixes, and the paired difference new - earlier on the
    selection split and on test, as assets/energy_recipes.json has them."""
    rec = json.load(open(os.path.join(ROOT, 'assets', 'energy_recipes.json')))
    for name in ('BIT', 'UNIT'):
        e = rec['test']['earlier'][name]
        assert f"JOINT {name} {e['gain']:.4f} ({e['se']:.4f})" in prose, name
        for split in ('select', 'test'):
            d = rec[split]['new_minus_earlier'][name]
            assert f"{name} {d['diff']:+.4f} (SE {d['se']:.4f}, p {d['p']:.2g})" in prose, (split, name)


def check_readme_addition(readme):
    """README's table of decoders on addition: each cell equals assets/seeds_addition.json's mean
    exact match over the seeds (SD over seeds) of that model and decoder; the text's shares, p-values
    and the P(correct sum) line its numbers."""
    seeds = json.load(open(os.path.join(ROOT, 'assets', 'seeds_addition.json')))
    acc = {(r['model'], r['method']): r for r in seeds['rows']}
    cell = lambda m, how: f"{acc[m, how]['exact']['mean']:.3f} ({acc[m, how]['exact']['sd']:.3f})"
    want = {'LM: greedy / one sample': [cell('BASE LM', 'greedy'), cell('BASE LM', 'sampled')],
            'LM, of 64: majority vote / log-prob rerank / any correct':
                [cell('BASE LM', f'{how}, n = 64') for how in ('majority vote', 'log-prob rerank', 'oracle')],
            'joint model, of 64: Algorithm 1 / its mode':
                [cell('JOINT', f'{how}, n = 64') for how in ('Algorithm 1', 'joint mode')],
            "joint model: mode over the LM's beam of 32 and 1 / 64 samples":
                [cell('JOINT', f'joint mode, beam + samples, n = {n}') for n in (1, 64)],
            'BALM': [cell('BALM', 'greedy'), cell('BALM', 'log-prob rerank, n = 64')],
            'EXO from the LM': [cell('EXO', 'greedy'), cell('EXO', 'sampled')]}
    section = readme.split('## Where the energy helps')[1].split('\n## ')[0]
    rows = {line.split('|')[1].strip(): line.replace('*', '') for line in section.splitlines()
            if line.startswith('| ')}
    for label, cells in want.items():
        line = next(v for k, v in rows.items() if k.startswith(label))
        assert ' / '.join(cells) in line, (label, cells, line)
    p = lambda m, how='greedy': f"{acc[m, how]['p_correct']['mean']:.3f}"
    share = lambda m, how: f"{100 * acc[m, how]['exact']['mean']:.0f}%"
    said = ' '.join(section.split())
    joint = [c for c in seeds['comparisons'] if c['better'][0] == 'JOINT']
    t_p, t_holm = ([c['seed_level'][k] for c in joint] for k in ('t_p', 't_p_holm'))
    sign = {(*c['seed_level']['sign'], f"{c['seed_level']['sign_p']:.2g}") for c in joint}
    assert len(sign) == 1, f'the sign tests differ across the joint comparisons: {sign}'
    (better, worse, sign_p), = sign
    for phrase in (f"LM {p('BASE LM')}", f"joint model {p('JOINT', 'Algorithm 1, n = 64')}",
                   f"BALM {p('BALM')}", f"EXO from the LM {p('EXO')}", f"{len(seeds['seeds'])} seeds",
                   f"hold the right sum {share('BASE LM', 'oracle, n = 64')}",
                   f"write it {share('BASE LM', 'greedy')}",
                   f"Holm-adjusted p at most {max(c['p_holm'] for c in joint):.2g}",
                   f"p is {min(t_p):.2g} to {max(t_p):.2g}",
                   f"Holm over the {len(seeds['comparisons'])} comparisons: {min(t_holm):.2g} to "
                   f"{max(t_holm):.2g}",
                   f"sign test {better}-{worse}, p {sign_p}"):
        assert phrase in said, (phrase, said)


MODULES = {'model.py', 'energy.py', 'extensions/metrics.py', 'extensions/enumeration.py',
           'extensions/carry.py', 'data/tokenizer.py', 'data/__init__.py',
           'job/__init__.py', 'extensions/__init__.py', 'plumbing/__init__.py', 'plumbing/run.py',
           'plumbing/device.py', 'plumbing/budget.py', 'plumbing/files.py',
           'plumbing/trainer.py', 'plumbing/guards.py', 'plumbing/checkpoints.py', 'job/configs.py',
           'job/pipeline.py', 'job/stages.py', 'job/bench_tools.py', 'job/bench_decoding.py',
           'job/bench_graphs.py', 'job/stats.py'}  # job/figures.py is a script


# import whatever they measure, as the tests do
FREE = {'job/bench.py', 'job/bench_decoding.py', 'job/bench_graphs.py'}


MAX_FUNCTION_LINES = 60  # the def line included


# the trainers' main keep their loop in sight, top to bottom, as nanoGPT's train.py does
TRAINER_MAIN_LINES = {'train_lm.py:main': 80, 'nce_train.py:main': 92}


MAX_LINE_CHARS = 110


def is_script(tree):
    return any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body)


def is_free(path):
    return path in FREE or is_test(path)


def repo_imports(tree, paths):
    """(repo file, the names taken from it, or None for the whole module) for every import of
    tree, at any depth, that resolves to one of paths."""
    def resolve(dotted):
        base = dotted.replace('.', '/')
        return next((p for p in (base + '.py', base + '/__init__.py') if p in paths), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if resolve(a.name):
                    yield resolve(a.name), None
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                if resolve(f'{node.module}.{a.name}'):  # a submodule: `from data.text import prepare`
                    yield resolve(f'{node.module}.{a.name}'), None
                elif resolve(node.module):
                    yield resolve(node.module), {a.name}


def test_every_file_is_a_script_a_module_or_a_test():
    trees = python_files()
    assert MODULES | FREE <= set(trees), (MODULES | FREE) - set(trees)  # no allowance for a file that is gone
    stray = [p for p, t in trees.items() if not (is_script(t) or p in MODULES or is_free(p))]
    assert not stray, f'{stray}: neither a script nor a test; a new module goes into MODULES'
    assert not [p for p in MODULES if is_script(trees[p])], 'a module has a __main__ block'


# the one script that imports scripts: it runs them with the extensions' energies registered
LAUNCHERS = {'extensions/run.py': {'estimate_ppl.py', 'sample.py'}}


def test_import_graph():
    """A script imports modules (plumbing lives there), never another script (log Z is
    energy.logz_bounds), a launcher (LAUNCHERS) exactly the scripts it runs; a module imports no
    script; data/*/prepare.py import `data`, not each other."""
    trees = python_files()
    scripts = {p for p, t in trees.items() if is_script(t) and not is_free(p)}
    bad = []
    for path, tree in trees.items():
        if is_free(path):
            continue
        taken = {target for target, _ in repo_imports(tree, trees) if target in scripts}
        if taken != LAUNCHERS.get(path, set()):
            bad.append(f'{path} imports the scripts {sorted(taken)}')
    assert not bad, bad


METHOD_FILES = {'model.py', 'energy.py', 'train_lm.py', 'negatives.py', 'nce_train.py', 'estimate_ppl.py',
                'sample.py'}


MAX_SUPPORT_NAMES = 12  # per trainer: what is not the lesson is shared, and few names of it


def test_top_level_is_the_method_and_one_support_package():
    """The top level holds the method's files (and the tests) beside one support package, plumbing/,
    whose first line says a reader may skip it; each trainer takes at most MAX_SUPPORT_NAMES names
    from it (the loop in sight, the rest shared)."""
    trees = python_files()
    top = {p for p in trees if '/' not in p and not is_free(p)}
    assert top == METHOD_FILES, top ^ METHOD_FILES
    doc = ast.get_docstring(trees['plumbing/__init__.py'])
    assert doc.startswith('Plumbing: a reader may skip this package'), doc[:80]
    for trainer in ('train_lm.py', 'nce_train.py'):
        names = set()
        for target, taken in repo_imports(trees[trainer], trees):
            if target.startswith('plumbing/'):
                names |= taken or {target}
        assert len(names) <= MAX_SUPPORT_NAMES, (trainer, sorted(names))


def test_the_method_imports_no_wing():
    """The method (the top-level files and data/) imports nothing from job/, extensions/ or tests/, at any
    depth: an extension plugs in through the interface energy.py's docstring states (it registers its
    loader; extensions/run.py runs a method script with it imported)."""
    trees = python_files()
    method = [p for p in trees if ('/' not in p or p.startswith('data/')) and not is_free(p)]
    assert {'energy.py', 'estimate_ppl.py', 'sample.py'} <= set(method)
    bad = [f'{p} imports {target}' for p in method for target, _ in repo_imports(trees[p], trees)
           if target.startswith(('job/', 'extensions/', 'tests/'))]
    assert not bad, bad


WING = re.compile(r'\b(?:extensions|job|tests)[./]\w')  # a wing's module or file, named in a string
DYNAMIC_IMPORTS = {'importlib', 'runpy', '__import__', 'import_module'}


def strings_and_names(tree):
    """The string constants of tree that are not docstrings (f-strings' parts included), and every
    name and attribute it uses or imports."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    strings = [n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]
    names = {getattr(n, 'id', None) or getattr(n, 'attr', None) for n in ast.walk(tree)}
    names |= {a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names} | {n.module.split('.')[0] for n in ast.walk(tree)
                                   if isinstance(n, ast.ImportFrom) and n.module}
    return strings, names


def test_the_method_names_no_module_in_a_string():
    """The method loads what an import graph shows: no dynamic import (importlib, runpy, __import__)
    and no string that names a module or file of a wing (an extension's energy registers its
    loader: energy.register_energy_loader), so test_the_method_imports_no_wing sees every arrow."""
    trees = python_files()
    method = [p for p in trees if ('/' not in p or p.startswith('data/')) and not is_free(p)]
    assert {'energy.py', 'estimate_ppl.py', 'sample.py'} <= set(method)
    bad = []
    for path in method:
        strings, names = strings_and_names(trees[path])
        bad += [f'{path}: {sorted(names & DYNAMIC_IMPORTS)}'] * bool(names & DYNAMIC_IMPORTS)
        bad += [f'{path}: {s!r}' for s in strings if WING.search(s)]
    assert not bad, bad


GUARD_MODULES = ('plumbing/guards.py', 'plumbing/checkpoints.py', 'plumbing/trainer.py', 'plumbing/run.py')
MAX_CHECK_LINES = 25  # a checking function, def line included
MAX_GUARD_SHARE = 0.10  # of a method file's lines


def guard_lines(tree):
    """The lines of tree that guard rather than compute: a function whose name starts with check_, an
    `if` whose body only raises, any other raise, and a statement that only calls a check (check*,
    at_least, guards.*); each statement's lines counted once."""
    lines = set()

    def visit(node):
        for n in ast.iter_child_nodes(node):
            call = n.value.func if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) else None
            name = getattr(call, 'id', None) or getattr(call, 'attr', '')
            owner = getattr(getattr(call, 'value', None), 'id', '')
            if (isinstance(n, ast.FunctionDef) and n.name.startswith('check_')
                    or isinstance(n, ast.If) and not n.orelse and all(isinstance(b, ast.Raise)
                                                                      for b in n.body)
                    or isinstance(n, ast.Raise) or name.startswith('check') or name == 'at_least'
                    or owner == 'guards'):
                lines.update(range(n.lineno, n.end_lineno + 1))
            else:
                visit(n)
    visit(tree)
    return lines


def test_the_method_keeps_its_guards_in_plumbing():
    """Issue 47: in the method files get_args declares flags and nothing else (it returns parse_args;
    main checks them in one line), their guard lines (guard_lines) are at most MAX_GUARD_SHARE of each
    file, and no checking function of plumbing's guards is longer than MAX_CHECK_LINES."""
    trees, bad = python_files(), []
    for path in sorted(METHOD_FILES):
        fn = next((n for n in trees[path].body
                   if isinstance(n, ast.FunctionDef) and n.name == 'get_args'), None)
        if fn is not None:
            ret = fn.body[-1]
            bad += [f'{path}: get_args ends in {ast.unparse(ret)[:60]}'] * (
                not isinstance(ret, ast.Return) or 'parse_args(argv)' not in ast.unparse(ret))
            bad += [f'{path}: get_args checks' for _ in guard_lines(fn)][:1]
        share = len(guard_lines(trees[path])) / len(open(os.path.join(ROOT, path)).read().splitlines())
        bad += [f'{path}: guard lines {share:.0%}'] * (share > MAX_GUARD_SHARE)
    long = [f'{p}:{n.name} ({n.end_lineno - n.lineno + 1} lines)' for p in GUARD_MODULES
            for n in ast.walk(trees[p]) if isinstance(n, ast.FunctionDef) and n.name.startswith('check')
            and n.end_lineno - n.lineno + 1 > MAX_CHECK_LINES]
    assert not bad + long, bad + long


# plumbing.COMMON_FLAGS
COMMON = {'--device', '--deterministic', '--dtype', '--seed', '--quiet', '--force', '--out_dir'}
# still declaring them by hand: the data preparers (their --out_dir is the data folder, --seed the split's)
COMMON_BY_HAND = {'extensions/exact_logz.py'}  # its --dtype: float32 by default, the study's energies


def test_common_flags_declared_in_one_place():
    """--device, --deterministic, --dtype, --seed, --quiet, --force and --out_dir come from
    plumbing.common_flags (one default each: --device auto everywhere), not from a script's own
    add_argument; COMMON_BY_HAND lists the files still to convert, each of which still declares one."""
    by_hand = collections.defaultdict(set)
    for path, tree in python_files().items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
                    and n.args[0].value in COMMON and not is_test(path)):
                by_hand[path].add(n.args[0].value)
    assert set(by_hand) == COMMON_BY_HAND, sorted(set(by_hand) ^ COMMON_BY_HAND)
    import plumbing
    assert {f'--{k}' for k in plumbing.COMMON_FLAGS} == COMMON
    assert plumbing.COMMON_FLAGS['device']['default'] == 'auto'


def test_no_import_circle():
    """No file imports, at any depth (a lazy import inside a function too), a file that imports it
    back: energy.py knows nothing of the metric energy, which registers its loader there."""
    trees = python_files()
    edges = {p: {target for target, _ in repo_imports(t, trees) if target != p} for p, t in trees.items()}

    def circle(path, seen):
        if path in seen:
            return seen[seen.index(path):] + [path]
        return next((c for t in sorted(edges.get(path, ())) if (c := circle(t, seen + [path]))), None)
    circles = [c for p in sorted(edges) if (c := circle(p, []))]
    assert not circles, circles[0]


def test_functions_fit_on_a_screen():
    """No function of the codebase (tests aside) is longer than MAX_FUNCTION_LINES (TRAINER_MAIN_LINES:
    the allowances, each for a function that needs it), and no line of any Python file (tests
    included) wider than MAX_LINE_CHARS."""
    functions = [(f'{p}:{n.name}', n.end_lineno - n.lineno + 1) for p, t in python_files().items()
                 if not is_test(p)
                 for n in ast.walk(t) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f'{f} ({n} lines)' for f, n in functions if n > TRAINER_MAIN_LINES.get(f, MAX_FUNCTION_LINES)]
    assert not long, long
    stale = set(TRAINER_MAIN_LINES) - {f for f, n in functions if n > MAX_FUNCTION_LINES}
    assert not stale, f'{sorted(stale)}: an allowance for a function that is gone or fits anyway'
    wide = [f'{p}:{i}' for p in python_files() for i, line in enumerate(open(os.path.join(ROOT, p)), 1)
            if len(line.rstrip('\n')) > MAX_LINE_CHARS]
    assert not wide, wide


def zip_without_strict(node):
    """node is zip(...) or enumerate(zip(...)) without strict=True: it stops at the shorter argument."""
    if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'enumerate' and node.args:
        node = node.args[0]
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'zip'
            and not any(k.arg == 'strict' for k in node.keywords))


def asserts_over_a_zip(stmt):
    """stmt is a for loop over a zip with an assert in its body, or an assert over a comprehension of one."""
    if isinstance(stmt, ast.For):
        return zip_without_strict(stmt.iter) and any(isinstance(n, ast.Assert) for s in stmt.body
                                                     for n in ast.walk(s))
    return isinstance(stmt, ast.Assert) and any(zip_without_strict(g.iter) for n in ast.walk(stmt.test)
                                                if isinstance(n, ast.comprehension) for g in [n])


def test_loops_over_a_zip_check_lengths():
    """A test that asserts over zip(a, b) (a for loop, or all(...) over a comprehension) asserts their
    lengths in the statement before (or zips with strict=True): zip stops at the shorter, so an empty
    or a short list would pass unchecked."""
    bad = []
    for path, tree in python_files().items():
        if not is_test(path):
            continue
        for node in ast.walk(tree):
            for field in ('body', 'orelse', 'finalbody'):
                stmts = getattr(node, field, None)
                if not isinstance(stmts, list):
                    continue
                for i, stmt in enumerate(stmts):
                    checked = i > 0 and isinstance(stmts[i - 1], ast.Assert) and any(
                        isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'len'
                        for n in ast.walk(stmts[i - 1]))
                    if asserts_over_a_zip(stmt) and not checked:
                        bad.append(f'{path}:{stmt.lineno}')
    assert not bad, f'assert len(a) == len(b) before these loops over zip(a, b): {bad}'


MAX_TEST_ALL_LINES = 1300  # the learner's file: the read-first tests and the estimators' (about a minute)


def test_the_test_map_names_every_test_file():
    """test_all.py stays the learner's file (at most MAX_TEST_ALL_LINES lines; the rest of a piece's
    tests go to tests/) and its docstring names every file under tests/, none that is gone; the
    shared fixtures come from tests/conftest.py (no pytest_plugins), and test_all.py takes none of
    them (pytest serves that conftest.py to tests/ only)."""
    trees = python_files()
    doc = ast.get_docstring(trees['test_all.py'])
    named = set(re.findall(r'tests/[\w/]*\w(?:\.py|/)', doc))
    files = {p for p in trees if p.startswith('tests/') and p.count('/') == 1 and p != 'tests/__init__.py'}
    assert named == files | {'tests/scripts/'}, sorted(named ^ (files | {'tests/scripts/'}))
    lines = sum(1 for _ in open(os.path.join(ROOT, 'test_all.py'), encoding='utf-8'))
    assert lines <= MAX_TEST_ALL_LINES, f'test_all.py: {lines} lines; what a learner need not read: tests/'
    plugins = [p for p, t in trees.items() if is_test(p) and any(
        isinstance(n, ast.Assign) and any(getattr(x, 'id', None) == 'pytest_plugins' for x in n.targets)
        for n in t.body)]
    assert not plugins, f'{plugins}: shared fixtures belong in tests/conftest.py'
    fixtures = {n.name for n in trees['tests/conftest.py'].body if isinstance(n, ast.FunctionDef)}
    taken = {a.arg for n in ast.walk(trees['test_all.py']) if isinstance(n, ast.FunctionDef)
             for a in n.args.args} & fixtures
    assert not taken, f'test_all.py takes the fixtures {sorted(taken)}, which only tests/ sees'


# the files written in place, not through plumbing's atomic writes (a temp file renamed): (file, function)
IN_PLACE_WRITES = {
    ('negatives.py', 'reserve'): "the samples' file, filled chunk by chunk, resumed (done.bin: how far)",
    ('job/pipeline.py', 'start'): "a stage's log, written as it runs",
    ('job/seeds.py', 'train_seeds'): "a seed's job's log, written as it runs",
    ('plumbing/trainer.py', 'start'): 'log.jsonl, a line appended at each evaluation',
}


WRITERS = ('savefig', 'tofile', 'torch.save', 'np.save', 'json.dump')  # each writes its file argument


def writes_to(call):
    """The file a call writes, as source text (open() for writing or appending, or a WRITERS call),
    else None."""
    name = ast.unparse(call.func)
    if name == 'open' and call.args:
        mode = call.args[1] if len(call.args) > 1 else next(
            (k.value for k in call.keywords if k.arg == 'mode'), None)
        writing = isinstance(mode, ast.Constant) and set(mode.value) & set('wax+')
        return ast.unparse(call.args[0]) if writing else None
    if name.endswith(WRITERS) and call.args:
        return ast.unparse(call.args[min(len(call.args) - 1, name.endswith(('torch.save', 'json.dump')))])
    return None


def raw_writes(tree):
    """(enclosing function, line, file) of each write whose file is not a temp file (no 'tmp' in it,
    as atomic_write's write(tmp) has) nor an open file object (f)."""
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            target = writes_to(child) if isinstance(child, ast.Call) else None
            if target is not None and 'tmp' not in target and target != 'f':
                found.append((inner, child.lineno, target))
            visit(child, inner)
    visit(tree, None)
    return found


def test_every_write_is_atomic_or_named():
    """Outputs are written to a temp file and renamed (plumbing's atomic_write, write_text, write_json,
    save_checkpoints), so a kill leaves the old file whole; the few files written in place are
    IN_PLACE_WRITES, each with its reason. A planted plain write is found."""
    found = [(path, func, line, target) for path, tree in python_files().items() if not is_test(path)
             for func, line, target in raw_writes(tree)]
    assert not [f for f in found if (f[0], f[1]) not in IN_PLACE_WRITES], found
    assert {(p, f) for p, f, *_ in found} == set(IN_PLACE_WRITES)  # none of them stale
    planted = ast.parse("def main(args):\n    with open(args.out + '.txt', 'w') as f:\n        f.write('x')\n"
                        "    fig.savefig(args.plot)\n")
    found = [(f, t) for f, _, t in raw_writes(planted)]
    assert found == [('main', "args.out + '.txt'"), ('main', 'args.plot')]

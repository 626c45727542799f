"""Docs that cannot drift: each number or flag value in README.md and docs/ that names a config value
(job/configs.py), a count of lines or of imported names, or a count of works, is a row of CLAIMS
below, checked against the code. A row whose words no longer match fails too: reword it with the
doc. Elsewhere: the documented commands' flags against each script's --help
(test_layout.test_every_documented_command_runs), README's results and times against the committed
JSON (test_layout.test_readme_numbers_come_from_the_committed_run).
"""

import ast
import os
import re

from job.configs import ADDITION, DEFAULT
from tests.common import ROOT


def read(path):
    return ' '.join(open(os.path.join(ROOT, path), encoding='utf-8').read().split())  # wraps vanish


def file_lines(path):
    return sum(1 for _ in open(os.path.join(ROOT, path), encoding='utf-8'))


def function_lines(path, name):
    tree = ast.parse(open(os.path.join(ROOT, path), encoding='utf-8').read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


def support_names(path):
    """The names a script takes from plumbing/."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding='utf-8').read())
    return len({a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                and n.module.split('.')[0] == 'plumbing' for a in n.names})


def bold_after(path, claim):
    """The **bold** names from `claim` to the next heading: the works a sentence counts."""
    text = open(os.path.join(ROOT, path), encoding='utf-8').read()
    return len(re.findall(r'\*\*[^*]+\*\*', text[text.index(claim):].split('\n## ')[0]))


LM, NEG, MLM, BIT, UNIT, PPL = (DEFAULT[k] for k in ('lm', 'neg', 'mlm', 'bit', 'unit', 'ppl'))
WORDS = {'two': 2, 'three': 3, 'four': 4, 'five': 5}

# (doc, a regex whose groups are the claimed values, the values in the code)
CLAIMS = [
    # README: the main job's recipe (DEFAULT) and its models' shapes
    ('README.md', r'prefix (\d+) \+ continuation (\d+);', [NEG['prefix_len'], NEG['gen_len']]),
    ('README.md', r'([\d,]+) val and ([\d,]+) test prefixes, n = (\d+) LM samples each',
     [PPL['max_prefixes'], PPL['max_prefixes'], PPL['num_samples']]),
    ('README.md', r'stops once less than ([\d.]+)% better on it over ([\d,]+) steps',
     [100 * LM['min_rel_delta'], LM['patience'] * LM['eval_interval']]),
    ('README.md', r'binary NCE on (\d+) LM samples of\s+each of ([\d,]+) training prefixes',
     [NEG['num_samples'], NEG['train_prefixes']]),
    ('README.md', r'BASE LM \((\d+) layers, (\d+) wide', [LM['n_layer'], LM['n_embd']]),
    ('README.md', r'RALM \(Eq\. 6, LM \+ a (\d+)x(\d+) GPT', [DEFAULT['residual']['n_layer'],
                                                              DEFAULT['residual']['n_embd']]),
    ('README.md', r'TaiLr LM \(Ji et al\. 2023; γ = ([\d.]+)\)', [DEFAULT['tailr']['gamma']]),
    ('README.md', r'JOINT UNIT \((\d+)x(\d+), from the LM\)', [LM['n_layer'], LM['n_embd']]),
    ('README.md', r'JOINT BIT \((\d+)x(\d+), ALiBi', [MLM['n_layer'], MLM['n_embd']]),
    ('README.md', r'(\w+) of its works are here', [bold_after('README.md', 'of its works are here')]),
    # README: the addition job (ADDITION)
    ('README.md', r'(\d+)-digit addition', [ADDITION['data']['digits']]),
    ('README.md', r'([\d,]+) test problems, mean over the \d+ seeds \(SD over seeds\); '
                  r'"of (\d+)": among (\d+) LM',
     [ADDITION['accuracy']['num_prefixes'], *[int(ADDITION['accuracy']['ns'].split(',')[-1])] * 2]),
    ('README.md', r'EXO-distilled LM \(K = (\d+)\)', [ADDITION['exo']['K']]),
    # docs/using.md: the stage commands of the main job
    ('docs/using.md', r'train_lm\.py --out_dir out/lm --n_layer (\d+) --n_head (\d+) --n_embd (\d+) --lr ([\de.-]+)',
     [LM['n_layer'], LM['n_head'], LM['n_embd'], LM['lr']]),
    ('docs/using.md', r'--lr_decay_iters (\d+) --max_iters (\d+) --patience (\d+) --min_rel_delta ([\d.]+)',
     [LM['lr_decay_iters'], LM['max_iters'], LM['patience'], LM['min_rel_delta']]),
    ('docs/using.md', r'--split train --out_dir out/neg_train --max_prefixes (\d+) --num_samples (\d+)',
     [NEG['train_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--split select --out_dir out/neg_select --max_prefixes (\d+) --num_samples (\d+)',
     [NEG['select_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--objective mlm --alibi --n_layer (\d+) --n_embd (\d+) --n_head (\d+)',
     [MLM['n_layer'], MLM['n_embd'], MLM['n_head']]),
    ('docs/using.md', r'--energy bit --init_from out/mlm/best\.pt --lr ([\de.-]+) --max_iters (\d+) '
                      r'--patience (\d+)', [BIT['lr'], BIT['max_iters'], BIT['patience']]),
    ('docs/using.md', r'--split test --num_prefixes (\d+)', [DEFAULT['samples']['num_prefixes']]),
    ('docs/using.md', r'DEFAULT \(`job/configs\.py`\) takes `--loss binary --select loss` on (\d+) negatives',
     [NEG['num_samples']]),
    ('docs/using.md', r'a low NCE lr \(([\de.-]+) here\)', [BIT['lr']]),
    # docs/method.md, docs/nanogpt.md: counts
    ('docs/method.md', r'the (\w+) works of Haozhe Ji', [bold_after('docs/method.md', 'of its works are')]),
    ('docs/method.md', r'(\w+) of its works are implemented here',
     [bold_after('docs/method.md', 'of its works are')]),
    ('docs/nanogpt.md', r'`nce_train\.py` imports (\d+) support names from `plumbing/`',
     [support_names('nce_train.py')]),
    ('docs/nanogpt.md', r'`train_lm\.py` (\d+)\)', [support_names('train_lm.py')]),
]

# (doc, regex, the counts in the code): lines, claimed "about", within LINE_TOLERANCE
LINE_TOLERANCE = 0.05
LINE_CLAIMS = [
    ('docs/nanogpt.md', r'`nce_train\.py` \(about (\d+) lines, `main` about (\d+) of them\)',
     [file_lines('nce_train.py'), function_lines('nce_train.py', 'main')]),
]


def number(text):
    return WORDS[text.lower()] if text.lower() in WORDS else float(text.replace(',', ''))


def mismatches(claims, docs, tolerance=1e-9):
    """Each claim of `claims` whose regex finds nothing in its doc (docs: {doc: its text}), or a value
    other than the code's (relative tolerance), as one line."""
    bad = []
    for doc, pattern, want in claims:
        found = re.findall(pattern, docs[doc])
        if not found:
            bad.append(f'{doc}: no text matches {pattern!r}: reword the row of CLAIMS with the doc')
        for said in found:
            said = (said,) if isinstance(said, str) else said
            if any(abs(number(s) - w) > tolerance * w for s, w in zip(said, want, strict=True)):
                bad.append(f'{doc}: {pattern!r} says {list(said)}, the code {want}')
    return bad


def docs_text():
    return {d: read(d) for d in {c[0] for c in CLAIMS + LINE_CLAIMS}}


def test_doc_numbers_equal_the_code():
    """Every row of CLAIMS: the doc's numbers equal job/configs.py's values and the counts in the code."""
    assert len(CLAIMS) >= 25
    bad = mismatches(CLAIMS, docs_text())
    assert not bad, '\n'.join(bad)


def test_doc_line_counts_within_five_percent():
    bad = mismatches(LINE_CLAIMS, docs_text(), LINE_TOLERANCE)
    assert not bad, '\n'.join(bad)


def test_a_planted_mismatch_fails():
    """The check can fail: a wrong number, a wrong count word, a line count 10% off and reworded text
    each give one line."""
    docs = docs_text()
    readme = docs['README.md'].replace('NCE on 2 LM', 'NCE on 16 LM').replace('three of', 'two of')
    using = docs['docs/using.md'].replace('--max_iters 2400', '--max_iters 600').replace('low NCE', 'lowish')
    planted = dict(docs, **{'README.md': readme, 'docs/using.md': using})
    bad = mismatches(CLAIMS, planted)
    assert len(bad) == 4 and "says ['16', '8,000']" in bad[0], bad
    assert any("says ['two']" in b for b in bad) and any('no text matches' in b for b in bad), bad
    wrong = re.sub(r'\(about \d+ lines', f"(about {int(file_lines('nce_train.py') * 1.1)} lines",
                   docs['docs/nanogpt.md'])
    nanogpt = dict(docs, **{'docs/nanogpt.md': wrong})
    assert len(mismatches(LINE_CLAIMS, nanogpt, LINE_TOLERANCE)) == 1


CONFIGS = 'DEFAULT|QUICK|QUICK_GPT2|ADDITION|ADDITION_QUICK'


def test_a_config_named_in_the_docs_is_where_they_say():
    """Every "`FILE.py`'s DEFAULT" or "DEFAULT (`FILE.py`)" in README.md and docs/ (QUICK, ADDITION,
    ... too) names the file that defines it."""
    docs = ['README.md'] + [f'docs/{f}' for f in os.listdir(os.path.join(ROOT, 'docs'))
                            if f.endswith('.md') and f != 'experiments.md']  # dated: their day's
    named = []
    for d in docs:
        named += [(d, f, n) for f, n in re.findall(rf"`([\w/]+\.py)`'s ({CONFIGS})\b", read(d))]
        named += [(d, f, n) for n, f in re.findall(rf"\b({CONFIGS}) \(`([\w/]+\.py)`\)", read(d))]
    assert named, 'no doc names where DEFAULT lives'
    wrong = [f'{d}: {f} defines no {name}' for d, f, name in named
             if not re.search(rf'^{name} = ', open(os.path.join(ROOT, f), encoding='utf-8').read(), re.M)]
    assert not wrong, wrong


# -----------------------------------------------------------------------------
# docs/using.md's "Step by step": each command is the job's own (job/reproduce.py's stages), so
# that it trains the job's models, not a script's defaults

STEPS_IGNORED = {'seed', 'device', 'dtype', 'data_dir', 'quiet', 'resume', 'force',  # the run's, not the recipe's
                 'snapshots', 'final_eval', 'final_eval_windows', 'num_samples_printed'}
TRAINERS = {'train_lm.py', 'negatives.py', 'nce_train.py'}  # their command in full: the model it trains


def job_commands(argv=()):
    """{stage: its command} of `python -m job.reproduce argv` as it would print them, without running
    anything (the data's vocabulary stands in as 65 characters)."""
    from job import reproduce

    class Stop(Exception):
        pass

    class Commands:
        timings, spans = {}, []

        def __init__(self):
            self.cmds = {}

        def run(self, name, cmd, *rest):
            self.cmds[name] = cmd

        def wait(self, *names):
            if not names:  # the job's end: its report is not wanted
                raise Stop

    pipe, saved = Commands(), (reproduce.prepare_data, reproduce.print_estimate)
    reproduce.prepare_data, reproduce.print_estimate = (lambda pipe, args: 65), (lambda *a: None)
    try:
        reproduce.stages(reproduce.get_args(['--out_dir', 'out', *argv]), pipe)
    except Stop:
        pass
    finally:
        reproduce.prepare_data, reproduce.print_estimate = saved
    return pipe.cmds


def step_by_step(text):
    """The commands of docs/using.md's "Step by step" code block: [(script, [its words])]."""
    block = text.split('## Step by step')[1].split('\n## ')[0].replace('\\\n', ' ')
    steps = []
    for line in block.splitlines():
        if line.startswith('    python '):
            words = line.split('#')[0].split()[1:]
            if words[:2] == ['-m', 'extensions.run']:
                words = words[2:]
            script = ' '.join(words[:2]) if words[0] == '-m' else words[0]
            steps.append((script, words[2:] if words[0] == '-m' else words[1:]))
    return steps


def flag_values(words):
    """['--a', '1', '--b', '--c', 'x', 'y'] -> {'a': ['1'], 'b': [], 'c': ['x', 'y']}"""
    flags, key = {}, None
    for w in words:
        if w.startswith('--'):
            key = w[2:]
            flags[key] = []
        elif key is not None:
            flags[key].append(w)
    return flags


def same_value(a, b):
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def step_mismatches(steps, cmds):
    """Each documented step that is not its stage's command, as one line: a flag whose value differs
    from the stage's; for a trainer, also any setting the two parse to differently (a flag the doc
    leaves out that the job gives)."""
    import importlib
    bad = []
    for script, words in steps:
        flags = flag_values([w for w in words if w != '...'])
        out = (flags.get('out_dir') or flags.get('out') or [None])[0]
        stage = [c for c in cmds.values() if script in ' '.join(c[:4])
                 and out in (flag_values(c).get('out_dir', []) + flag_values(c).get('out', []))]
        if len(stage) != 1:
            bad.append(f'{script} {out}: no stage of the job writes there')
            continue
        job = flag_values(stage[0])
        for k, v in flags.items():
            if k not in STEPS_IGNORED and not (set(v) <= set(job.get(k, [])) if len(v) > 1 else
                                               len(job.get(k, [])) == len(v) and all(map(same_value, v, job[k]))):
                bad.append(f'{script} {out}: --{k} {" ".join(v)}, the job {job.get(k)}')
        if script in TRAINERS and '...' not in words:
            get_args = importlib.import_module(script[:-3]).get_args
            doc, run = vars(get_args(words)), vars(get_args(stage[0][1:]))
            bad += [f'{script} {out}: {k} is {doc[k]!r}, the job {run[k]!r}' for k in sorted(doc)
                    if k not in STEPS_IGNORED and doc[k] != run[k]]
    return bad


def test_the_step_by_step_commands_are_the_jobs():
    """docs/using.md's step-by-step commands train what the main job trains: each flag they give has the
    job's value, and a trainer's command (train_lm.py, negatives.py, nce_train.py) leaves no flag of
    the job's out (the script's defaults are not the job's: train_lm.py alone builds a 4x256 model)."""
    steps = step_by_step(open(os.path.join(ROOT, 'docs/using.md'), encoding='utf-8').read())
    assert len(steps) >= 8 and sum(s in TRAINERS for s, _ in steps) >= 5, steps
    bad = step_mismatches(steps, job_commands())
    assert not bad, '\n'.join(bad)


def test_a_step_that_is_not_the_jobs_fails():
    """The check can fail: a flag left out (the script's default differs) and a wrong value each give a line."""
    text = open(os.path.join(ROOT, 'docs/using.md'), encoding='utf-8').read()
    cmds = job_commands()
    dropped = re.sub(r'(train_lm\.py --out_dir out/lm.*?) --n_embd \d+', r'\1', text, count=1)
    assert any('n_embd is 256' in b for b in step_mismatches(step_by_step(dropped), cmds))
    wrong = text.replace('--max_prefixes 8000', '--max_prefixes 800', 1)
    assert any('--max_prefixes 800,' in b for b in step_mismatches(step_by_step(wrong), cmds))


# -----------------------------------------------------------------------------
# what the project is, not how it was made: no words of the organisation that ran its work

ORGANISATIONAL = r'\blent\b|\blease\b|\bleases\b|device tool|\blending\b|this session|\bthe issue\b|\bissues? \d+'
DATED_NOTES = 'docs/experiments.md'  # its dated notes may name the issue a day's work answered


def organisational_words(texts):
    """[(file, the words)] of each organisational word in `texts` ({file: text}); in DATED_NOTES an issue
    number is allowed, no other word."""
    found = []
    for f, text in texts.items():
        for m in re.finditer(ORGANISATIONAL, text, re.I):
            if not (f == DATED_NOTES and re.fullmatch(r'issues? \d+', m.group(), re.I)):
                found.append((f, text[max(0, m.start() - 30):m.end() + 30]))
    return found


def project_texts():
    files = ['README.md'] + [f'docs/{f}' for f in os.listdir(os.path.join(ROOT, 'docs')) if f.endswith('.md')]
    files += [f'assets/{f}' for f in os.listdir(os.path.join(ROOT, 'assets')) if f.endswith('.json')]
    return {f: read(f) for f in sorted(files)}


def test_no_organisational_words():
    """README.md, docs/*.md and assets/*.json say what the project is and which machine and command made
    a number, not how its work was organised: no "lent", "lease", "device tool", "lending", "this
    session", "the issue" or "issue N" (docs/experiments.md's dated notes may name their issue)."""
    texts = project_texts()
    assert len(texts) >= 20 and 'docs/experiments.md' in texts
    found = organisational_words(texts)
    assert not found, '\n'.join(f'{f}: ...{w}...' for f, w in found)


def test_an_organisational_word_is_found():
    planted = {'docs/using.md': 'no GPU was lent for it (issue 46)', 'assets/x.json': '{"note": "the lease ran out"}',
               DATED_NOTES: '## 2026-11-28 (issue 46): the issue asked this session for it; release 2'}
    found = organisational_words(planted)
    assert [f for f, _ in found] == ['docs/using.md'] * 2 + ['assets/x.json'] + [DATED_NOTES] * 2, found

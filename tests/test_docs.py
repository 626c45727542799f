"""Docs that cannot drift: each number or flag value in README.md and docs/ that names a config value
(job/configs.py), a limit in the code, a count of lines or of imported names, or a count of works, is a
row of CLAIMS below, checked against the code (each number stated from a committed result: a row of
test_doc_results.py's JSON_CLAIMS). A row whose words no longer match fails too: reword it with the
doc. No doc
or asset says how the project's work was organised (issue numbers only in docs/experiments.md's dated
notes, whose other numbers are their day's measurements, each with its machine and command).
Elsewhere: the step-by-step commands and --dtype (test_doc_commands.py), the documented commands'
flags against each script's --help
(test_layout.test_every_documented_command_runs), README's results and times against the committed
JSON (test_layout.test_readme_numbers_come_from_the_committed_run).
"""

import ast
import os
import re

from extensions.exact_logz import RECIPE
from job.configs import ADDITION, DEFAULT
from tests.common import ROOT, mismatches, read
from tests.test_bad_input import CLI_TABLE


def file_lines(path):
    return sum(1 for _ in open(os.path.join(ROOT, path), encoding='utf-8'))


def function_lines(path, name):
    tree = ast.parse(open(os.path.join(ROOT, path), encoding='utf-8').read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


def code_lines(path, name):
    """Lines of `name` in path, from its def (class, assignment) line to its last: a top-level function,
    class or assignment, a method 'Class.method', or 'main:loop', the while loop of main."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding='utf-8').read())
    outer, _, inner = name.partition('.') if ':' not in name else (name.split(':')[0], '', '')
    node = next(n for n in tree.body if getattr(n, 'name', None) == outer or isinstance(n, ast.Assign)
                and getattr(n.targets[0], 'id', None) == outer)
    if inner:
        node = next(n for n in node.body if getattr(n, 'name', None) == inner)
    if name.endswith(':loop'):
        node = next(n for n in ast.walk(node) if isinstance(n, ast.While))
    return node.end_lineno - node.lineno + 1


# The learner's path (docs/nanogpt.md): the code each step of README's reading order reads in full
READING = {
    1: [('model.py', f) for f in ('proposal_logprobs', 'sample_next', 'GPT.generate_plain', 'GPT.generate',
                                  'decode_steps', 'cached_generate')],
    2: [('energy.py', f'Energy.{f}') for f in ('__init__', 'kind', 'num_params', 'forward', 'project',
                                                'context_cut')],
    3: [('nce_train.py', f) for f in ('nce_loss', 'FIGURES', 'train_step', 'main:loop')],
    4: [('energy.py', 'logz_bounds')] + [('estimate_ppl.py', f) for f in ('ppl', 'gain_over',
                                                                           'evaluate_prefixes', 'summarize',
                                                                           'table_1')],
    5: [('sample.py', 'algorithm_1'), ('energy.py', 'gumbel_keys')],
    6: [('estimate_ppl.py', 'Steps'), ('estimate_ppl.py', 'per_step')],
    7: [('extensions/metrics.py', 'dual'), ('extensions/metrics.py', 'fit_mu')],
}
MAX_STEP_LINES = 80


def lines_to_read(step):
    return sum(code_lines(path, name) for path, name in READING[step])


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
BALM = dict(LM, **DEFAULT['balm'])  # the stopping rule's flags, which RALM and TaiLr share

# (doc, a regex whose groups are the claimed values, the values in the code)
CLAIMS = [
    # README: the main job's recipe (DEFAULT) and its models' shapes
    ('README.md', r'prefix (\d+) \+ continuation (\d+);', [NEG['prefix_len'], NEG['gen_len']]),
    ('README.md', r'([\d,]+) val and ([\d,]+) test prefixes, n = (\d+) LM samples each',
     [PPL['num_prefixes'], PPL['num_prefixes'], PPL['num_samples']]),
    ('docs/reports.md', r'improved by less than ([\d.]+)% \(relative\) over its last two '
                        r'evaluations,\s+([\d,]+)\s+steps',
     [100 * BALM['min_rel_delta'], BALM['patience'] * BALM['eval_interval']]),
    ('docs/reports.md', r'The base LM trains a fixed ([\d,]+) steps', [LM['max_iters']]),
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
    ('README.md', r'([\d,]+) test problems, mean \(SD\) over \d+ seeds; "of (\d+)": among (\d+) LM',
     [ADDITION['accuracy']['num_prefixes'], *[int(ADDITION['accuracy']['ns'].split(',')[-1])] * 2]),
    ('README.md', r"mode over the LM's beam of (\d+) and 1 / (\d+) samples",
     [ADDITION['accuracy']['beam'], int(ADDITION['accuracy']['ns'].split(',')[-1])]),
    # docs/using.md: the stage commands of the main job
    ('docs/using.md', r'train_lm\.py --out_dir out/lm --n_layer (\d+) --n_head (\d+) --n_embd (\d+) --lr '
                      r'([\de.-]+)',
     [LM['n_layer'], LM['n_head'], LM['n_embd'], LM['lr']]),
    ('docs/using.md', r'--lr_decay_iters (\d+) --max_iters (\d+) --patience (\d+)\s+python negatives',
     [LM['lr_decay_iters'], LM['max_iters'], LM['patience']]),
    ('docs/using.md', r'--split train --out_dir out/neg_train --num_prefixes (\d+) --num_samples (\d+)',
     [NEG['train_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--split select --out_dir out/neg_select --num_prefixes (\d+) --num_samples (\d+)',
     [NEG['select_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--objective mlm --alibi --n_layer (\d+) --n_embd (\d+) --n_head (\d+)',
     [MLM['n_layer'], MLM['n_embd'], MLM['n_head']]),
    ('docs/using.md', r'--body bit --init_from out/mlm/best\.pt --lr ([\de.-]+) --max_iters (\d+) '
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

# README: nothing. docs/addition.md: the ADDITION job's caps
CLAIMS += [
    ('docs/addition.md', r'over a fixed ([\d,]+) steps \(A faster job, below\), RALM\s+with a cap of '
                         r'([\d,]+) and TaiLr with ([\d,]+)',
     [ADDITION['balm']['max_iters'], ADDITION['residual']['max_iters'], ADDITION['tailr']['max_iters']]),
    ('docs/addition.md', r"the job's EXO learns on its own samples from BALM for (\d+) steps",
     [ADDITION['exo']['max_iters']]),
    ('docs/addition.md', r'the base LM and BALM train for fixed budgets\s+\(([\d,]+) and ([\d,]+) steps',
     [ADDITION['lm']['max_iters'], ADDITION['balm']['max_iters']]),
    ('docs/addition.md', r"ADDITION\['exo'\]: `--beam (\d+)\s+--beam_mass (\d+) --num_samples (\d+) "
                         r"--batch_size (\d+) --lr ([\de.-]+) --min_lr ([\de.-]+)`, on-policy from\s+BALM, "
                         r"(\d+) steps",
     [ADDITION['exo'][k] for k in ('beam', 'beam_mass', 'num_samples', 'batch_size', 'lr', 'min_lr',
                                   'max_iters')]),
    ('docs/addition.md', r"EXO's three log Z tables from (\d+) LM samples",
     [ADDITION['exo']['logz_samples']]),
    ('docs/addition.md', r'The selection negatives now\s+hold (\d+) samples',
     [ADDITION['neg']['select_samples']]),
]

# docs/exact_logz.md: the study's recipe (extensions/exact_logz.RECIPE) beside ADDITION's
EXACT_RECIPE = ' '.join(RECIPE)
CLAIMS += [
    ('docs/exact_logz.md', r'eval every (\d+) \(not (\d+)\) steps, cap ([\d,]+) with its cosine \(not a '
                           r'fixed ([\d,]+), cosine to ([\d,]+)\), stopped on whole windows by ([\d.]+)%, '
                           r'patience (\d) \(the job\'s: no rule',
     [int(re.search(r'--eval_interval (\d+) --patience', EXACT_RECIPE)[1]), ADDITION['lm']['eval_interval'],
      int(re.search(r'--max_iters (\d+) --lr 3e-3', EXACT_RECIPE)[1]), ADDITION['lm']['max_iters'],
      ADDITION['lm']['lr_decay_iters'], 100 * float(re.search(r'--min_rel_delta ([\d.]+)', EXACT_RECIPE)[1]),
      int(re.search(r'--eval_interval 100 --patience (\d+)', EXACT_RECIPE)[1])]),
    ('docs/exact_logz.md', r'selection problems, cap ([\d,]+) \(not ([\d,]+)\)',
     [int(re.search(r'--max_iters (\d+) --lr 2e-4', EXACT_RECIPE)[1]), ADDITION['unit']['max_iters']]),
]


def constant(path, name):
    """The value of `NAME = value` at the top level of a module of the repo."""
    return float(re.search(rf'^{name} = ([\d.e*]+)', open(os.path.join(ROOT, path), encoding='utf-8').read(),
                           re.M)[1].replace('2**16', '65536'))


# docs/using.md and docs/guarantees.md: the limits and thresholds the code holds as constants
CLAIMS += [
    ('docs/guarantees.md', r'a kill -9 does not leave stuck, (\d+) bad inputs in one table',
     [len(CLI_TABLE)]),
    ('docs/using.md', r'for sampling and scoring of models at least (\d+) wide',
     [constant('plumbing/device.py', 'CPU_BF16_MIN_WIDTH')]),
    ('docs/using.md', r'\((\d+) in all by default\)',
     [int(re.search(r'budget="\$\{2:-(\d+)\}"', open(os.path.join(ROOT, 'job/gpu_check.sh')).read())[1])]),
    ('docs/guarantees.md', r'would not fit in (\d+)% of the memory',
     [100 * constant('plumbing/budget.py', 'MEMORY_SHARE')]),
    ('docs/guarantees.md', r'`negatives\.py` stores at most ([\d,]+) samples per prefix',
     [constant('plumbing/run.py', 'MAX_SAMPLES')]),
    ('docs/guarantees.md', r'LM samples per prefix at most ([\d,]+)',
     [constant('plumbing/run.py', 'MAX_SAMPLES')]),
    ('docs/guarantees.md', r'`--dpi` at most ([\d,]+)', [constant('job/figures.py', 'MAX_DPI')]),
    ('docs/guarantees.md', r'holding a number beyond (1e\d+)', [constant('data/__init__.py', 'JSON_BOUND')]),
    ('docs/guarantees.md', r'NAME_MAX \((\d+) bytes; the last\s+name (\d+) less',
     [255, constant('plumbing/run.py', 'TMP_ROOM')]),
]


# docs/reports.md: the sizes of --ordering (DEFAULT)
CLAIMS += [
    ('docs/reports.md', r'each LM snapshot with its own ([\d,]+) x (\d+) negatives and a [\d,]+-step BIT '
                        r'\(that run\'s;\s+`--ordering` now trains (\d+) steps\), (\d+) val\s+prefixes, '
                        r'n = (\d+)\.',
     [DEFAULT['ordering']['train_prefixes'], NEG['num_samples']]
     + [DEFAULT['ordering'][k] for k in ('bit_iters', 'num_prefixes', 'num_samples')]),
]

# docs/nanogpt.md's learner's path: each step's lines after, exactly (the before column is history), and
# the lines of the KV cache it skips
CLAIMS += [('docs/nanogpt.md', rf'\| {step}\. [^|]+\|[^|]+\| \d+[^|]*\| (\d+)', [lines_to_read(step)])
           for step in READING] + [
    ('docs/nanogpt.md', r'`KVCache`, `empty_cache`, `cached_attention`, `shared_prompt_attention`, '
                        r'(\d+) lines',
     [sum(code_lines('model.py', f) for f in ('KVCache', 'empty_cache', 'cached_attention',
                                               'shared_prompt_attention'))]),
]

# (doc, regex, the counts in the code): lines, claimed "about", within LINE_TOLERANCE
LINE_TOLERANCE = 0.05
LINE_CLAIMS = [
    ('docs/nanogpt.md', r'`nce_train\.py` \(about (\d+) lines, `main` about (\d+) of them\)',
     [file_lines('nce_train.py'), function_lines('nce_train.py', 'main')]),
]


def docs_text():
    return {d: read(d) for d in {c[0] for c in CLAIMS + LINE_CLAIMS}}


def test_doc_numbers_equal_the_code():
    """Every row of CLAIMS: the doc's numbers equal job/configs.py's values and the counts in the code."""
    assert len(CLAIMS) >= 25
    bad = mismatches(CLAIMS, docs_text())
    assert not bad, '\n'.join(bad)


def where_they_are(text):
    """docs/nanogpt.md's "Where they are (after)": each (path, name, first, last) it states, from the
    `path`: that opens a file's names and each `name` first-last (or a single line) after it, 'loop'
    for "its loop first-last" (main's while loop); what follows "Before:" is history, not read."""
    section = text[text.index('Where they are (after)'):]
    out, path = [], None
    for item in re.findall(r'^\d\. (.*?)(?=^\d\. |\Z)', section, re.M | re.S):
        after = item.split('Before:')[0]
        for m in re.finditer(r'`([\w/]+\.py)`:|`([\w.]+)` (\d+)(?:-(\d+))?|its (loop) (\d+)-(\d+)', after):
            if m[1]:
                path = m[1]
            else:
                name, first, last = (m[2], m[3], m[4]) if m[2] else ('main:loop', m[6], m[7])
                out.append((path, name, int(first), int(last or first)))
    return out


def span(path, name):
    """(first, last) line of a top-level def, class or assignment, a method 'Class.method' (from its
    first decorator, if any), or 'main:loop', main's while loop."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding='utf-8').read())
    outer, _, inner = name.replace(':', '.').partition('.')
    node = next(n for n in tree.body if getattr(n, 'name', None) == outer or isinstance(n, ast.Assign)
                and getattr(n.targets[0], 'id', None) == outer)
    if inner == 'loop':
        node = next(n for n in ast.walk(node) if isinstance(n, ast.While))
    elif inner:
        node = next(n for n in node.body if getattr(n, 'name', None) == inner)
    return min([d.lineno for d in getattr(node, 'decorator_list', [])] + [node.lineno]), node.end_lineno


def test_where_they_are_points_at_the_code():
    """Every line range docs/nanogpt.md gives for the learner's path is where the code has it now; a
    range off by a line is found."""
    text = open(os.path.join(ROOT, 'docs/nanogpt.md'), encoding='utf-8').read()
    stated = where_they_are(text)
    assert len(stated) >= 25 and {p for p, *_ in stated} >= {'model.py', 'energy.py', 'nce_train.py'}
    wrong = [(p, n, (a, b), span(p, n)) for p, n, a, b in stated if span(p, n) != (a, b)]
    assert not wrong, wrong
    planted = text.replace('`nce_loss` 90-106', '`nce_loss` 90-105')
    assert [n for p, n, a, b in where_they_are(planted) if span(p, n) != (a, b)] == ['nce_loss']


def resume_table():
    """docs/guarantees.md's resume table: {row's first cell: set of flags in its 'fixed' cell}."""
    rows = re.findall(r'^ *\| (both trainers|`[\w/.]+`[^|]*) \| ([^|]+) \|', read_lines('docs/guarantees.md'),
                      re.M)
    return {name.split('`')[1] if '`' in name else name: set(re.findall(r'`--(\w+)`', fixed))
            for name, fixed in rows}


def read_lines(path):
    return open(os.path.join(ROOT, path), encoding='utf-8').read()


def test_the_resume_table_lists_every_flag_a_resume_keeps():
    """Each flag a --resume keeps from the checkpoint (plumbing.guards' LM_RESUME_FIXED and
    NCE_RESUME_FIXED, by flag name; extensions.exo's FIXED) is in docs/guarantees.md's table, in its
    trainer's row or the trainers' shared one."""
    from extensions.exo import FIXED
    from plumbing.guards import LM_RESUME_FIXED, NCE_RESUME_FIXED
    table, missing = resume_table(), {}
    for row, code, flag, shared in (('train_lm.py', LM_RESUME_FIXED, {}, True),
                                    ('nce_train.py', NCE_RESUME_FIXED, {'energy': 'body'}, True),
                                    ('extensions/exo.py', FIXED, {'K': 'num_samples'}, False)):
        stated = table[row] | (table['both trainers'] if shared else set())
        missing[row] = sorted({flag.get(dest, dest) for dest in code} - stated)  # flag: its dest's flag
    assert not any(missing.values()), missing


def test_every_test_file_is_named_in_the_guarantees():
    """docs/guarantees.md's Tests section names every tests/test_*.py (what each file is for)."""
    text = read_lines('docs/guarantees.md').split('## Tests')[1]
    files = sorted(f for f in os.listdir(os.path.join(ROOT, 'tests')) if re.match(r'test_\w+\.py$', f))
    assert len(files) >= 30 and not [f for f in files if f'`{f}`' not in text]


def test_doc_line_counts_within_five_percent():
    bad = mismatches(LINE_CLAIMS, docs_text(), LINE_TOLERANCE)
    assert not bad, '\n'.join(bad)


def test_each_step_of_the_learners_path_fits():
    """Each step of README's reading order reads at most MAX_STEP_LINES lines of code in full (READING)."""
    long = {step: lines_to_read(step) for step in READING if lines_to_read(step) > MAX_STEP_LINES}
    assert not long, long


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
# what the project is, not how it was made: no words of the organisation that ran its work

ORGANISATIONAL = (r'\blent\b|\blease\b|\bleases\b|device tool|\blending\b|this session|\bthe '
                  r'issue\b|\bissues? \d+')
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
    planted = {'docs/using.md': 'no GPU was lent for it (issue 46)',
               'assets/x.json': '{"note": "the lease ran out"}',
               DATED_NOTES: '## 2026-11-28 (issue 46): the issue asked this session for it; release 2'}
    found = organisational_words(planted)
    assert [f for f, _ in found] == ['docs/using.md'] * 2 + ['assets/x.json'] + [DATED_NOTES] * 2, found


def test_readme_reading_order_is_the_learners_path():
    """README's reading order within its first 1,500 characters, each step naming every function of
    READING (docs/nanogpt.md's path) and its lines to read as the code has them now."""
    readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    assert readme.index('## Reading order') < 1500
    order = ' '.join(readme.split('## Reading order')[1].split('\n## ')[0].split())
    steps = dict(re.findall(r'(?:^| )(\d)\. (.*?)(?= \d\. |$)', order.split(' `test_all.py`')[0]))
    assert sorted(int(k) for k in steps) == sorted(READING), steps
    for step, names in READING.items():
        text = steps[str(step)]
        named = lambda w: re.search(rf'`([\w/]+\.)*{w}`', text)  # `x`, `energy.x`, `GPT.x`
        parts = lambda n: n.split(':')[0].split('.')  # GPT.generate_plain: its name; Energy.kind: its class
        missing = [n for _, n in names if not (named(parts(n)[-1]) or named(parts(n)[0]))]
        assert not missing, (step, missing)
        assert f'({lines_to_read(step)} lines' in text, (step, lines_to_read(step), text)

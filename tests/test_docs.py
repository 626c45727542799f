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
     [PPL['num_prefixes'], PPL['num_prefixes'], PPL['num_samples']]),
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
    ('README.md', r'EXO-distilled LM \(K = (\d+)\)', [ADDITION['exo']['num_samples']]),
    # docs/using.md: the stage commands of the main job
    ('docs/using.md', r'train_lm\.py --out_dir out/lm --lr_decay_iters (\d+) --max_iters (\d+) '
                      r'--patience (\d+) --min_rel_delta ([\d.]+)',
     [LM['lr_decay_iters'], LM['max_iters'], LM['patience'], LM['min_rel_delta']]),
    ('docs/using.md', r'--split train --out_dir out/neg_train --num_prefixes (\d+) --num_samples (\d+)',
     [NEG['train_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--split select --out_dir out/neg_select --num_prefixes (\d+) --num_samples (\d+)',
     [NEG['select_prefixes'], NEG['num_samples']]),
    ('docs/using.md', r'--objective mlm --alibi --n_embd (\d+) --n_head (\d+)',
     [MLM['n_embd'], MLM['n_head']]),
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

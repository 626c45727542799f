"""The commands the docs give, against the code: docs/using.md's step-by-step commands are the stage
commands job/reproduce.py builds (so they train the job's models, not a script's defaults), and the
scripts it says take --dtype are those that declare it. The docs' numbers: test_docs.py.
"""

import os
import re

from tests.common import ROOT, job_commands


# -----------------------------------------------------------------------------
# docs/using.md's "Step by step": each command is the job's own (job/reproduce.py's stages), so
# that it trains the job's models, not a script's defaults

# the run's, not the recipe's
STEPS_IGNORED = {'seed', 'device', 'dtype', 'data_dir', 'quiet', 'resume', 'force',
                 'snapshots', 'final_eval', 'final_eval_windows', 'num_samples_printed'}
TRAINERS = {'train_lm.py', 'negatives.py', 'nce_train.py'}  # their command in full: the model it trains


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
            given = job.get(k, [])
            same = (set(v) <= set(given) if len(v) > 1  # --energy A=a B=b: some of the job's
                    else len(given) == len(v) and all(map(same_value, v, given)))
            if k not in STEPS_IGNORED and not same:
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
    """The check can fail: a flag left out (the script's default differs) and a wrong value each give
    a line."""
    text = open(os.path.join(ROOT, 'docs/using.md'), encoding='utf-8').read()
    cmds = job_commands()
    dropped = re.sub(r'(train_lm\.py --out_dir out/lm.*?) --n_embd \d+', r'\1', text, count=1)
    assert any('n_embd is 256' in b for b in step_mismatches(step_by_step(dropped), cmds))
    wrong = text.replace('--num_prefixes 8000', '--num_prefixes 800', 1)
    assert any('--num_prefixes 800,' in b for b in step_mismatches(step_by_step(wrong), cmds))


def takes_dtype(path):
    """Whether the script declares --dtype: through plumbing's common_flags, the trainers' parser, or
    its own add_argument (then its default)."""
    src = open(os.path.join(ROOT, path), encoding='utf-8').read()
    own = re.search(r"\('--dtype', default='(\w+)'", src)
    declared = re.search(r"common_flags\([^)]*'dtype'", src) or 'training_parser(' in src
    return own.group(1) if own else bool(declared)


def test_the_scripts_that_take_dtype_are_those_the_docs_name():
    """docs/using.md's "Device and precision": the scripts it says take --dtype do, the one it says runs
    in fp32 does not, and exact_logz's --dtype has the default it says."""
    text = ' '.join(open(os.path.join(ROOT, 'docs/using.md'), encoding='utf-8').read().split())
    named = re.search(r'those that train, sample or score under autocast \(([^)]+)\) also take `--dtype`',
                      text)
    fp32 = re.search(r'(`[\w/]+\.py`) runs in fp32', text)
    default = re.search(r"`extensions/exact_logz\.py`'s `--dtype` defaults to (\w+)", text)
    assert named and fp32 and default, 'reword the test with docs/using.md'
    scripts = re.findall(r'`([\w/]+\.py)`', named.group(1))
    assert len(scripts) >= 6 and all(takes_dtype(s) is True for s in scripts), scripts
    assert not any(takes_dtype(s.strip('`')) for s in fp32.groups())
    assert takes_dtype('extensions/exact_logz.py') == default.group(1)
    stages = ('train_lm.py', 'nce_train.py', 'negatives.py', 'estimate_ppl.py', 'sample.py',
              'extensions/metric_ebm.py', 'extensions/exo.py', 'extensions/addition_eval.py')
    assert {s for s in stages if takes_dtype(s)} == set(scripts), 'a stage script the sentence leaves out'

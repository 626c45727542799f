"""The main job and its reports, each a module run from the repo root:

    python -m job.reproduce       the paper's Table 1, claims and figures, end to end (run.sh)
    python -m job.claims          the paper's claims C1-C7 and the talk's T1-T3, measured
    python -m job.figures         Figs. 1-4 from the main job's JSON
    python -m job.human_eval      Table 2's protocol: blinded A/B items, binomial test
    python -m job.seeds           the addition table over seeds: mean, spread, paired tests
    python -m job.lookahead       committed outcomes regrouped by each problem's lookahead
    python -m job.exo_budget      EXO's budget curve from the runs kept in assets
    python -m job.bench           building blocks timed against naive baselines

with reproduce's recipes in configs.py and its make-like scheduler in pipeline.py, the claims'
statistical tests in stats.py, and what the
reports share: parse_report_flags, read_report, the one way claims.py and figures.py read the main job's
JSON, checked for its shape, finite numbers and coming from one run; what is wrong is one line,
`<file>: <what is wrong>; <the fix>`.
"""

import math
import os

from data import read_json
from plumbing import check_new, check_writable, common_flags, file_hash

from job.pipeline import check_chain

NUMBER = 'a number'  # a shape: an int or a float (JSON's null, a NaN when written, is not one)
NUMBER_OR_NULL = 'a number or null'  # e.g. a standard error, null where it was NaN
NUMBERS = [NUMBER]
KINDS = {dict: 'an object', list: 'a list', str: 'a string', int: 'an integer', bool: 'true or false'}
FROM_ONE_RUN = ("rerun it and estimate_ppl.py on one run's models (reproduce.py reruns what is stale), "
                "or give the --out_dir of that one run")


def parse_report_flags(p, argv):
    """The arguments of a report from committed files (lookahead, exo_budget): --force, --quiet and an
    unused --seed declared, then --out and --plot (None: no figure) checked writable and new."""
    common_flags(p, 'force', 'seed', 'quiet', help=dict(seed='unused: nothing here is random',
                                                        force='replace --out and --plot',
                                                        quiet='no table printed (it is still written)'))
    args = p.parse_args(argv)
    for path, flag in ((args.out, '--out'), (args.plot, '--plot')):
        if path is not None:
            check_writable(path, flag, folder=False)
            check_new(path, flag, args.force)
    return args


def read_report(out_dir, name, fix, shape=dict):
    """out_dir/name as JSON with the shape `shape` (shape_problem) and every number finite, and
    of this run: the file its stage recorded, made from what the run holds (pipeline.check_chain)."""
    path = os.path.join(out_dir, name)
    obj = read_json(path, fix)
    check_chain(out_dir, name)
    check_shape(obj, shape, path, fix)
    return obj


def check_shape(obj, shape, path, fix, where=''):
    """One line naming the file `path`, where in it (`where`: the keys to obj), and `fix`, if obj
    holds a NaN or an infinity or does not have the shape."""
    problem = non_finite(obj, where) or shape_problem(obj, shape, where)
    if problem:
        raise ValueError(f"{path}: {problem}; {fix}")


def non_finite(obj, where=''):
    """Where obj holds a NaN or an infinity (Python's json reads them; no rebm script writes them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{where or 'the file'} is {'NaN' if math.isnan(obj) else obj}, not a finite number"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    return next((p for k, v in items if (p := non_finite(v, key_path(where, k)))), None)


def key_path(where, key):
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)


def kind(obj):
    if obj is None:
        return 'null'
    return 'a number' if isinstance(obj, float) else KINDS[bool if isinstance(obj, bool) else type(obj)]


def shape_problem(obj, shape, where=''):
    """What keeps obj from having `shape`, or None. A shape is a type (dict, list, str, int, bool),
    NUMBER or NUMBER_OR_NULL, [shape] (a list of items of that shape), or {key: shape} (an object
    with these keys: 'key?' optional, '*' every key)."""
    at = where or 'the file'
    if isinstance(shape, dict):
        if not isinstance(obj, dict):
            return f"{at} is {kind(obj)}, not an object"
        for key, inner in shape.items():
            name = key.rstrip('?')
            keys = obj if key == '*' else [] if key.endswith('?') and name not in obj else [name]
            for k in keys:
                if k not in obj:
                    return f"{key_path(where, k)} is missing"
                if problem := shape_problem(obj[k], inner, key_path(where, k)):
                    return problem
        return None
    if isinstance(shape, list):
        if not isinstance(obj, list):
            return f"{at} is {kind(obj)}, not a list"
        return next((p for i, v in enumerate(obj) if (p := shape_problem(v, shape[0], key_path(where, i)))),
                    None)
    number = isinstance(obj, (int, float)) and not isinstance(obj, bool)
    ok = (number if shape == NUMBER else number or obj is None if shape == NUMBER_OR_NULL
          else isinstance(obj, shape) and not (shape is int and isinstance(obj, bool)))
    return None if ok else f"{at} is {kind(obj)}, not {KINDS.get(shape, shape)}"


def check_same_lm(samples, samples_path, ppl, ppl_path):
    """samples.json (sample.py) sampled the LM that ppl.json scored: its --lm, where that file is
    still there, has ppl.json's hash of the BASE LM (a file copied from another run has not)."""
    lm, want = samples.get('args', {}).get('lm'), ppl.get('hashes', {}).get('BASE LM')
    if isinstance(lm, str) and want and os.path.isfile(lm) and file_hash(lm) != want:
        raise ValueError(f"{samples_path}: its --lm {lm} is not the LM that {ppl_path} scored "
                         f"(the two are from different runs); {FROM_ONE_RUN}")


def check_same_model(results, results_path, model, ppl, ppl_path):
    """An LM's results.json (train_lm.py) is of the `model` that ppl.json scored: the same number
    of parameters, and the best.pt beside it, where there, has ppl.json's hash of that model."""
    params = {r['model']: r['params'] for r in ppl['rows']}.get(model)
    if params is not None and params != results['params']:
        raise ValueError(f"{results_path}: its LM has {results['params']:,} parameters, but the {model} "
                         f"that {ppl_path} scored has {params:,} (the two are from different runs); "
                         f"{FROM_ONE_RUN}")
    best, want = os.path.join(os.path.dirname(results_path), 'best.pt'), ppl.get('hashes', {}).get(model)
    if want and os.path.isfile(best) and file_hash(best) != want:
        raise ValueError(f"{results_path}: its best.pt is not the {model} that {ppl_path} scored "
                         f"(the two are from different runs); {FROM_ONE_RUN}")


CLAIMS_INPUTS = ('ppl.json', 'samples.json')


def input_hashes(out_dir):
    """The hashes of what claims.py measured in out_dir, which claims.json records."""
    return {name: file_hash(os.path.join(out_dir, name)) for name in CLAIMS_INPUTS}


def check_claims_inputs(claims, claims_path, out_dir):
    """claims.json was measured on out_dir's ppl.json and samples.json as they are (a claims.json
    written before it recorded their hashes is taken as it is)."""
    for name, want in claims.get('inputs', {}).items():
        path = os.path.join(out_dir, name)
        if name in CLAIMS_INPUTS and os.path.isfile(path) and file_hash(path) != want:
            raise ValueError(f"{claims_path}: it was measured on another {name} than {path} (from "
                             f"another run, or before that file was rewritten); rerun claims.py "
                             f"(reproduce.py reruns it)")


# accuracy.json (extensions/addition_eval.py, a task with a known answer), read by claims.py, seeds.py
ACCURACY = {'ns': [int], 'per_problem': {'*': {'*': NUMBERS}}}
ACCURACY_FIX = 'rerun python -m extensions.addition_eval (reproduce.py --data addition runs it)'

# the decoders compared on addition (accuracy.json), each pair on the same problems and, for the
# decoders among n samples, the same n samples of the base LM: (better, worse) as (model, column)
DECODERS = {'JOINT': ('a1', 'mode', 'beam'), 'BASE LM': ('greedy', 'majority', 'rerank'),
            'BALM': ('greedy', 'rerank')}
DECODER_NAMES = {('JOINT', 'a1'): 'Alg. 1', ('JOINT', 'mode'): 'joint mode',
                 ('JOINT', 'beam'): 'joint mode over beam + samples',
                 ('BASE LM', 'greedy'): 'LM greedy',
                 ('BASE LM', 'majority'): 'LM majority vote', ('BASE LM', 'rerank'): 'LM log-prob rerank',
                 ('BALM', 'greedy'): 'BALM greedy', ('BALM', 'rerank'): 'BALM log-prob rerank',
                 ('EXO', 'greedy'): 'EXO LM greedy'}


def decoder_pairs(acc):
    """[(what, better, worse)]: the decoders compared on addition, each joint decoder at the largest n
    against each LM decoder, and the EXO LM's greedy against the base LM's, and BALM's where it has
    BALM's size (distilled from it: the job's EXO); better and worse name accuracy.json's per-problem
    columns as (model, column)."""
    per, n = acc['per_problem'], max(acc['ns'])
    col = lambda model, how: (model, f'{how}_exact' if how == 'greedy' else f'{how}_{n}_exact')
    pairs = [((j, 'JOINT'), (how, model)) for j in DECODERS['JOINT'] if col('JOINT', j)[1] in per['JOINT']
             for model in ('BASE LM', 'BALM') if model in per for how in DECODERS[model]]
    size = {r['model']: r.get('params') for r in acc.get('rows', [])}
    exo_vs = ['BASE LM'] + ['BALM'] * (size.get('EXO') is not None and size.get('EXO') == size.get('BALM'))
    pairs += [(('greedy', 'EXO'), ('greedy', worse)) for worse in exo_vs if 'EXO' in per and worse in per]
    return [(f"{DECODER_NAMES[m1, h1]} > {DECODER_NAMES[m2, h2]}" + (f" (n = {n})" if m1 == 'JOINT' else ''),
             col(m1, h1), col(m2, h2)) for (h1, m1), (h2, m2) in pairs]

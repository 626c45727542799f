"""docs/addition.md's tables over seeds cannot drift from the committed tables (assets/seeds_addition*.json):
each number they state equals the table's to the digits given (SEED_CLAIMS), as tests/test_doc_results.py
does for the other committed runs.
"""

import math
import os
import re
from types import SimpleNamespace

import numpy as np

from job.seeds import spread
from job.stats import sign_test_log_p
from tests.common import ROOT, asset, assert_json_claims_hold, by

SEED_CLAIMS = []

# docs/addition.md's three seeds of the earlier recipe (assets/seeds_addition_earlier_recipe.json): mean (SD)
# [min, max] of exact match
SEEDS = by(asset('seeds_addition_earlier_recipe.json')['rows'], 'model', 'method')


def seeds(model, method, spread=False):
    e = SEEDS[model, method]['exact']
    return [e['mean'], e['sd']] + ([e['min'], e['max']] if spread else [])


M_SD, M_SD_RANGE = r'([\d.]+) \(([\d.]+)\)', r'([\d.]+) \(([\d.]+)\) \[([\d.]+), ([\d.]+)\]'
SEED_CLAIMS += [
    ('docs/addition.md', rf'\| BASE LM greedy / majority of 64 / log-prob rerank of 64 \| {M_SD_RANGE} / '
                         rf'{M_SD} / {M_SD} \|',
     seeds('BASE LM', 'greedy', True) + seeds('BASE LM', 'majority vote, n = 64')
     + seeds('BASE LM', 'log-prob rerank, n = 64')),
    ('docs/addition.md', rf'\| BASE LM, any of 64 correct \| {M_SD} \|', seeds('BASE LM', 'oracle, n = 64')),
    ('docs/addition.md', rf'\| BALM greedy / log-prob rerank of 64 \| {M_SD_RANGE} / {M_SD} \|',
     seeds('BALM', 'greedy', True) + seeds('BALM', 'log-prob rerank, n = 64')),
    ('docs/addition.md', rf'\| TaiLr LM greedy \| {M_SD} \|', seeds('TAILR', 'greedy')),
    ('docs/addition.md', rf'\| EXO LM greedy \| {M_SD_RANGE} \|', seeds('EXO', 'greedy', True)),
    ('docs/addition.md', rf'\| \*\*JOINT Algorithm 1, n = 64\*\* \| \*\*{M_SD}\*\* \[([\d.]+), ([\d.]+)\] \|',
     seeds('JOINT', 'Algorithm 1, n = 64', True)),
    ('docs/addition.md', rf'\| \*\*JOINT mode, n = 64\*\* \| \*\*{M_SD}\*\* \[([\d.]+), ([\d.]+)\] \|',
     seeds('JOINT', 'joint mode, n = 64', True)),
]
# docs/addition.md's seeds of the faster recipe (assets/seeds_addition.json)
FAST = by(asset('seeds_addition.json')['rows'], 'model', 'method')


def fast(model, method):
    e = FAST[model, method]['exact']
    return [e['mean'], e['sd'], e['min'], e['max']]


SEED_CLAIMS += [
    ('docs/addition.md', rf'\| BASE LM greedy, faster recipe \| {M_SD_RANGE} \|', fast('BASE LM', 'greedy')),
    ('docs/addition.md', rf'\| BALM greedy, faster recipe \| {M_SD_RANGE} \|', fast('BALM', 'greedy')),
    ('docs/addition.md', rf'\| JOINT Algorithm 1 of 64, faster recipe \| {M_SD_RANGE} \|',
     fast('JOINT', 'Algorithm 1, n = 64')),
    ('docs/addition.md', rf'\| JOINT mode of beam \+ 64, faster recipe \| {M_SD_RANGE} \|',
     fast('JOINT', 'joint mode, beam + samples, n = 64')),
    ('docs/addition.md', rf'\| JOINT mode of beam \+ 1 sample \| {M_SD_RANGE} \|',
     fast('JOINT', 'joint mode, beam + samples, n = 1')),
    ('docs/addition.md', rf'\| EXO LM greedy, faster recipe \| {M_SD_RANGE} \|', fast('EXO', 'greedy')),
]
# docs/addition.md's LM of 7,000 steps (assets/seeds_addition_lm7000.json) beside the job's table at its seeds
LM7000 = asset('seeds_addition_lm7000.json')
L7 = by(LM7000['rows'], 'model', 'method')
AT_SEEDS = [asset('seeds_addition.json')['seeds'].index(s) for s in LM7000['seeds']]


def lm7000(label, model, method):
    """A table row: LM7000's mean (SD) [min, max], then the job's at the same seeds (seeds.spread)."""
    new, old = L7[model, method]['exact'], FAST[model, method]['exact']['per_seed']
    at_seeds = spread([old[i] for i in AT_SEEDS])
    return ('docs/addition.md', rf'\| {re.escape(label)} \| {M_SD_RANGE} \| {M_SD_RANGE} \|',
            [d[k] for d in (new, at_seeds) for k in ('mean', 'sd', 'min', 'max')])


def five(label):  # a row of the table by seed: exactly five values (the seeds' tables above have ten)
    return rf'\| {re.escape(label)} \|' + r' ([\d.]+) \|' * len(LM7000['seeds']) + r'(?! [\d.])'


def t_range(comparisons):
    """The seed-level t p's min and max over `comparisons`, then those of its Holm-adjusted value."""
    return [f(c['seed_level'][k] for c in comparisons) for k in ('t_p', 't_p_holm') for f in (min, max)]


L7_JOINT = [c for c in LM7000['comparisons'] if c['better'][0] == 'JOINT']
L7_BEAM = [c for c in L7_JOINT if 'beam' in c['what']]
(L7_BEAM_SIGN,) = {tuple(c['seed_level']['sign']) for c in L7_BEAM}  # the doc gives one sign test for all
BEAM_64, A1_64 = L7['JOINT', 'joint mode, beam + samples, n = 64'], L7['JOINT', 'Algorithm 1, n = 64']
SEED_CLAIMS += [lm7000(*row) for row in (
    ('LM greedy', 'BASE LM', 'greedy'), ('LM, log-prob rerank of 64', 'BASE LM', 'log-prob rerank, n = 64'),
    ('LM, any of 64 correct', 'BASE LM', 'oracle, n = 64'), ('BALM greedy', 'BALM', 'greedy'),
    ('BALM, log-prob rerank of 64', 'BALM', 'log-prob rerank, n = 64'),
    ('joint: Algorithm 1 of 64', 'JOINT', 'Algorithm 1, n = 64'),
    ('joint: mode of 64', 'JOINT', 'joint mode, n = 64'),
    ('joint: mode of beam + 1 sample', 'JOINT', 'joint mode, beam + samples, n = 1'),
    ('joint: mode of beam + 64', 'JOINT', 'joint mode, beam + samples, n = 64'))] + [
    ('docs/addition.md', five('LM greedy'), L7['BASE LM', 'greedy']['exact']['per_seed']),
    ('docs/addition.md', five('joint: mode of beam + 64'), BEAM_64['exact']['per_seed']),
    ('docs/addition.md', five('P(correct), joint model'), A1_64['p_correct']['per_seed']),
    ('docs/addition.md', r'Holm over the (\d+) comparisons\): every joint decoder beats every LM decoder and '
                         r'BALM on average over the seeds, t p ([\d.]+) to ([\d.]+) \(Holm ([\d.]+) to '
                         r'([\d.]+)\); the mode over the beam and the samples at p ([\d.]+) to ([\d.]+) '
                         r'\(Holm ([\d.]+) to ([\d.]+)\), sign test (\d)-(\d)',
     [len(LM7000['comparisons'])] + t_range(L7_JOINT) + t_range(L7_BEAM) + list(L7_BEAM_SIGN)),
]
# the same five seeds on the test split's 5,000 problems (assets/seeds_addition_lm7000_test5000.json)
T5000 = asset('seeds_addition_lm7000_test5000.json')
T5 = by(T5000['rows'], 'model', 'method')
T5_BEAM = [c for c in T5000['comparisons'] if 'beam' in c['what']]
T5_MODE = T5['JOINT', 'joint mode, beam + samples, n = 64']['exact']
t5 = lambda model, method: T5[model, method]['exact']['mean']
SEED_CLAIMS += [
    ('docs/addition.md', r'the mode over the beam and the samples ([\d.]+) \(SD ([\d.]+); by seed ([\d.]+), '
                         r'([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+)\), the mode of 64 ([\d.]+), LM greedy '
                         r'([\d.]+), the samples\' ceiling ([\d.]+), BALM greedy ([\d.]+)\.',
     [T5_MODE['mean'], T5_MODE['sd']] + T5_MODE['per_seed']
     + [t5('JOINT', 'joint mode, n = 64'), t5('BASE LM', 'greedy'), t5('BASE LM', 'oracle, n = 64'),
        t5('BALM', 'greedy')]),
    ('docs/addition.md', r'the seed as the unit: t p ([\d.]+) to ([\d.]+) \(Holm ([\d.]+)\); with the '
                         r'problem as the unit, Holm-adjusted p at most ([\d.]+)e-104',
     [min(c['seed_level']['t_p'] for c in T5_BEAM), max(c['seed_level']['t_p'] for c in T5_BEAM),
      max(c['seed_level']['t_p_holm'] for c in T5_BEAM),
      1e104 * max(c['p_holm'] for c in T5000['comparisons'])]),
    ('docs/addition.md', r'0\.993 on 1,000 problems, ([\d.]+) on (\d),000 with the 7,000-step LM',
     [T5_MODE['mean'], T5000['num_prefixes'] / 1000]),
]
# docs/addition.md's energies of 16,000 steps on the same LMs (assets/seeds_addition_lm7000_e16000.json)
E16 = asset('seeds_addition_lm7000_e16000.json')
L7E = by(E16['rows'], 'model', 'method')
E16_BEAM = [c for c in E16['comparisons'] if 'beam' in c['what']]
(E16_SIGN,) = {tuple(c['seed_level']['sign']) for c in E16_BEAM}
assert E16['seeds'] == LM7000['seeds']  # the table sets each seed's row beside LM7000's


def e16(label, method):
    """A row of the joint decoders: E16's mean (SD) [min, max], then LM7000's (the job's energies)."""
    return ('docs/addition.md', rf'\| {re.escape(label)} \| {M_SD_RANGE} \| {M_SD_RANGE} \|',
            [d['JOINT', method]['exact'][k] for d in (L7E, L7) for k in ('mean', 'sd', 'min', 'max')])


def e16_by_seed(label, model, method, key):
    return [(label + f', energies of {steps} steps', d[model, method][key]['per_seed'])
            for steps, d in (('16,000', L7E), ('8,000', L7))]


E16_SEED_ROWS = (e16_by_seed('joint: mode of beam + 64', 'JOINT', BEAM_64['method'], 'exact')
                 + e16_by_seed('P(correct), joint model', 'JOINT', 'Algorithm 1, n = 64', 'p_correct'))
SEED_CLAIMS += [e16(label, method) for label, method in (
    ('Algorithm 1 of 64', 'Algorithm 1, n = 64'), ('mode of 64', 'joint mode, n = 64'),
    ('mode of beam + 1 sample', 'joint mode, beam + samples, n = 1'),
    ('mode of beam + 64', 'joint mode, beam + samples, n = 64'))] + [
    ('docs/addition.md', five(label), values) for label, values in E16_SEED_ROWS] + [
    ('docs/addition.md', r'table above \(LM greedy ([\d.]+), any of 64 correct ([\d.]+), BALM greedy '
                         r'([\d.]+)\)',
     [L7E[m, how]['exact']['mean'] for m, how in (('BASE LM', 'greedy'), ('BASE LM', 'oracle, n = 64'),
                                                  ('BALM', 'greedy'))]),
    ('docs/addition.md', r'Holm over the (\d+) comparisons\): it beats every LM decoder and BALM\'s at t p\s+'
                         r'([\d.e-]+) to ([\d.]+) \(Holm ([\d.]+) to ([\d.]+)\), sign test (\d)-(\d) .{0,60}?'
                         r'Holm-adjusted p at most ([\d.]+)e-36',
     [len(E16['comparisons'])] + t_range(E16_BEAM) + list(E16_SIGN)
     + [1e36 * max(c['p_holm'] for c in E16['comparisons'])]),
    ('README.md', r'Longer budgets \(`--lm_max_iters 7000 --energy_max_iters 16000`, (\d) seeds\)\s+lift the '
                  r'beam\'s mode to \*\*([\d.]+)\*\*',
     [len(E16['seeds']), L7E['JOINT', BEAM_64['method']]['exact']['mean']]),
]
# docs/addition.md's seeds on 10,000 test problems (assets/seeds_addition_lm7000_e16000_test10000.json)
T10K = asset('seeds_addition_lm7000_e16000_test10000.json')
T10 = by(T10K['rows'], 'model', 'method')
T10_BEAM = [c for c in T10K['comparisons'] if 'beam' in c['what']]
T10_EXO = next(c for c in T10K['comparisons'] if c['what'] == 'EXO LM greedy > BALM greedy')
T10_MODE, T10_CEIL = (T10[m]['exact'] for m in (('JOINT', BEAM_64['method']), ('BASE LM', 'oracle, n = 64')))


def sci(log_p):
    """p as the doc writes it from its log, 7.1e-248: [7.1, 248]."""
    e = math.floor(log_p / math.log(10))
    return [10 ** (log_p / math.log(10) - e), -e]


def t10(label, model, method):
    """A row: mean (SD) [min, max] over the seeds, then each seed's exact match."""
    e = T10[model, method]['exact']
    pattern = rf'\| {re.escape(label)} \| {M_SD_RANGE} \|' + r' ([\d.]+) \|' * len(T10K['seeds'])
    return 'docs/addition.md', pattern, [e[k] for k in ('mean', 'sd', 'min', 'max')] + e['per_seed']


T10_LONGEST = max(T10K['by_carry_chain']['count'], key=int)  # greedy exact match by longest carry chain:
T10_BY = {m: T10K['by_carry_chain']['exact'][m]['greedy_exact'] for m in ('BALM', 'EXO')}
T10_ABOVE = sum(a > b for a, b in zip(T10_MODE['per_seed'], T10_CEIL['per_seed']))
T10_EXO_SEEDS = [T10_EXO['seed_level'][k] for k in ('sign', 't_p', 't_p_holm')]
SEED_CLAIMS += [t10(*row) for row in (
    ('LM greedy', 'BASE LM', 'greedy'), ('LM, majority vote of 64', 'BASE LM', 'majority vote, n = 64'),
    ('LM, log-prob rerank of 64', 'BASE LM', 'log-prob rerank, n = 64'),
    ('LM, any of 64 correct', 'BASE LM', 'oracle, n = 64'), ('BALM greedy', 'BALM', 'greedy'),
    ('BALM, log-prob rerank of 64', 'BALM', 'log-prob rerank, n = 64'),
    ('EXO LM greedy (from BALM)', 'EXO', 'greedy'),
    ('joint: Algorithm 1 of 64', 'JOINT', 'Algorithm 1, n = 64'),
    ('joint: mode of 64', 'JOINT', 'joint mode, n = 64'),
    ('joint: mode of beam + 1 sample', 'JOINT', 'joint mode, beam + samples, n = 1'),
    ('joint: mode of beam + 64', 'JOINT', BEAM_64['method']))] + [
    ('docs/addition.md', r'samples is at\s+([\d.]+) on average, above the samples\' ceiling \(([\d.]+): '
                         r'higher at (\d) of the (\d) seeds\)',
     [T10_MODE['mean'], T10_CEIL['mean'], T10_ABOVE, len(T10K['seeds'])]),
    ('docs/addition.md', r'Holm over the (\d+) comparisons\): it beats\s+every LM decoder and BALM\'s at '
                         r't p\s+([\d.e-]+) to ([\d.]+)\s+\(Holm ([\d.e-]+) to ([\d.]+)\); the sign test',
     [len(T10K['comparisons'])] + t_range(T10_BEAM)),
    ('docs/addition.md', r'problem as the unit, Holm-adjusted p at most ([\d.]+)e-(\d+)\.\s+Its\s+cost per '
                         r'problem is that of 1,000', sci(max(c['log_p_holm'] for c in T10_BEAM))),
    ('docs/addition.md', r'The EXO LM\'s greedy is ([\d.]+) against BALM\'s ([\d.]+), above\s+it at (\d) of '
                         r'the (\d) seeds [\s\S]{0,80}?the seed as the unit, t p ([\d.e-]+)\s+\(Holm '
                         r'([\d.e-]+)\); the problem as the unit, p ([\d.]+)e-(\d+)',
     [T10['EXO', 'greedy']['exact']['mean'], T10['BALM', 'greedy']['exact']['mean'], T10_EXO_SEEDS[0][0],
      len(T10K['seeds'])] + T10_EXO_SEEDS[1:] + sci(T10_EXO['log_p'])),
    ('docs/addition.md', r'BALM\'s greedy falls from ([\d.]+) with no carry chain to\s+([\d.]+) with a chain '
                         r'of (\d), EXO\'s from ([\d.]+) to ([\d.]+)',
     [T10_BY['BALM']['0'], T10_BY['BALM'][T10_LONGEST], int(T10_LONGEST), T10_BY['EXO']['0'],
      T10_BY['EXO'][T10_LONGEST]]),
    ('README.md', r'on 10,000 test problems \(`--test_problems 10000`, (\d) seeds\) to \*\*([\d.]+)\*\*,'
                  r'\s+above the samples\' ceiling \(([\d.]+)\), and every LM decoder and BALM at seed-level '
                  r't p at most ([\d.]+) \(Holm ([\d.]+)\)',
     [len(T10K['seeds']), T10_MODE['mean'], T10_CEIL['mean']] + t_range(T10_BEAM)[1::2]),
]
SEED_TESTS = {c['what']: c for c in asset('seeds_addition_earlier_recipe.json')['comparisons']}
OVER_BALM = [d for w, c in SEED_TESTS.items() if '> BALM' in w for d in c['diff_per_seed']]
EXO_SEEDS = SEED_TESTS['EXO LM greedy > LM greedy']
SEED_CLAIMS += [
    ('docs/addition.md', r'Holm over the (\d+) comparisons\): .{0,300}? by seed the margins over BALM are '
                         r'([\d.]+)-([\d.]+) points\. EXO\'s LM beats the\s+LM\'s greedy by ([\d.]+) points '
                         r'\(([\d.]+), ([\d.]+), ([\d.]+) by seed; p ([\d.]+)e-9\)',
     [len(SEED_TESTS), 100 * min(OVER_BALM), 100 * max(OVER_BALM), 100 * EXO_SEEDS['diff']]
     + [100 * d for d in EXO_SEEDS['diff_per_seed']] + [1e9 * EXO_SEEDS['p']]),
]

# README's and docs/addition.md's ten seeds of the lesson (assets/seeds_lesson.json: job.seeds --lesson)


def lesson_seeds(name):
    """A job.seeds --lesson table and its run's `time`: what the docs state of it, by name."""
    t = asset(name)
    rows = by(t['rows'], 'model', 'method')
    by_seed = t['time']['stage_seconds_by_seed'].values()
    comps = t['comparisons']
    return SimpleNamespace(
        table=t, time=t['time'], exact=lambda method, model='BASE LM': rows[model, method]['exact'],
        seed_s=[sum(s.values()) for s in by_seed],
        stages={k: [s[k] for s in by_seed] for k in ('lm', 'neg_train', 'unit', 'addition_eval')},
        pair={(c['better'][1], c['worse'][1]): c for c in comps},
        mode=[c for c in comps if c['better'][1] == 'mode_64_exact'],
        a1=[c for c in comps if c['better'][1] == 'a1_64_exact'])


def seed_time(ls):
    """The run's minutes and user CPU seconds, a seed's seconds (min, max), each stage's (min, max)."""
    return ([ls.time['wall_s'] / 60, ls.time['user_s'], min(ls.seed_s), max(ls.seed_s)]
            + [f(v) for v in ls.stages.values() for f in (min, max)])


def level(cs, key):
    return [c['seed_level'][key] for c in cs]


def one_sign(cs):
    """The sign test's count (seeds better, worse), one for every comparison in cs."""
    (count,) = {tuple(c['seed_level']['sign']) for c in cs}
    return count


LS4 = lesson_seeds('seeds_lesson.json')
LESSON = LS4.table
LS_A1_GREEDY = LS4.pair['a1_64_exact', 'greedy_exact']['diff_per_seed']
SEED_CLAIMS += [
    ('README.md', r'Ten lesson seeds \(`--lesson --at_once 2`\): ([\d.]+) min; the mode of 64 beats every '
                  r'LM decoder at all\s+(\d+) \(p ([\d.]+)\)',
     [LS4.time['wall_s'] / 60, one_sign(LS4.mode)[0], max(level(LS4.mode, 'sign_p'))]),
    ('docs/addition.md', r'--lesson --at_once 2`,\s+\*\*([\d.]+) min\*\* wall \(([\d,]+) s of user CPU; '
                         r'assets/seeds_lesson.json, its `time`[^)]{0,80}\)\. A seed took (\d+)-(\d+) s\s+of '
                         r'one core: the LM (\d+)-(\d+) s, the negatives (\d+)-(\d+) s, the UNIT (\d+)-(\d+) '
                         r's, the table (\d+)-(\d+) s',
     seed_time(LS4)),
    *[('docs/addition.md', rf'\| {re.escape(label)} \| {M_SD_RANGE} \|(?! [\d.])',  # its 2 columns
       [LS4.exact(method, model)[k] for k in ('mean', 'sd', 'min', 'max')]) for label, model, method in (
        ('LM greedy', 'BASE LM', 'greedy'), ('LM, majority vote of 64', 'BASE LM', 'majority vote, n = 64'),
        ('LM, log-prob rerank of 64', 'BASE LM', 'log-prob rerank, n = 64'),
        ('LM, any of 64 correct', 'BASE LM', 'oracle, n = 64'),
        ('joint: Algorithm 1 of 64', 'JOINT', 'Algorithm 1, n = 64'),
        ('joint: mode of 64', 'JOINT', 'joint mode, n = 64'))],
    ('docs/addition.md', r'\(Holm over the (\d) comparisons\), the mode of 64 beats each LM decoder at '
                         r'(\d+)\s+of 10 seeds \(sign test p ([\d.]+), Holm ([\d.]+); t over seeds p '
                         r'([\d.e-]+) to ([\d.e-]+)\)\. Algorithm 1 beats\s+each at (\d) of 10 \(sign test '
                         r'Holm ([\d.]+); t Holm ([\d.]+)\): at seed (\d) it is ([\d.]+) below LM greedy\. '
                         r'With the\s+problem as the unit, Holm-adjusted p at most ([\d.]+)e-19\.',
     [len(LESSON['comparisons']), one_sign(LS4.mode)[0], max(level(LS4.mode, 'sign_p')),
      max(level(LS4.mode, 'sign_p_holm')), min(level(LS4.mode, 't_p')), max(level(LS4.mode, 't_p')),
      one_sign(LS4.a1)[0], max(level(LS4.a1, 'sign_p_holm')), max(level(LS4.a1, 't_p_holm')),
      LESSON['seeds'][LS_A1_GREEDY.index(min(LS_A1_GREEDY))], -min(LS_A1_GREEDY),
      1e19 * max(c['p_holm'] for c in LESSON['comparisons'])]),
    ('docs/addition.md', r'seed 1337\'s\s+models are not those of README\'s table \(two threads\): its mode '
                         r'writes ([\d.]+) here',
     [LS4.exact('joint mode, n = 64', 'JOINT')['per_seed'][LESSON['seeds'].index(1337)]]),
    ('docs/addition.md', r'the lesson\'s ten seeds \(4 digits; the LM, a UNIT, no baselines\) take '
                         r'([\d.]+)\s+min',
     [LS4.time['wall_s'] / 60]),
]


# docs/addition.md's and README's ten seeds of the method alone at 6 digits (assets/seeds_lesson6.json:
# job.seeds --lesson --digits 6) beside the addition job's ten (assets/seeds_addition.json)
LS6 = lesson_seeds('seeds_lesson6.json')
C6 = LS6.table['comparisons']
JOB = asset('seeds_addition.json')
JOB_ROWS = by(JOB['rows'], 'model', 'method')
LS6_ROWS = (('the LM: greedy', 'BASE LM', 'greedy'),
            ('the LM: log-prob rerank of 64', 'BASE LM', 'log-prob rerank, n = 64'),
            ('the LM: any of 64 correct', 'BASE LM', 'oracle, n = 64'),
            ('the joint model: Algorithm 1 of 64', 'JOINT', 'Algorithm 1, n = 64'),
            ('the joint model: mode of 64', 'JOINT', 'joint mode, n = 64'),
            ('the joint model: mode over the beam and 64 samples', 'JOINT',
             'joint mode, beam + samples, n = 64'))
MODE6_SPREAD = LS6.exact('joint mode, n = 64', 'JOINT')
JOB_MODE = JOB_ROWS['JOINT', 'joint mode, n = 64']['exact']
MODE6 = [dict(zip(LS6.table['seeds'], MODE6_SPREAD['per_seed'])),  # the method alone's, the job's:
         dict(zip(JOB['seeds'], JOB_MODE['per_seed']))]  # {seed: exact match}
DISTINCT6 = LS6.time['distinct_negatives_by_seed']  # distinct sums of 16 samples
SEED_CLAIMS += [
    ('README.md', r'ten seeds of it \(`--lesson --digits 6`\): ([\d.]+) min', [LS6.time['wall_s'] / 60]),
    ('docs/addition.md', r'--digits 6 --at_once 2`,\s+\*\*([\d.]+) min\*\* wall \(([\d,]+) s of user '
                         r'CPU; assets/seeds_lesson6.json, its `time`\)\. A seed took ([\d,]+)-([\d,]+) '
                         r's\s+of one core: the LM (\d+)-(\d+) s, the negatives (\d+)-(\d+) s, the UNIT '
                         r'(\d+)-([\d,]+) s, the table (\d+)-(\d+) s',
     seed_time(LS6)),
    *[('docs/addition.md', rf'\| {re.escape(label)} \| {M_SD_RANGE} \| {M_SD_RANGE} \|',
       [e[k] for e in (LS6.exact(method, model), JOB_ROWS[model, method]['exact'])
        for k in ('mean', 'sd', 'min', 'max')]) for label, model, method in LS6_ROWS],
    ('docs/addition.md', r'At eight seeds the two modes of 64 are at most ([\d.]+) apart; at seeds\s+3 and '
                         r'10 the UNIT\'s mode of 64 writes ([\d.]+) and ([\d.]+), the job\'s ([\d.]+) and '
                         r'([\d.]+):',
     [max(abs(MODE6[0][s] - MODE6[1][s]) for s in MODE6[0] if s not in (3, 10))]
     + [m[s] for m in MODE6 for s in (3, 10)]),
    ('docs/addition.md', r'\(Holm over the (\d)\s+comparisons\), each joint decoder beats each LM decoder at '
                         r'(\d+) of 10 seeds \(sign test p ([\d.]+), Holm\s+([\d.]+); t over seeds p '
                         r'([\d.e-]+) to ([\d.]+), Holm at most ([\d.]+)\); with the problem as the unit,\s+'
                         r'Holm-adjusted p at most ([\d.]+)e-73\.',
     [len(C6), one_sign(C6)[0], max(level(C6, 'sign_p')), max(level(C6, 'sign_p_holm')),
      min(level(C6, 't_p')), max(level(C6, 't_p')), max(level(C6, 't_p_holm')),
      1e73 * max(c['p_holm'] for c in C6)]),
    ('docs/addition.md', r'seeds 3 and 10, whose LMs learn the carries late \(([\d,]+) and ([\d,]+) s\): '
                         r'.{0,140}? hold ([\d.]+) and ([\d.]+) distinct sums on average, the other seeds\' '
                         r'([\d.]+)-([\d.]+) ',
     [LS6.time['stage_seconds_by_seed'][s]['unit'] for s in ('3', '10')] + [DISTINCT6[s] for s in ('3', '10')]
     + [f(v for s, v in DISTINCT6.items() if s not in ('3', '10')) for f in (min, max)]),
    ('docs/addition.md', r'is met for\s+the method alone \(([\d.]+) min\)', [LS6.time['wall_s'] / 60]),
    ('docs/addition.md', r'the method\'s at 6 digits ([\d.]+) min \(`--digits 6`', [LS6.time['wall_s'] / 60]),
    ('docs/experiments.md', r'each, took ([\d.]+) min, a seed ([\d,]+)-([\d,]+) s of one core .{0,400}? the '
                            r'mode of 64 ([\d.]+) \(SD ([\d.]+)\) against the\s+job\'s ([\d.]+),',
     [LS6.time['wall_s'] / 60, min(LS6.seed_s), max(LS6.seed_s), MODE6_SPREAD['mean'], MODE6_SPREAD['sd'],
      JOB_MODE['mean']]),
]


def outcomes(name, table):
    """{seed: that seed's per-problem outcomes} of a committed job.seeds table."""
    from job.seeds import read_outcomes
    return dict(zip(table['seeds'], read_outcomes(os.path.join(ROOT, 'assets', name))))


MINE6 = outcomes('seeds_lesson6_outcomes.json.gz', LS6.table)  # {seed: the method alone's outcomes}
JOB_OUT = outcomes('seeds_addition_outcomes.json.gz', JOB)  # the addition job's


def p_correct(acc):
    return float(np.exp(acc['per_problem']['JOINT']['logp_correct']).mean())


def same_energy(mine, job):
    """The job's joint model is the method alone's UNIT at a seed: the same outcome on every problem in
    each of its columns, P(correct sum) within 1e-4. Else it is the job's BIT, the other of its two."""
    m, j = mine['per_problem']['JOINT'], job['per_problem']['JOINT']
    return (all(m[k] == j[k] for k in m if k.endswith('_exact'))
            and abs(p_correct(mine) - p_correct(job)) < 1e-4)


JOBS_UNIT = [s for s in JOB['seeds'] if same_energy(MINE6[s], JOB_OUT[s])]
JOBS_BIT = [s for s in JOB['seeds'] if s not in JOBS_UNIT]


def bit_over_unit(column):
    """At the seeds where the job kept its BIT: the BIT's and the UNIT's means over those seeds, and the
    seeds where each is the better (ties out), in an exact-match column or 'p_correct'."""
    def score(acc):
        return p_correct(acc) if column == 'p_correct' else np.mean(acc['per_problem']['JOINT'][column])
    bit, unit = ([score(t[s]) for s in JOBS_BIT] for t in (JOB_OUT, MINE6))
    return dict(bit=np.mean(bit), unit=np.mean(unit), better=sum(b > u for b, u in zip(bit, unit)),
                worse=sum(b < u for b, u in zip(bit, unit)))


A1_BU, MODE_BU, PC_BU = (bit_over_unit(c) for c in ('a1_64_exact', 'mode_64_exact', 'p_correct'))
SEED_CLAIMS += [
    ('docs/addition.md', r'at seeds (\d+), (\d) and (\d) the job\'s joint model writes\s+the outcome of '
                         r'the UNIT here .{0,200}?at the other seven seeds it kept its BIT\. On those seven, '
                         r'with the same LM\s+and problems, the BIT\'s joint model beats the UNIT\'s at '
                         r'every seed in Algorithm 1 of 64 \(([\d.]+)\s+against ([\d.]+)\) and in '
                         r'P\(correct sum\) \(([\d.]+) against ([\d.]+)\), sign test p ([\d.]+); its mode '
                         r'of 64 ties at\s+(\d) of them and leads at (\d)\.',
     JOBS_UNIT + [A1_BU['bit'], A1_BU['unit'], PC_BU['bit'], PC_BU['unit'],
                  math.exp(sign_test_log_p(PC_BU['better'], PC_BU['worse'])),
                  len(JOBS_BIT) - MODE_BU['better'] - MODE_BU['worse'], MODE_BU['better']]),
]


def test_the_jobs_energy_at_each_seed_is_read_off_the_outcomes():
    """docs/addition.md names the energy the addition job kept at each seed from its outcomes and the
    method alone's UNIT's: the same at three seeds (the same UNIT), and at each of the other seven
    Algorithm 1 of 64 differs on some problem (another energy: the BIT); there the BIT beats the UNIT
    at every seed in Algorithm 1 and P(correct), and its mode of 64 is never below the UNIT's."""
    assert JOBS_UNIT == [1337, 6, 8] and len(JOBS_BIT) == 7
    for s in JOBS_BIT:
        a1 = [t[s]['per_problem']['JOINT']['a1_64_exact'] for t in (MINE6, JOB_OUT)]
        assert a1[0] != a1[1], s
    assert A1_BU['better'] == PC_BU['better'] == 7 and MODE_BU['worse'] == 0


def test_the_method_alone_trains_the_jobs_lm_at_each_seed():
    """assets/seeds_lesson6 (job.seeds --lesson --digits 6) at each of its ten seeds: every LM decoder
    writes the addition job's outcome (assets/seeds_addition) on every problem, as docs/addition.md
    says (the same LM: one thread, the same seed, problems and flags); its joint rows are the UNIT's,
    the job's those of its stronger energy, so they differ."""
    mine, job = MINE6, JOB_OUT
    assert sorted(mine) == sorted(job) and len(mine) == 10
    for seed, acc in mine.items():
        assert acc['per_problem']['BASE LM'] == job[seed]['per_problem']['BASE LM'], seed
    assert any(acc['per_problem']['JOINT'] != job[s]['per_problem']['JOINT'] for s, acc in mine.items())


def test_seed_table_numbers_equal_the_committed_tables():
    """Every row of SEED_CLAIMS: the number docs/addition.md states is the committed table's."""
    assert_json_claims_hold(SEED_CLAIMS, 40)

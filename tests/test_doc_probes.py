"""docs/addition.md's lookahead table ("Where the LMs fail") and EXO's probes ("Past 0.952", and the
stage before and after in "The job's EXO over a set"), with README's lookahead line: each number equals
assets/lookahead_addition_test10000.json's or assets/exo_probes_addition.json's to the digits given (the
companion of tests/test_doc_results.py, whose CELL and SEL_CELLS it shares)."""

import re

from job import stats
from tests.common import asset, json_mismatches, read
from tests.test_doc_results import CELL, SEL_CELLS

CLAIMS = []
# docs/addition.md, "Where the LMs fail: the lookahead": the seven seeds' 10,000 test problems by lookahead
# (assets/lookahead_addition_test10000.json)
LOOK = asset('lookahead_addition_test10000.json')['by_lookahead']
LOOK_VALUES = sorted(LOOK['count'], key=int)
LOOK_ROWS = {'LM greedy': ('BASE LM', 'greedy_exact'), 'BALM greedy': ('BALM', 'greedy_exact'),
             'EXO, K = 64, greedy': ('EXO', 'greedy_exact'),
             'EXO over a set (λ = 5) greedy': ('EXO_SET_MASS', 'greedy_exact'),
             'LM, any of 64 correct': ('BASE LM', 'oracle_64_exact'),
             'joint: mode of beam + 64': ('JOINT', 'beam_64_exact')}
LOOK_CELLS = r' \| ([\d.,]+)' * len(LOOK_VALUES) + r' \|(?! [\d.,]+ \|)'  # that many cells, not more
CLAIMS += [('docs/addition.md', r'\| lookahead' + LOOK_CELLS.replace(r'([\d.,]+)', r'(\d)'),
                 [int(v) for v in LOOK_VALUES]),
                ('docs/addition.md', r'\| problems' + LOOK_CELLS,
                 [LOOK['count'][v] for v in LOOK_VALUES])]
CLAIMS += [('docs/addition.md', rf'\| {re.escape(label)}' + LOOK_CELLS,
                 [LOOK['exact'][m][c][v] for v in LOOK_VALUES]) for label, (m, c) in LOOK_ROWS.items()]
BEAM_LOOK = [LOOK['exact']['JOINT']['beam_64_exact'][v] for v in LOOK_VALUES]
CLAIMS += [('README.md', r'There LM greedy falls from ([\d.]+) to ([\d.]+) as the columns a digit waits '
                              r'on\s+grow from (\d) to (\d); the mode stays at (\d\.\d+)',
                 [LOOK['exact']['BASE LM']['greedy_exact'][v] for v in (LOOK_VALUES[0], LOOK_VALUES[-1])]
                 + [int(LOOK_VALUES[0]), int(LOOK_VALUES[-1])] + [min(BEAM_LOOK)])]
SET_ERRORS = {v: LOOK['count'][v] * (1 - LOOK['exact']['EXO_SET_MASS']['greedy_exact'][v])
              for v in LOOK_VALUES}
FAR = [v for v in LOOK_VALUES if int(v) >= 3]
GAIN = [LOOK['exact']['EXO_SET_MASS']['greedy_exact'][v] - LOOK['exact']['BALM']['greedy_exact'][v]
        for v in ('3', '4', '5')]
CLAIMS += [
    ('docs/addition.md', r'\(\+([\d.]+) to\s+\+([\d.]+) over BALM\)', [min(GAIN), max(GAIN)]),
    ('docs/addition.md', r'errors \((\d+) of the 10,000 problems, mean over the seeds\) are (\d+)% on the\s+'
                         r'(\d+)% of problems with a lookahead of at least 3',
     [sum(SET_ERRORS.values()), 100 * sum(SET_ERRORS[v] for v in FAR) / sum(SET_ERRORS.values()),
      100 * sum(LOOK['count'][v] for v in FAR) / sum(LOOK['count'].values())]),
]
# docs/addition.md, "The job's EXO over a set" (the stage before and after) and "Past 0.952" (the probes
# from seed 1337's models of that run; assets/exo_probes_addition.json)
PROBES = asset('exo_probes_addition.json')
STAGE, PM, AHEAD = PROBES['stage'], PROBES['selection']['models'], PROBES['selection']['lookahead']


def probe_row(label, m):
    """A row of the probes' table: parameters (M), best step and lowest reverse KL (EXO runs), greedy (SE),
    P(correct) (SE)."""
    r, run = PM[m], 'best_iter' in PM[m] and 'kl_curve' in PM[m]
    head = r' \| (\d+) \| ([\d.]+)' if run else r' \| \|'
    return ('docs/addition.md', rf'\| {re.escape(label)} \| ([\d.]+)M' + head + rf' \| {CELL} \| {CELL} \|',
            [r['params'] / 1e6] + ([r['best_iter'], r['kl_reverse_high']] if run else [])
            + [r[k] for k in SEL_CELLS])


def probe_mcnemar(a, b):
    return stats.mcnemar(PM[a]['per_problem'], PM[b]['per_problem'])


def by_ahead(m, keep):
    """Greedy exact match of m on the selection problems whose lookahead keep() holds, and their count."""
    hits = [h for h, a in zip(PM[m]['per_problem'], AHEAD, strict=True) if keep(a)]
    return sum(hits) / len(hits), len(hits)


PROBE_ROWS = {'BALM: 3 x 144, MLE': 'BALM', '6 x 144, MLE (BALM\'s recipe)': 'LM6x144',
              'EXO, K = 64, from BALM': 'EXO_K64', "the job's EXO over a set, from BALM": 'EXO_SET',
              'EXO over a set, from the 6 x 144': 'EXO_6x144',
              'EXO over a set, from BALM, lr 1e-4 cosine to 1e-5': 'EXO_LR1E4',
              'the same, 1,200 steps (cosine over 1,200)': 'EXO_LR1E4_1200',
              "the same, its last step (1,200; ckpt.pt, not the KL's choice)": 'EXO_LR1E4_1200_LAST'}
CLAIMS += [probe_row(label, m) for label, m in PROBE_ROWS.items()]
EXOS = ('EXO_K64', 'EXO_SET', 'EXO_6x144', 'EXO_LR1E4', 'EXO_LR1E4_1200')
BANDS = [[by_ahead(m, keep) for m in EXOS] for keep in (lambda a: a <= 2, lambda a: a == 3, lambda a: a >= 4)]
K64, SET = STAGE['k64'], STAGE['set']
DEEP, FAST = probe_mcnemar('LM6x144', 'BALM'), probe_mcnemar('EXO_LR1E4', 'EXO_SET')
LAST_VS_BEST = probe_mcnemar('EXO_LR1E4_1200_LAST', 'EXO_LR1E4_1200')
LAST_VS_SET = probe_mcnemar('EXO_LR1E4_1200_LAST', 'EXO_SET')
RERUN = probe_mcnemar('EXO_LR1E4_1200_S2_LAST', 'EXO_SET')
DEEP_EXO, LONG = probe_mcnemar('EXO_6x144', 'EXO_SET'), probe_mcnemar('EXO_LR1E4_1200', 'EXO_LR1E4')
CLAIMS += [
    ('docs/addition.md', r'\*\*(\d+) s\*\* \(training ([\d.]+) s,\s+best.pt at step (\d+)\), against the '
                         r'set\'s (\d+) s \(([\d.]+) s\) in the job\.',
     [K64['seconds'], K64['train_seconds'], K64['best_iter'], SET['seconds'], SET['train_seconds']]),
    ('docs/addition.md', r'The set costs (\d+)% more time a stage here;',
     [100 * (SET['seconds'] / K64['seconds'] - 1)]),
    ('docs/addition.md', r'it buys greedy ([\d.]+)\s+against ([\d.]+) \(BALM ([\d.]+)\)',
     [PM[m]['greedy_exact'] for m in ('EXO_SET', 'EXO_K64', 'BALM')]),
    ('docs/addition.md', r'answer\s+loss ([\d.]+) against BALM\'s ([\d.]+)\) writes the sum as BALM does '
                         r'\(([-\d.]+), McNemar p ([\d.]+)\)',
     [PM['LM6x144']['best_select_loss'], PM['BALM']['best_select_loss'], DEEP['diff'], DEEP['p']]),
    ('docs/addition.md', r'([\d.]+) against the job\'s ([\d.]+) \(p ([\d.]+)\); its\s+training took ([\d,]+) '
                         r's of one thread beside another run \(the job\'s: (\d+) s on two threads',
     [PM['EXO_6x144']['greedy_exact'], PM['EXO_SET']['greedy_exact'], DEEP_EXO['p'],
      PM['EXO_6x144']['train_seconds'], PM['EXO_SET']['train_seconds']]),
    ('docs/addition.md', r'takes the\s+reverse KL to ([\d.]+), and greedy to ([\d.]+) \(\+([\d.]+) over the '
                         r'job\'s\s+EXO, McNemar p ([\d.]+)\)',
     [PM['EXO_LR1E4']['kl_reverse_high'], PM['EXO_LR1E4']['greedy_exact'], FAST['diff'], FAST['p']]),
    ('docs/addition.md', r'take the KL to ([\d.]+) \(best.pt at step (\d+)\) and\s+greedy down to ([\d.]+) '
                         r'\(([-\d.]+) against 600 steps\', p ([\d.]+)\)',
     [PM['EXO_LR1E4_1200'][k] for k in ('kl_reverse_high', 'best_iter', 'greedy_exact')]
     + [LONG['diff'], LONG['p']]),
    ('docs/addition.md', r'last step is: \*\*([\d.]+)\*\* \(P\(correct\) ([\d.]+)\), \+([\d.]+) over\s+the '
                         r'step the KL chose \(McNemar p ([\d.e-]+)\) and \+([\d.]+) over the job\'s EXO '
                         r'\(p ([\d.]+)\), and ([\d.]+) of the\s+(\d+) problems with a lookahead of 4',
     [PM['EXO_LR1E4_1200_LAST'][k] for k in ('greedy_exact', 'p_correct')]
     + [LAST_VS_BEST['diff'], LAST_VS_BEST['p'], LAST_VS_SET['diff'], LAST_VS_SET['p']]
     + list(by_ahead('EXO_LR1E4_1200_LAST', lambda a: a >= 4))),
    ('docs/addition.md', r'writes ([\d.]+) at its best.pt by the KL \(step ([\d,]+)\) and ([\d.]+) at its '
                         r'last step\s+\(\+([\d.]+) over the job\'s EXO, McNemar p ([\d.]+)\)',
     [PM['EXO_LR1E4_1200_S2']['greedy_exact'], PM['EXO_LR1E4_1200_S2']['best_iter'],
      PM['EXO_LR1E4_1200_S2_LAST']['greedy_exact'], RERUN['diff'], RERUN['p']]),
    ('docs/addition.md', r'write ([\d.]+)-([\d.]+) of the (\d+) selection\s+problems with a lookahead of 1 '
                         r'or 2, ([\d.]+)-([\d.]+) of the (\d+) with 3 and ([\d.]+)-([\d.]+) of the (\d+) '
                         r'with 4 or\s+more',
     [x for band in BANDS for x in (min(a for a, _ in band), max(a for a, _ in band), band[0][1])]),
]


def test_lookahead_and_probe_numbers_equal_their_assets():
    assert len(CLAIMS) >= 20
    docs = {d: read(d) for d in {c[0] for c in CLAIMS}}
    bad = json_mismatches(CLAIMS, docs)
    assert not bad, '\n'.join(bad)


def test_a_planted_probe_mismatch_fails():
    docs = {d: read(d) for d in {c[0] for c in CLAIMS}}
    text = docs['docs/addition.md']
    docs['docs/addition.md'] = (text.replace('| LM greedy | 0.984 |', '| LM greedy | 0.985 |')
                                .replace('last step is: **0.965**', 'last step is: **0.966**'))
    assert len(json_mismatches(CLAIMS, docs)) == 2

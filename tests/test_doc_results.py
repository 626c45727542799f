"""Docs that cannot drift from the committed runs: each number README.md's neighbours in docs/ state
from a committed result (assets/*.json) equals it to the digits they give (JSON_CLAIMS), and
docs/reports.md's table of the lesson's runs is assets/lesson.json's. The numbers that name the
code's values (configs, constants, line counts) are tests/test_docs.py's; the times (stage times,
probes, bench ratios), tests/test_doc_times.py's.
"""

import json
import math
import os
import re
import statistics

from job.stats import format_p
from tests.common import ROOT, asset, assert_json_claims_hold, by, claimed_docs, json_mismatches, rounds_to


ADD = by(asset('results_addition.json')['rows'], 'model', 'split')
MAIN = by(asset('results.json')['rows'], 'model', 'split')
ACC = by(asset('accuracy_addition.json')['rows'], 'model', 'method')
CL, LMS = asset('claims.json')['claims'], asset('claims.json')['lms']
ADD_LMS = asset('claims_addition.json')['lms']
CALIB = asset('results.json')['calibration']
EXACT = asset('exact_logz.json')


def acc(model, method, key='exact'):
    return ACC[model, method][key]


def share_of_gap(model):
    """How far `model`'s P(correct) goes from the base LM's to the joint model's, in %."""
    lm, joint = acc('BASE LM', 'greedy', 'p_correct'), acc('JOINT', 'Algorithm 1, n = 64', 'p_correct')
    return 100 * (acc(model, 'greedy', 'p_correct') - lm) / (joint - lm)


def decoder(model, method):
    """A table row's four n's and the SE at 64."""
    return ([acc(model, f'{method}, n = {n}') for n in (1, 4, 16, 64)]
            + [acc(model, f'{method}, n = 64', 'exact_se')])


# (doc, regex, the values in assets/*.json): a number stated from a committed result equals it to
# the digits the doc gives (rounded, not truncated)
JSON_CLAIMS = [
    # docs/addition.md, Table 1 on the test windows (assets/results_addition.json)
    ('docs/addition.md', r'BASE ([\d.]+), BALM ([\d.]+)\s+\(gain ([\d.]+) nats/token, ([\d.]+) SE\), TaiLr '
                         r'([\d.]+), EXO ([\d.]+), RALM level',
     [ADD['BASE LM', 'test']['ppl'], ADD['BALM', 'test']['ppl'], ADD['BALM', 'test']['gain_nats_per_token'],
      ADD['BALM', 'test']['gain_nats_per_token'] / ADD['BALM', 'test']['gain_se'],
      ADD['TAILR', 'test']['ppl'], ADD['EXO', 'test']['ppl']]),
    ('docs/addition.md', r'JOINT UNIT\s+([\d.]+) and JOINT BIT ([\d.]+) with `log Z` enumerated \(gains '
                         r'([\d.]+) and ([\d.]+), SE ([\d.]+)\)',
     [ADD['JOINT UNIT', 'test']['ppl_enumerated'], ADD['JOINT BIT', 'test']['ppl_enumerated'],
      ADD['JOINT UNIT', 'test']['gain_enumerated'], ADD['JOINT BIT', 'test']['gain_enumerated'],
      ADD['JOINT UNIT', 'test']['gain_enumerated_se']]),
    # docs/addition.md, the accuracy table (assets/accuracy_addition.json)
    ('docs/addition.md', r'BASE LM \(3x96\): greedy / one sample \| ([\d.]+) / ([\d.]+) \| ([\d.]+) '
                         r'\(([\d.]+)\)',
     [acc('BASE LM', 'greedy'), acc('BASE LM', 'sampled'), acc('BASE LM', 'greedy', 'p_correct'),
      acc('BASE LM', 'greedy', 'p_correct_se')]),
    ('docs/addition.md', r'BASE LM: majority vote \| ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) \(([\d.]+)\)',
     decoder('BASE LM', 'majority vote')),
    ('docs/addition.md', r'BASE LM: log-prob rerank \| ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) '
                         r'\(([\d.]+)\)',
     decoder('BASE LM', 'log-prob rerank')),
    ('docs/addition.md', r'BASE LM: any of the n correct \(oracle\) \| ([\d.]+) / ([\d.]+) / ([\d.]+) / '
                         r'([\d.]+) \(([\d.]+)\)', decoder('BASE LM', 'oracle')),
    ('docs/addition.md', r'BALM \(3x144, converged\): greedy / one sample \| ([\d.]+) / ([\d.]+) \| ([\d.]+) '
                         r'\(([\d.]+)\)',
     [acc('BALM', 'greedy'), acc('BALM', 'sampled'), acc('BALM', 'greedy', 'p_correct'),
      acc('BALM', 'greedy', 'p_correct_se')]),
    ('docs/addition.md', r'BALM: log-prob rerank \| ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) \(([\d.]+)\)',
     decoder('BALM', 'log-prob rerank')),
    ('docs/addition.md', r'TaiLr LM: greedy / one sample \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \(([\d.]+)\)',
     [acc('TAILR', 'greedy'), acc('TAILR', 'sampled'), acc('TAILR', 'greedy', 'p_correct'),
      acc('TAILR', 'greedy', 'p_correct_se')]),
    ('docs/addition.md', r'200 steps off-policy from the LM\): greedy / one sample \| ([\d.]+) / ([\d.]+) '
                         r'\| ([\d.]+) \(([\d.]+)\)',
     [acc('EXO', 'greedy'), acc('EXO', 'sampled'), acc('EXO', 'greedy', 'p_correct'),
      acc('EXO', 'greedy', 'p_correct_se')]),
    ('docs/addition.md', r'Algorithm 1\*\* \| ([\d.]+) / ([\d.]+) / ([\d.]+) / \*\*([\d.]+)\*\* \(([\d.]+)\) '
                         r'\| \*\*([\d.]+)\*\* \(([\d.]+)\)',
     decoder('JOINT', 'Algorithm 1') + [acc('JOINT', 'Algorithm 1, n = 64', 'p_correct'),
                                        acc('JOINT', 'Algorithm 1, n = 64', 'p_correct_se')]),
    ('docs/addition.md', r'its mode among the samples\*\* \| ([\d.]+) / ([\d.]+) / ([\d.]+) / '
                         r'\*\*([\d.]+)\*\* \(([\d.]+)\)',
     decoder('JOINT', 'joint mode')),
    ('docs/addition.md', r'its P\(correct\) ([\d.]+): (\d+)% of the way from the LM\'s ([\d.]+) to the '
                         r'joint\s+model\'s ([\d.]+)',
     [acc('EXO', 'greedy', 'p_correct'), share_of_gap('EXO'), acc('BASE LM', 'greedy', 'p_correct'),
      acc('JOINT', 'Algorithm 1, n = 64', 'p_correct')]),
    ('docs/addition.md', r'EXO folds in (\d+)% of it', [share_of_gap('EXO')]),
    ('docs/addition.md', r'On\s+addition it has (\d+)% of the way', [share_of_gap('EXO')]),
    # docs/addition.md, where each LM stopped (assets/claims_addition.json) and the idle run's stage times
    ('docs/addition.md', r'BASE at step ([\d,]+) \(best =\s+last: .{0,120}?BALM best ([\d,]+) of ([\d,]+) '
                         r'\(([\d.]+)\), RALM best ([\d,]+) of ([\d,]+), TaiLr best ([\d,]+) of ([\d,]+) '
                         r'\(([\d.]+)\)',
     [ADD_LMS['BASE']['best_step'], ADD_LMS['BALM']['best_step'], ADD_LMS['BALM']['last_step'],
      ADD_LMS['BALM']['best_select_loss'], ADD_LMS['RALM']['best_step'], ADD_LMS['RALM']['last_step'],
      ADD_LMS['TAILR']['best_step'], ADD_LMS['TAILR']['last_step'], ADD_LMS['TAILR']['best_select_loss']]),
    # docs/reports.md: where each LM stopped, what holds, the calibration (assets/claims.json, results.json)
    ('docs/reports.md', r'BASE at step ([\d,]+) \(selection loss ([\d.]+) nats/char\), BALM ([\d,]+)\s+of '
                        r'([\d,]+) \(([\d.]+)\), RALM (\d+) of (\d+) \(([\d.]+)\), TaiLr (\d+) of (\d+) '
                        r'\(([\d.]+)\)',
     [LMS['BASE']['best_step'], LMS['BASE']['best_select_loss']]
     + [LMS[m][k] for m in ('BALM', 'RALM', 'TAILR')
        for k in ('best_step', 'last_step', 'best_select_loss')]),
    ('docs/reports.md', r'JOINT BIT gains over the LM alone, ([\d.]+)\s+\(([\d.]+)\) nats/token on test, '
                        r'([\d.]+) SE; JOINT UNIT ([\d.]+) \(([\d.]+)\), ([\d.]+) SE\. BALM gains '
                        r'([\d.]+)\s+\(([\d.]+)\) and RALM ([\d.]+) \(([\d.]+)\)',
     [v for m in ('JOINT BIT', 'JOINT UNIT') for v in (
         MAIN[m, 'test']['gain_nats_per_token'], MAIN[m, 'test']['gain_se'],
         MAIN[m, 'test']['gain_nats_per_token'] / MAIN[m, 'test']['gain_se'])]
     + [MAIN[m, 'test'][k] for m in ('BALM', 'RALM') for k in ('gain_nats_per_token', 'gain_se')]),
    ('docs/reports.md', r'gains ([\d.]+) alone and ([\d.]+) with the BIT as one more metric',
     [MAIN[m, 'test']['gain_nats_per_token'] for m in ('JOINT METRICS', 'JOINT METRICS+BIT')]),
    ('docs/reports.md', r'bound is\s+\+?([-\d.]+) / \+?([-\d.]+) nats/token for BIT, \+?([-\d.]+) / '
                        r'\+?([-\d.]+) for UNIT \(.{0,40}\),\s+\+?([-\d.]+) / \+?([-\d.]+) for METRICS\+BIT',
     [CALIB[e][k] for e in ('BIT', 'UNIT', 'METRICS+BIT') for k in ('bias_lower', 'bias_upper')]),
    # docs/exact_logz.md: the exact values (assets/exact_logz.json)
    ('docs/exact_logz.md', r'mean P_LM\(correct sum\) ([\d.]+), exact joint P\(correct sum\) ([\d.]+) '
                           r'\(joint\s+log-likelihood of the real continuation ([-\d.]+) nats against the '
                           r'LM\'s ([-\d.]+)\)',
     [EXACT['test']['exact'][k]
      for k in ('p_lm_correct', 'p_joint_correct', 'joint_ll_real', 'lm_logp_real')]),
    ('docs/exact_logz.md', r'correct sum on ([\d.]+) of them, the joint model\'s on (\d\.\d+)',
     [EXACT['test']['exact'][k] for k in ('lm_mode_exact', 'joint_mode_exact')]),
    ('docs/exact_logz.md', r'sum to 1\s+within ([\d.]+)e-15',
     [1e15 * EXACT['test']['exact']['lm_mass_max_error']]),
]
# docs/exact_logz.md's sharp energy (assets/exact_logz_sharp.json, and the same energy x 2 and x 3)
SHARP = {k: asset(f'exact_logz_sharp{k}.json') for k in ('', '_x2', '_x3')}
BEAMS = lambda k, split, key='within_tol': [b[key] for b in SHARP[k][split]['beam_curve']]
AT_64 = lambda k: next(r for r in SHARP[k]['test']['table'] if r['n'] == 64)
JSON_CLAIMS += [
    ('docs/exact_logz.md', r'P_LM\(correct sum\) \*\*([\d.]+)\*\*, the joint model\'s \*\*([\d.]+)\*\*; '
                           r'the LM\'s mode is correct on ([\d.]+) of them, the joint model\'s on ([\d.]+); '
                           r'median Kish ESS of 64 LM samples \*\*([\d.]+)\*\*',
     [SHARP['']['test']['exact'][k]
      for k in ('p_lm_correct', 'p_joint_correct', 'lm_mode_exact', 'joint_mode_exact')]
     + [AT_64('')['ess_median']]),
    ('docs/exact_logz.md', r'Eq\. 4\'s T_n is\s+off by ([-\d.]+) nats on average \(sd ([\d.]+)\), its range '
                           r'holds log Z in (\d+)% of replicates',
     [AT_64('')['T_n']['bias'], AT_64('')['T_n']['spread'], 100 * AT_64('')['eq4_coverage']]),
    ('docs/exact_logz.md', r'\| within 0\.01, selection \(replicates\) \| ([\d.]+) \| \*\*([\d.]+)\*\* '
                           r'\| ([\d.]+) \|',
     BEAMS('', 'select')),
    ('docs/exact_logz.md', r'\| within 0\.01, test \(replicates\) \| ([\d.]+) \| \*\*([\d.]+)\*\* '
                           r'\| ([\d.]+) \|',
     BEAMS('', 'test')),
    ('docs/exact_logz.md', r'\| within 0\.01, test \(prompts, median replicate\) \| ([\d.]+) \| ([\d.]+) '
                           r'\| ([\d.]+) \|',
     BEAMS('', 'test', 'prompts_within_tol_median')),
    ('docs/exact_logz.md', r'\| bias of the estimate / of its sure part, test \| ([-\d.]+) / ([-\d.]+) \| '
                           r'([-\d.]+) / ([-\d.]+) \| ([-\d.]+) / ([-\d.]+) \|',
     [b[k] for b in SHARP['']['test']['beam_curve'] for k in ('estimate_bias', 'sure_bias')]),
] + [
    ('docs/exact_logz.md', rf'\| the energy x {x}, test: within 0\.01 \(P_joint ([\d.]+), ESS ([\d.]+)\) \| '
                           r'([\d.]+) \| ([\d.]+) \| ([\d.]+) \|',
     [SHARP[f'_x{x}']['test']['exact']['p_joint_correct'], AT_64(f'_x{x}')['ess_median']]
     + BEAMS(f'_x{x}', 'test')) for x in (2, 3)
]
# docs/exact_logz.md's verifier: a BIT on 4x the problems (assets/exact_logz_verifier.json)
VERIFIER = asset('exact_logz_verifier.json')
PROMPT = {p['problem']: p for s in ('select', 'test') for p in VERIFIER[s]['per_prompt']}
V_AT = lambda n: next(r for r in VERIFIER['test']['table'] if r['n'] == n)
V_ERR = lambda p: p['estimate_abs_error_median']['64']  # the job's n; the estimate misses mass: log Z low
V_WITHIN = lambda s: sum(V_ERR(p) <= 0.01 for p in VERIFIER[s]['per_prompt'])


def estimated_vs_exact(split):
    """The job's P(correct) (its log Z too low by the error) beside the exact one, means over prompts."""
    pp = VERIFIER[split]['per_prompt']
    est = sum(min(1.0, p['p_joint_correct'] * math.exp(V_ERR(p))) for p in pp) / len(pp)
    exact = VERIFIER[split]['exact']['p_joint_correct']
    return [est - exact, est, exact]


JSON_CLAIMS += [
    ('docs/exact_logz.md', r'on the 60 test prompts: P_LM\(correct sum\) \*\*([\d.]+)\*\*, the joint '
                           r'model\'s \*\*([\d.]+)\*\*; the\s+LM\'s mode is correct on ([\d.]+) of them, '
                           r'the joint model\'s on ([\d.]+); median Kish ESS of 64 LM samples\s+([\d.]+) '
                           r'.{0,80}On the selection split\'s 30: ([\d.]+) and\s+([\d.]+)\.',
     [VERIFIER['test']['exact'][k]
      for k in ('p_lm_correct', 'p_joint_correct', 'lm_mode_exact', 'joint_mode_exact')]
     + [V_AT(64)['ess_median']]
     + [VERIFIER['select']['exact'][k] for k in ('p_lm_correct', 'p_joint_correct')]),
    ('docs/exact_logz.md', r'on \*\*(\d+) of 60\*\* test prompts \(([\d.]+) of replicates\) and '
                           r'(\d+) of 30\s+selection',
     [V_WITHIN('test'), VERIFIER['beam_choice']['on_split']['within_tol'], V_WITHIN('select')]),
    ('docs/exact_logz.md', r'by \+([\d.]+) on test \(estimated ~([\d.]+) against the exact ([\d.]+)\) '
                           r'and \+([\d.]+) on\s+selection \(([\d.]+) against ([\d.]+)\)',
     estimated_vs_exact('test') + estimated_vs_exact('select')),
    ('docs/exact_logz.md', r'bias ([-\d.]+) nats at n = 1,024\);\s+its range holds log Z in (\d+)% of '
                           r'replicates at n = 64',
     [V_AT(1024)['T_n']['bias'], 100 * V_AT(64)['eq4_coverage']]),
] + [
    ('docs/exact_logz.md', rf'\| {re.escape(q)} \({s}\) \| ([\d.]+) \| ([\d.]+) \| [^|\n]+ \| '
                           r'([\d.]+)(?: nats)? \|',
     [PROMPT[q + a]['p_lm_correct'], PROMPT[q + a]['p_joint_correct'], V_ERR(PROMPT[q + a])])
    for q, a, s in (('605+004=', '0609<eot>', 'selection'), ('365+424=', '0789<eot>', 'test'),
                    ('652+215=', '0867<eot>', 'test'))
]
EDITS8 = asset('exact_logz_verifier_edits8.json')
E8_ROWS = [r for split in ('select', 'test') for r in EDITS8[split]['beam_curve']]
JSON_CLAIMS += [
    ('docs/exact_logz.md', r'within 0\.01 nats on ([\d.]+) of\s+replicates, every prompt of both splits, at '
                           r'beams (\d+) and (\d+) \(the worst prompt\'s error ([\d.]+) nats\)',
     [min(r['within_tol'] for r in E8_ROWS)] + [r['beam'] for r in EDITS8['test']['beam_curve']]
     + [max(r['worst_prompt_median_error'] for r in E8_ROWS)]),
]
# docs/reports.md's lesson run of 2026-12-03 (assets/lesson.json's last run): its UNIT, and the UNIT's 500
# steps alternated with the code of the day before
LAST_LESSON = asset('lesson.json')['runs'][-1]
BEFORE = next(c for c in LAST_LESSON['unit_500_steps_s'] if c not in ('what', LAST_LESSON['commit']))
JSON_CLAIMS += [
    ('docs/reports.md', rf'At {LAST_LESSON["commit"]} \(2026-12-03\) the table is the same to the last '
                        r'digit, after\s+([\d.]+) s: the UNIT took ([\d.]+) s\. 500 of its steps, the two '
                        r'commits alternated, took a median ([\d.]+) s\s+there and ([\d.]+) s with the code '
                        rf'of 2026-12-02 \({BEFORE}\)',
     [LAST_LESSON['to_table_s'], LAST_LESSON['stage_s']['unit']]
     + [statistics.median(LAST_LESSON['unit_500_steps_s'][c]) for c in (LAST_LESSON['commit'], BEFORE)]),
]
# docs/addition.md's --edits table (assets/p_correct_edits.json): the job's P(correct), then with the edits
EDITS = asset('p_correct_edits.json')
JSON_CLAIMS += [
    ('docs/addition.md', rf"\| {r['seed']} \| (?:UNIT|BIT) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \|",
     [r['p_correct'], r['p_correct_edits'], r['lower_by_over_0_01_nats'], r['largest_drop_nats']])
    for r in EDITS['rows']
] + [('docs/addition.md', r'\| mean of (\d+) \| \| ([\d.]+) \| ([\d.]+) \|',
      [len(EDITS['rows']), EDITS['p_correct_mean'], EDITS['p_correct_edits_mean']]),
      ('README.md', r'joint model ([\d.]+), BALM', [EDITS['p_correct_mean']])]
# docs/addition.md's paired tests (assets/claims_addition.json, and the per-problem outcomes they are from)
ADD_CLAIMS = asset('claims_addition.json')['claims']
PER_PROBLEM = asset('accuracy_addition.json')['per_problem']
DECODERS = [f'D{i}' for i in range(1, 11)]
WEAKEST = ADD_CLAIMS[max(DECODERS, key=lambda d: ADD_CLAIMS[d]['p_holm'])]
WEAKEST_P = WEAKEST['p_holm'] if WEAKEST['what'].startswith('Alg. 1 > BALM log-prob rerank') else float('nan')


def only(a, b):
    """How many problems `a` (model, outcome) gets right and `b` does not, and the other way round."""
    x, y = PER_PROBLEM[a[0]][a[1]], PER_PROBLEM[b[0]][b[1]]
    pairs = list(zip(x, y, strict=True))
    return [sum(p and not q for p, q in pairs), sum(q and not p for p, q in pairs)]


JSON_CLAIMS += [
    ('docs/addition.md', r'Holm over the (\d+) claims with a p-value',
     [sum(c.get('p') is not None and 'same_as' not in c for c in ADD_CLAIMS.values())]),
    ('docs/addition.md', r'the largest Holm-adjusted p (\d)e-13 \(Algorithm 1 against BALM\'s rerank: (\d+) '
                         r'problems only\s+Algorithm 1 gets right, (\d+) only BALM\)',
     [1e13 * WEAKEST_P] + only(('JOINT', 'a1_64_exact'), ('BALM', 'rerank_64_exact'))),
    ('docs/addition.md', r'\+([\d.]+) points, paired p (\d)e-5, (\d)e-4 after Holm; (\d+) problems it alone '
                         r'gets\s+right, (\d+) the LM alone',
     [100 * ADD_CLAIMS['D11']['diff'], 1e5 * ADD_CLAIMS['D11']['p'], 1e4 * ADD_CLAIMS['D11']['p_holm']]
     + only(('EXO', 'greedy_exact'), ('BASE LM', 'greedy_exact'))),
    ('docs/addition.md', r'Eq\. 4\'s range is flagged on (\d+)% of problems',
     [100 * sum(PER_PROBLEM['JOINT']['eq4_flagged']) / len(PER_PROBLEM['JOINT']['eq4_flagged'])]),
]
# docs/addition.md's EXO on Shakespeare (assets/exo_shakespeare.json; JOINT BIT from assets/results.json)
EXO_SH = asset('exo_shakespeare.json')
EXO_TEST = by(EXO_SH['rows'], 'model', 'split')['EXO', 'test']
KL_BEFORE, KL_AFTER = EXO_SH['curve'][0]['select_kl_to_joint'], EXO_SH['exo']['best']['select_kl_to_joint']
JSON_CLAIMS += [
    ('docs/addition.md', r'best\.pt chosen on the\s+selection split\'s KL, at step (\d+) of (\d+)',
     [EXO_SH['exo']['best_iter'], EXO_SH['exo']['args']['max_iters']]),
    ('docs/addition.md', r'\| base LM \| ([\d.]+) \(selection\) \| 0 \| ([\d.]+) \| \|',
     [KL_BEFORE, by(EXO_SH['rows'], 'model', 'split')['BASE LM', 'test']['ppl']]),
    ('docs/addition.md', r'\| EXO LM \| ([\d.]+) \(selection\), ([\d.]+) \(test\) \| ([\d.]+) \(selection\), '
                         r'([\d.]+) \(test\) \| ([\d.]+) \| ([\d.]+) \(([\d.]+)\) \|',
     [KL_AFTER, EXO_SH['exo']['final']['test']['kl_to_joint'], EXO_SH['exo']['best']['select_kl_to_base'],
      EXO_SH['exo']['final']['test']['kl_to_base'], EXO_TEST['ppl'], EXO_TEST['gain_nats_per_token'],
      EXO_TEST['gain_se']]),
    ('docs/addition.md', r'\| JOINT BIT \(Table 1\) \| 0 \| \| ([\d.]+) \(range ([\d.]+)-([\d.]+)\) \| '
                         r'([\d.]+) \(([\d.]+)\) \|',
     [MAIN['JOINT BIT', 'test'][k]
      for k in ('ppl_low', 'ppl_low', 'ppl_high', 'gain_nats_per_token', 'gain_se')]),
    ('docs/addition.md', r'EXO removes (\d+)% of the KL from the LM to the joint model \(selection split\), '
                         r'and its exact test gain, ([\d.]+)\s+nats/token \(([\d.]+) SE\)',
     [100 * (1 - KL_AFTER / KL_BEFORE), EXO_TEST['gain_nats_per_token'],
      EXO_TEST['gain_nats_per_token'] / EXO_TEST['gain_se']]),
]
# docs/addition.md's EXO budget: the job's EXO continued (assets/exo_budget_addition.json)
EXO_BUDGET = asset('exo_budget_addition.json')['seeds']
CELL = r'([\d.]+) \(([\d.]+)\)'


def budget_row(seed, r):
    """One budget's row: best step, reverse KL, greedy (SE), P(correct) (SE), and its lead over 600 steps."""
    lead = 'vs_600' in r
    pattern = (rf'\| {seed}: EXO, {r["max_iters"]:,} steps[^|]*\| ([\d,]+) \| ([\d.]+) \| {CELL} \| '
               rf'{CELL} \| ' + (r'([-+][\d.]+) \(([\d.]+)\) \|' if lead else r'\|'))
    values = [r[k] for k in ('best_iter', 'kl_reverse_high', 'greedy_exact', 'greedy_exact_se', 'p_correct',
                             'p_correct_se')]
    return 'docs/addition.md', pattern, values + ([r['vs_600']['diff'], r['vs_600']['p']] if lead else [])


JSON_CLAIMS += [('docs/addition.md', rf'\| {s["seed"]}: BALM \| \| \| {CELL} \| {CELL} \|',
                 [s['balm'][k] for k in ('greedy_exact', 'greedy_exact_se', 'p_correct', 'p_correct_se')])
                for s in EXO_BUDGET]
JSON_CLAIMS += [budget_row(s['seed'], r) for s in EXO_BUDGET for r in s['budgets']]
# docs/addition.md, "EXO over a set": seed 1337's selection table and the test table of three seeds
# (assets/exo_set_addition.json)
EXO_SET = asset('exo_set_addition.json')
SEL, SET_TEST = EXO_SET['selection'], EXO_SET['test']


SEL_CELLS = ('greedy_exact', 'greedy_exact_se', 'p_correct', 'p_correct_se')


def set_row(r, label):
    """A selection row: steps, best step, reverse KL, greedy (SE), P(correct) (SE)."""
    values = [r['max_iters'], r['best_iter'], r['kl_reverse_high']] if 'best_iter' in r else []
    head = r' \| (\d+) \| (\d+) \| ([\d.]+)' if values else r' \| \| \|'
    return ('docs/addition.md', rf'\| {re.escape(label)}{head} \| {CELL} \| {CELL} \|',
            values + [r[k] for k in SEL_CELLS])


def curve_row(r, label):
    """A row of a run with a KL curve: best step, lowest reverse KL, greedy (SE), P(correct) (SE)."""
    return ('docs/addition.md', rf'\| {label} \| (\d+) \| ([\d.]+) \| {CELL} \| {CELL} \|',
            [r['best_iter'], min(kl for _, kl in r['kl_curve'])] + [r[k] for k in SEL_CELLS])


SET_NAMES = dict(BALM='BALM greedy', EXO='EXO, K = 64, greedy', EXO_SET='EXO over a set greedy')
JSON_CLAIMS += [set_row(SEL['balm'], "BALM (EXO's start)"),
                set_row(SEL['job_exo'], 'EXO, K = 64: 16 prefixes, lr 1e-5')]
JSON_CLAIMS += [set_row(r, r['name']) for r in SEL['runs'] if 'greedy_exact' in r]
SET_ROW = r' \| ([\d.]+) \(([\d.]+)\)' + r' \| ([\d.]+)' * 4 + r' \|'
JSON_CLAIMS += [('docs/addition.md', rf'\| {name}' + SET_ROW,
                 [SET_TEST['table'][m][k] for k in ('greedy_mean', 'greedy_sd')]
                 + SET_TEST['table'][m]['greedy'] + [SET_TEST['table'][m]['p_correct_mean']])
                for m, name in SET_NAMES.items()]
VS_EXO, VS_BALM = SET_TEST['comparisons'][1], SET_TEST['comparisons'][0]
P_E = r'([\d.e-]+)'
JSON_CLAIMS += [
    ('docs/addition.md',
     rf'McNemar p {P_E}, {P_E}, {P_E} against\s+EXO with K = 64; {P_E}, {P_E}, {P_E} against BALM',
     VS_EXO['per_seed_mcnemar_p'] + VS_BALM['per_seed_mcnemar_p']),
    ('docs/addition.md', r't p ([\d.]+) against EXO with K = 64, ([\d.]+) against BALM; Holm ([\d.]+)',
     [VS_EXO['seed_t_p'], VS_BALM['seed_t_p'], VS_EXO['seed_t_p_holm']]),
]
# docs/addition.md, "The mass the set does not see": seed 2's choice of lambda, the selection and test
# tables at seven seeds and their comparisons (assets/exo_set_addition.json, beam_mass)
MASS = EXO_SET['beam_mass']
MASS_SEL, MASS_TEST, DRIFT = MASS['selection']['by_seed'], MASS['test'], MASS['drift_seed2']
JSON_CLAIMS += [curve_row(r, f'set, λ = {lam}') for lam, r in MASS['seed2_lambda'].items()]
JSON_CLAIMS += [('docs/addition.md', rf'\| {name} \| {CELL} \| {CELL} \|',
                 [MASS_SEL['2'][m][k] for k in SEL_CELLS])
                for m, name in (('BALM', r"BALM \(EXO's start\) \| \|"), ('EXO', r"EXO, K = 64 \| 600 \|"))]
SEEDS7 = r' \| ([\d.]+)' * 7
MASS_NAMES = dict(BALM='BALM', EXO='EXO, K = 64', EXO_SET_MASS='set, λ = 5')
JSON_CLAIMS += [('docs/addition.md', rf'\| {name} \| ([\d.]+) \(([\d.]+)\)' + SEEDS7 + r' \|(?! [\d.]+ \|)',
                 [statistics.mean(g), statistics.stdev(g)] + g)
                for m, name in MASS_NAMES.items()
                for g in [[MASS_SEL[str(s)][m]['greedy_exact'] for s in MASS_TEST['seeds']]]]
JSON_CLAIMS += [('docs/addition.md', r'\| its best step \| \|' + r' (\d+) \|' * 7,
                 [MASS_SEL[str(s)]['EXO_SET_MASS']['best_iter'] for s in MASS_TEST['seeds']])]
TEST_NAMES = {'BASE LM': 'LM', **MASS_NAMES, 'EXO_SET_MASS': r'\*\*set, λ = 5\*\*'}
TEST_ROW = r' \| \**([\d.]+)\** \(([\d.]+)\)' + SEEDS7 + r' \| ([\d.]+) \|'
JSON_CLAIMS += [('docs/addition.md', rf'\| {name}' + TEST_ROW,
                 [row['greedy_mean'], row['greedy_sd']] + row['greedy'] + [row['p_correct_mean']])
                for m, name in TEST_NAMES.items() for row in [MASS_TEST['table'][m]]]
M_BALM, M_EXO, M_LM, M_SET = MASS_TEST['comparisons']
JSON_CLAIMS += [('README.md', r"greedy ([\d.]+) at\s+(\d) seeds \(K = 64's ([\d.]+),\s+BALM ([\d.]+)\)",
                 [MASS_TEST['table']['EXO_SET_MASS']['greedy_mean'], len(MASS_TEST['seeds']),
                  MASS_TEST['table']['EXO']['greedy_mean'], MASS_TEST['table']['BALM']['greedy_mean']])]
MORE_ROWS = {'seed 2, lambda 5, 1,200 steps, cosine over 1,200':
                 'seed 2: λ = 5, 1,200 steps, cosine over 1,200',
             'seed 2, lambda 5, 600 steps then 600 more at 3e-6 (--resume)':
                 'seed 2: λ = 5, 600 steps, then 600 more at 3e-6',
             **{f'seed {s}, lambda 10, 600 steps': f'seed {s}: λ = 10' for s in (2, 1337, 3)}}
JSON_CLAIMS += [curve_row(MASS['more_runs'][key], label) for key, label in MORE_ROWS.items()]
DRIFT_0, DRIFT_5 = [DRIFT[f'lambda 0: {c}.pt'] for c in ('best', 'ckpt')], DRIFT['lambda 5: best.pt']
JSON_CLAIMS += [
    ('docs/addition.md', rf'the seed as the unit,\s+t p {P_E} against BALM and {P_E} against EXO with K '
                         rf'= 64 \(Holm over the four comparisons {P_E}\s+and ([\d.]+)\); each seed\'s '
                         rf'McNemar p at most {P_E} against',
     [M_BALM['seed_t_p'], M_EXO['seed_t_p'], M_BALM['seed_t_p_holm'], M_EXO['seed_t_p_holm'],
      max(M_EXO['per_seed_mcnemar_p'])]),
    ('docs/addition.md', r'7-0 but t p ([\d.]+) \(Holm ([\d.]+)\)',
     [M_LM['seed_t_p'], M_LM['seed_t_p_holm']]),
    ('docs/addition.md', r'both ran: ([-\d.]+), \+([\d.]+), \+([\d.]+) \(t p ([\d.]+)\)',
     M_SET['per_seed_diff'] + [M_SET['seed_t_p']]),
    ('docs/addition.md', r'samples outside it ([\d.]+)%, mass on it ([\d.]+), samples correct ([\d.]+) '
                         r'\(λ = 0\'s best: ([\d.]+)\)',
     [100 * DRIFT_5['wrong_outside_beam'], DRIFT_5['mass_on_beam_mean'], DRIFT_5['sample_correct'],
      DRIFT_0[0]['sample_correct']]),
    ('docs/addition.md', r'outside the LM\'s beam of 4 went from ([\d.]+)% to ([\d.]+)%, all wrong; their '
                         r'median\s+log P_LM from ([-\d.]+) to ([-\d.]+) .{0,60}?mean mass on the beam\s+'
                         r'from ([\d.]+) to ([\d.]+)\.',
     [100 * d['wrong_outside_beam'] for d in DRIFT_0]
     + [d[k] for k in ('wrong_outside_beam_median_log_p_lm', 'mass_on_beam_mean') for d in DRIFT_0]),
]
# docs/reports.md's Fig. 4 (assets/ordering.json) and the sizes of --ordering (DEFAULT)
ORDER = asset('ordering.json')
JSON_CLAIMS += [
    ('docs/reports.md', r'At LM steps ([\d,]+) / ([\d,]+) / ([\d,]+) / ([\d,]+) \(best\) BALM gains ([\d.]+) '
                        r'/ ([\d.]+) / ([\d.]+)\s+/ ([\d.]+) nats/token \(SE about ([\d.]+)\), JOINT BIT '
                        r'([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) \(SE ([\d.]+) / ([\d.]+) /\s+([\d.]+) / '
                        r'([\d.]+)\)',
     [p['iter'] for p in ORDER['points']] + [p['balm_gain'] for p in ORDER['points']]
     + [sum(p['balm_gain_se'] for p in ORDER['points']) / len(ORDER['points'])]
     + [p['joint_gain'] for p in ORDER['points']] + [p['joint_gain_se'] for p in ORDER['points']]),
    ('docs/reports.md', r'the energy\'s gain falls (\d+) times, BALM\'s (\d+);',  # whole times
     [int(ORDER['points'][0][f'{k}_gain'] / ORDER['points'][-1][f'{k}_gain']) for k in ('joint', 'balm')]),
]
# the claims table of docs/reports.md, one row a claim: statistic, SE, p (assets/claims.json)
JSON_CLAIMS += [('docs/reports.md', rf'\| {c} \| ([-+\d.]+) \(([\d.]+)\)[^|]*\| ([\d.]+) \|',
                 [CL[c]['diff'], CL[c]['se'], CL[c]['p']]) for c in CL]
JSON_CLAIMS += [('docs/reports.md', rf'\| {c} \| [^\n]*?\| not significant \(adjusted p ([\d.]+)\) \|',
                 [CL[c]['p_holm']])
                for c in ('C7', 'T1', 'T2')]
# docs/exact_logz.md's table: each n's row, its 12 numbers (assets/exact_logz.json, test)
EXACT_COLUMNS = [('T_n', 'bias'), ('T_n', 'spread'), ('T_n', 'mean_abs'), ('upper', 'bias'),
                 ('eq4_coverage',), ('eq4_coverage_slack',), ('estimate', 'bias'), ('estimate', 'spread'),
                 ('estimate', 'mean_abs'), ('estimate', 'within_tol'), ('sure', 'bias'), ('ess_median',),
                 ('sure_flag_share',)]


def exact_row(row):
    return [row[c[0]] if len(c) == 1 else row[c[0]][c[1]] for c in EXACT_COLUMNS]


EXACT_ROW = (r'\| {:,} \| ([-\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([-\d.]+) \| ([\d.]+) \(([\d.]+)\) \| '
             r'([-\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([-\d.]+) \| ([\d.]+) \| ([\d.]+) \|')
JSON_CLAIMS += [('docs/exact_logz.md', EXACT_ROW.format(row['n']), exact_row(row))
                for row in EXACT['test']['table']]

# docs/reports.md, "The fixed budget, measured": the base LM at 6,250 steps on 2 threads and one
# (assets/lm_fixed_budget.json)
FIXED = asset('lm_fixed_budget.json')
F2, F1 = FIXED['runs']['2_threads'], FIXED['runs']['1_thread']
JSON_CLAIMS += [
    ('docs/reports.md', r'tensor for tensor: step ([\d,]+), selection loss ([\d.]+)\. On one thread\s+'
                        r'\(`--jobs 2`\) it trains the same ([\d,]+) steps, best at ([\d,]+) with selection '
                        r'loss ([\d.]+), where the rule\s+had stopped it at ([\d,]+) \(([\d.]+)\)\. Its loss '
                        r'on the test windows is ([\d.]+) nats/char against ([\d.]+)\s+on 2 threads \(val: '
                        r'([\d.]+) against ([\d.]+)\)',
     [F2['best_iter'], F2['best_select_loss'], F1['iters'], F1['best_iter'], F1['best_select_loss'],
      FIXED['rule_one_thread']['stopped_at'], FIXED['rule_one_thread']['best_select_loss'],
      F1['test_loss'], F2['test_loss'], F1['val_loss'], F2['val_loss']]),
]

def test_doc_numbers_equal_the_committed_results():
    """Every row of JSON_CLAIMS: the numbers docs/addition.md, reports.md and exact_logz.md state from a
    committed run are those of assets/*.json, to the digits they give."""
    assert_json_claims_hold(JSON_CLAIMS, 40)


def test_fixed_budget_made_the_reference_lm():
    """assets/lm_fixed_budget.json: the fixed budget (patience 0) on 2 threads made the reference run's
    base LM tensor for tensor (docs/reports.md), at job.configs' budget; one thread made another LM."""
    from job.configs import DEFAULT
    assert F2['equal_to_reference'] and F2['max_abs_diff_to_reference'] == 0
    assert not F1['equal_to_reference'] and F1['max_abs_diff_to_reference'] > 0
    assert F1['iters'] == F2['iters'] == DEFAULT['lm']['max_iters'] == FIXED['reference']['best_iter']
    assert F1['patience'] == F2['patience'] == 0
    assert F2['best_select_loss'] == FIXED['reference']['best_select_loss']


def test_edits_cover_the_seeds_readme_averages():
    """README's P(correct) with the edits is a mean over the same seeds as its table's."""
    assert EDITS['seeds'] == asset('seeds_addition.json')['seeds']
    assert [r['seed'] for r in EDITS['rows']] == EDITS['seeds']


def test_a_planted_result_mismatch_fails():
    """The check can fail: EXO's old PPL, a share of the gap and a claim's p each give one line."""
    docs = claimed_docs(JSON_CLAIMS)
    planted = dict(docs, **{'docs/addition.md': docs['docs/addition.md'].replace('EXO 1.035', 'EXO 1.037')
                            .replace('EXO folds in 31%', 'EXO folds in 46%'),
                            'docs/reports.md': docs['docs/reports.md'].replace('| 0.15 |', '| 0.05 |')})
    bad = json_mismatches(JSON_CLAIMS, planted)
    assert len(bad) == 3 and "'1.037'" in bad[0] and "'46'" in bad[1] and "'0.05'" in bad[2], bad
    assert rounds_to('0.0013', 0.00125000001) and not rounds_to('0.0013', 0.00124)
    assert rounds_to('6,250', 6250)


def test_reports_lesson_rows_are_the_committed_runs():
    """docs/reports.md's table of the lesson's runs: each row's time, decoders and the mode's least lead
    over the LM's decoders (and its p) are assets/lesson.json's run of that command."""
    text = open(os.path.join(ROOT, 'docs', 'reports.md'), encoding='utf-8').read()
    runs = json.load(open(os.path.join(ROOT, 'assets', 'lesson.json')))['runs']
    assert len(runs) >= 4
    for r in runs:
        e = list(r['exact'].values())
        want = (f"| {r['commit']} | `{r['command']}` | {r['to_table_s']:.1f} s | "
                f"{e[0]:.3f} / {e[1]:.3f} / {e[2]:.3f} | {e[3]:.3f} | {e[4]:.3f} | "
                f"{r['mode_lead_over_lm']:+.3f} ({format_p(r['mode_p_over_lm_max'])}) |")
        assert want in text, want

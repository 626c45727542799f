"""The docs' times cannot drift from the runs that measured them: each stage time, wall time, probe and
bench ratio that docs/addition.md, reports.md and using.md state from a committed run (assets/*.json)
equals it to the digits they give (JSON_CLAIMS, as tests/test_doc_results.py's for the results), and
the runs said to have changed only the time made the same models and tables.
"""

import math
import re
import statistics

from job.configs import ADDITION
from tests.common import asset, assert_json_claims_hold, claimed_docs, json_mismatches

ADD_TIMES, H200 = asset('results_addition.json')['timings_s'], asset('gpu_h200_addition.json')

# (doc, regex, the values in assets/*.json), as tests/test_doc_results.py's JSON_CLAIMS
JSON_CLAIMS = [
    # docs/addition.md, the kept recipe's stage times, idle (assets/results_addition.json)
    ('docs/addition.md', r'BALM ([\d,]+) s \(\d+%\), EXO\s+(\d+), negatives (\d+) \+ (\d+) \(200,000 '
                         r'problems x 16\), BIT (\d+), UNIT (\d+), LM (\d+), RALM (\d+), MLM (\d+), '
                         r'TaiLr\s+(\d+), estimate_ppl (\d+), addition_eval (\d+)',
     [ADD_TIMES[k] for k in ('balm', 'exo', 'neg_train', 'neg_select', 'bit', 'unit', 'lm', 'ralm', 'mlm',
                             'tailr', 'estimate_ppl', 'addition_eval')]),
    # docs/addition.md, the H200 run (assets/gpu_h200_addition.json)
    ('docs/addition.md', r'\*\*([\d.]+) s, [\d.]+ min\*\* end to end', [H200['wall_s']]),
    ('docs/addition.md', r'Stages \(s\): BALM (\d+) \(.{0,40}\), BIT (\d+) and UNIT (\d+) \(', 
     [H200['timings_s'][k] for k in ('balm', 'bit', 'unit')]),
]
# docs/addition.md, "The job's EXO on both cores": its table of stage times and the threads' probe
# (assets/time_addition_wide.json)
WIDE = asset('time_addition_wide.json')
STAGE = r' \| ([\d,]+)'


def wide_row(run):
    """One run's row: LM, BALM, negatives (train + select), MLM, UNIT, BIT, RALM, TaiLr, EXO, estimate_ppl,
    addition_eval (s), then its wall time (min)."""
    pattern = (rf'\| [^|\n]*\({run["commit"]}\){STAGE * 2} \| ([\d,]+) \+ (\d+){STAGE} \| '
               rf'([\d,]+), ([\d,]+) \| ([\d,]+), ([\d,]+){STAGE} \| (\d+), (\d+) \| ([\d.]+) min \|')
    keys = ('lm', 'balm', 'neg_train', 'neg_select', 'mlm', 'unit', 'bit', 'ralm', 'tailr', 'exo',
            'estimate_ppl', 'addition_eval')
    return 'docs/addition.md', pattern, [run['timings_s'][k] for k in keys] + [run['wall_s'] / 60]


STEP, EVAL = WIDE['exo_threads']['step_s'], WIDE['exo_threads']['evaluation_s']
JSON_CLAIMS += [wide_row(r) for r in WIDE['runs']]
JSON_CLAIMS += [
    ('docs/addition.md',
     r'a step ([\d.]+) / ([\d.]+) s on one thread, ([\d.]+) / ([\d.]+) s on two \(\*\*([\d.]+)x',
     STEP['1'] + STEP['2'] + [sum(STEP['1']) / sum(STEP['2'])]),
    ('docs/addition.md', r'an\s+evaluation ([\d.]+) / ([\d.]+) s against ([\d.]+) / ([\d.]+) s \(([\d.]+)x\)',
     EVAL['1'] + EVAL['2'] + [sum(EVAL['1']) / sum(EVAL['2'])]),
]
# docs/addition.md, "Each distinct sample once": the job's stage times before and after, the bench's
# distinct section, what stayed the same (assets/time_addition_distinct.json)
DISTINCT = asset('time_addition_distinct.json')
D_BEFORE, D_AFTER = (DISTINCT['runs'][i]['timings_s'] for i in (0, -1))
D_BENCH, D_LAST, PROBE = DISTINCT['bench'], DISTINCT['runs'][-1], DISTINCT['exo_step_probe']
JSON_CLAIMS += [wide_row(r) for r in DISTINCT['runs']]
JSON_CLAIMS += [
    ('docs/addition.md', r'about 2 distinct\s+answers \(([\d.]+) after the eighth token',
     [DISTINCT['continuation_share']['share_by_token'][-1] * ADDITION['neg']['num_samples']]),
    ('docs/addition.md', r'\(([\d.]+) distinct of 16\),\s+([\d.]+)x the samples a second of decoding every '
                         r'row, the same tokens; with a random LM, whose 16\s+samples are all distinct, '
                         r'([\d.]+)x \(the bookkeeping costs nothing measurable\); a BIT scoring the'
                         r'\s+sharpened samples, ([\d.]+)x',
     [D_BENCH[k] for k in ('distinct_sharpened_continuations_per_prompt', 'distinct_sharpened_speedup',
                           'distinct_random_speedup', 'distinct_score_speedup')]),
    ('docs/addition.md', r"last run's\s+negatives took (\d+) s against (\d+) \(([\d.]+)x\), EXO (\d+) "
                         r'against (\d+), addition_eval (\d+) against (\d+),\s+estimate_ppl (\d+) against '
                         r'(\d+)\.',
     [D_AFTER['neg_train'], D_BEFORE['neg_train'], D_BEFORE['neg_train'] / D_AFTER['neg_train'],
      D_AFTER['exo'], D_BEFORE['exo'], D_AFTER['addition_eval'], D_BEFORE['addition_eval'],
      D_AFTER['estimate_ppl'], D_BEFORE['estimate_ppl']]),
    ('docs/addition.md', r'12 steps\): ([\d.]+) s a step, of it the policy.s 16 samples of each of '
                         r'128 prefixes ([\d.]+) s, the\s+policy.s backward and AdamW ([\d.]+), its forward '
                         r'on the set ([\d.]+), the LM.s beam of 4 ([\d.]+), the LM.s\s+log-probs ([\d.]+), '
                         r'the UNIT.s energies ([\d.]+)\.',
     [PROBE['step_s']] + list(PROBE['parts_s'].values())),
    ('docs/addition.md', r'they take\s+([\d.]+) s against ([\d.]+) in four \(([\d.]+) decoding every row',
     [PROBE['sampling_s'][k] for k in ('distinct, one chunk of 2048 rows',
                                       'distinct, chunks of 512 rows (now)',
                                       'every row, chunks of 512 rows (before)')]),
    ('docs/addition.md', r'is ([\d,]+) core-seconds: ([\d.]+) min on two cores, where the wall is ([\d.]+)\.',
     [D_LAST['core_s'], D_LAST['core_s'] / 120, D_LAST['wall_s'] / 60]),
]


# docs/addition.md, "Freed memory kept": the two runs and EXO's probe (assets/time_addition_malloc.json)
MALLOC = asset('time_addition_malloc.json')
(M_BEFORE, M_AFTER), M_EXO = MALLOC['runs'], MALLOC['probes']['exo_40']
spread = lambda ts: [min(ts), max(ts), statistics.median(ts)]
JSON_CLAIMS += [
    ('docs/addition.md', r'spent (\d+) s of its ([\d,]+) CPU seconds in the\s+kernel, through (\d+) '
                         r'million',
     [M_BEFORE['time_v']['sys_s'], M_BEFORE['time_v']['sys_s'] + M_BEFORE['time_v']['user_s'],
      M_BEFORE['time_v']['minor_faults'] / 1e6]),
    ('docs/addition.md', r'the whole job with it took \*\*([\d.]+) min\*\*\s+against c8c5f55.s '
                         r'\*\*([\d.]+)\*\*',
     [M_AFTER['wall_s'] / 60, M_BEFORE['wall_s'] / 60]),
    ('docs/addition.md', r'\| ([\d.]+)-([\d.]+) s \(median ([\d.]+)\), 30 s in the kernel \| '
                         r'([\d.]+)-([\d.]+) s \(median ([\d.]+)\), 5 s \|',
     spread(M_EXO['default_s']) + spread(M_EXO['kept_s'])),
    ('docs/addition.md', r'in turn\): (\d+) s against (\d+), its models and tables\s+bit for bit; the '
                         r'kernel.s (\d+) s fell to (\d+), but its user time rose from (\d+) s to (\d+):',
     [MALLOC['probes']['lesson'][k][v] for v in ('wall_s', 'sys_s', 'user_s') for k in ('default', 'kept')]),
]
# docs/reports.md's MFU at the main job's sizes (assets/bench_job_sizes*.json)
BENCH, BENCH_AVX2 = asset('bench_job_sizes.json'), asset('bench_job_sizes_avx2.json')
MFU = ('train_mfu_fp32', 'sampling_mfu_cached', 'energy_forward_mfu', 'nce_train_mfu')
JSON_CLAIMS += [
    ('docs/reports.md', r'fp32 matmul peak,\s+(\d+) GFLOP/s on 2 cores; .{0,80}?LM training ([\d.]+) \(bf16: '
                        r'([\d.]+)x faster, ([\d.]+) of the bf16 peak\), cached\s+sampling \(.{0,60}?\) '
                        r'([\d.]+), energy forward ([\d.]+), NCE training ([\d.]+)\.',
     [BENCH['matmul_gflops_fp32'], BENCH['train_mfu_fp32'], BENCH['bf16_train_speedup'],
      BENCH['train_mfu_bf16']] + [BENCH[k] for k in MFU[1:]]),
    ('docs/reports.md', r'fp32\): ([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+) of a (\d+) GFLOP/s peak',
     [BENCH_AVX2[k] for k in MFU] + [BENCH_AVX2['matmul_gflops_fp32']]),
]

# docs/using.md and reports.md: the H100 run (assets/gpu_h100.json)
H100 = asset('gpu_h100.json')['main_job']
H100_STAGES = [H100['stage_seconds'][k]
               for k in ('balm', 'ralm', 'neg_train', 'neg_select', 'mlm', 'bit', 'unit', 'tailr')]
JSON_CLAIMS += [
    ('docs/using.md', r'the main job\'s stages through TaiLr took\s+([\d.]+) minutes',
     [H100['total_s'] / 60]),
    ('docs/reports.md', r'LM (\d+) \(([\d,]+) steps at (\d+)k tokens/s\), BALM (\d+), RALM (\d+), '
                        r'negatives (\d+) \+ (\d+), MLM (\d+), BIT (\d+), UNIT (\d+),\s+TaiLr (\d+) s: '
                        r'([\d.]+) min to this point',
     [H100['stage_seconds']['lm'], H100['lm']['stopped_at'], H100['lm']['tokens_per_s'] / 1000] + H100_STAGES
     + [H100['total_s'] / 60]),
    ('docs/reports.md', r'the quick job passed\s+every stage there in (\d+) s',
     [asset('gpu_h100.json')['quick_job']['wall_s']]),
]
# docs/reports.md's stage times (s): this run's, the earlier recipe's, the AVX2 fp32 run's
STAGE_ROW = ('lm', 'balm', 'ralm', 'neg_train', 'neg_select', 'mlm', 'bit', 'unit', 'tailr', 'metrics',
             'estimate_ppl', 'samples', 'samples_untruncated')


def stage_times(name):
    t = asset(name)['timings_s']
    return [t[k] for k in STAGE_ROW] + [t['claims'] + t['figures']]


TIMES_ROW = (r'\| ([\d,]+) \| (\d+) \| (\d+) \| {} \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| '
             r'(\d+), (\d+) \| (\d+) \| {} min \|')
EARLIER, AVX2 = stage_times('results_earlier_recipe.json'), stage_times('results_avx2_fp32.json')
JSON_CLAIMS += [
    ('docs/reports.md', TIMES_ROW.format(r'(\d+) \+ (\d+)', 46), stage_times('results.json')),
    ('docs/reports.md', TIMES_ROW.format(r'(\d+)', 32),
     EARLIER[:3] + [EARLIER[3] + EARLIER[4]] + EARLIER[5:]),
    ('docs/reports.md', r'LM (\d+) \(5,000 steps\), BALM (\d+), RALM (\d+),\s+negatives (\d+), MLM (\d+), '
                        r'BIT (\d+) \(to its 2,400-step cap\), UNIT (\d+), TaiLr (\d+), metrics '
                        r'(\d+),\s+estimate_ppl (\d+), samples (\d+) \+ (\d+), claims and figures (\d+) s',
     AVX2[:3] + [AVX2[3] + AVX2[4]] + AVX2[5:]),
]


# docs/addition.md, "With AVX2 kernels in fp32, today's recipe": the stage times, the wait on BALM, the
# test rows beside the seeds' (assets/time_addition_avx2.json)
AVX2_ADD = asset('time_addition_avx2.json')
X_T, X_S = AVX2_ADD['timings_s'], AVX2_ADD['spans_s']
X_ROWS = {(r['model'], r['method']): r for r in AVX2_ADD['test_exact']['rows']}
X_TABLE = {'LM greedy': ('BASE LM', 'greedy'),
           'LM log-prob rerank of 64': ('BASE LM', 'log-prob rerank, n = 64'),
           'BALM greedy': ('BALM', 'greedy'),
           'joint model: Algorithm 1 of 64': ('JOINT', 'Algorithm 1, n = 64'),
           'joint model: mode of 64': ('JOINT', 'joint mode, n = 64'),
           'joint model: mode over beam and samples': ('JOINT', 'joint mode, beam + samples, n = 64')}
JSON_CLAIMS += [
    ('docs/addition.md', r'\*\*([\d.]+) min\*\* wall, ([\d,]+) s of user CPU\. Stage seconds: BALM '
                         r'([\d,]+), BIT (\d+), UNIT (\d+), EXO (\d+), LM (\d+),\s+negatives (\d+) \+ (\d+), '
                         r'RALM (\d+), MLM (\d+), TaiLr (\d+), addition_eval (\d+), estimate_ppl (\d+)\.',
     [AVX2_ADD['wall_s'] / 60, AVX2_ADD['time_v']['user_s']]
     + [X_T[k] for k in ('balm', 'bit', 'unit', 'exo', 'lm', 'neg_train', 'neg_select', 'ralm', 'mlm',
                         'tailr', 'addition_eval', 'estimate_ppl')]),
    ('docs/addition.md', r'BALM holds one\s+core for its first ([\d,]+) s [^|]{0,60}?\(([\d,]+) s of one '
                         r'core\) is\s+longer [^|]{0,50}? BIT \(([\d,]+) s\), [^|]{0,80}? starts \(at '
                         r'([\d,]+) s\)',
     [X_S['balm'][1], X_T['balm'] + X_T['unit'],
      sum(X_T[k] for k in ('lm', 'neg_train', 'mlm', 'neg_select', 'bit')), X_S['exo'][0]]),
    ('docs/addition.md', r"EXO's greedy, ([\d.]+), is not compared", [X_ROWS['EXO', 'greedy']['exact']]),
    ('docs/addition.md', r'25 min \(AVX2, fp32: ([\d.]+) min with today', [AVX2_ADD['wall_s'] / 60]),
] + [('docs/addition.md', rf'\| {label} \| ([\d.]+) \(([\d.]+)\) \| ([\d.]+) \(([\d.]+)\) \|',
      [X_ROWS[k][f] for f in ('exact', 'exact_se', 'seeds_mean', 'seeds_sd')])
     for label, k in X_TABLE.items()]


# docs/reports.md, "Rerun, 2026-12-02": the main job's stage times, the wait policy's and side by side
# probes (assets/time_main_job.json)
RERUN = asset('time_main_job.json')
R_T, R_P = RERUN['timings_s'], RERUN['probes']
R_SIDE = R_P['side_by_side']
JSON_CLAIMS += [
    ('docs/reports.md', r'time_main_job.json`\): \*\*([\d.]+) min\*\*, the lesson.s (\d+) s first',
     [RERUN['wall_s'] / 60, R_T['lesson']]),
    ('docs/reports.md', r'Stages \(s\): LM (\d+), BALM (\d+),\s+RALM (\d+), negatives (\d+) \+ (\d+), '
                        r'MLM (\d+), BIT (\d+), UNIT (\d+), TaiLr (\d+), metrics (\d+), estimate_ppl (\d+),'
                        r'\s+samples (\d+) \+ (\d+)\.',
     [R_T[k] for k in ('lm', 'balm', 'ralm', 'neg_train', 'neg_select', 'mlm', 'bit', 'unit', 'tailr',
                       'metrics', 'estimate_ppl', 'samples', 'samples_untruncated')]),
    ('docs/reports.md', r'The LM trained at ([\d.]+)k tokens/s, against ([\d.]+)k on 2026-11-28',
     [R_SIDE['two_threads_in_the_job'] / 1000,
      next(p['tokens_per_s'] for p in asset('results.json')['profile'] if p['stage'] == 'lm') / 1000]),
    ('docs/reports.md', r'takes ([\d.]+) / ([\d.]+) s with\s+spinning threads against ([\d.]+) / ([\d.]+) s',
     R_P['wait_policy']['spinning_s'] + R_P['wait_policy']['sleeping_s']),
    ('docs/reports.md', r'ran at ([\d.]+)k and ([\d.]+)k tokens/s side\s+by side against ([\d.]+)k alone: '
                        r'.{0,60}?about ([\d.]+)x the work of one\s+on both threads \(([\d.]+)k\)',
     [t / 1000 for t in R_SIDE['kept']['side_by_side']] + [R_SIDE['kept']['alone'] / 1000,
      sum(R_SIDE['kept']['side_by_side']) / R_SIDE['two_threads_in_the_job'],
      R_SIDE['two_threads_in_the_job'] / 1000]),
]

# docs/reports.md, "`--jobs 2` against `--jobs 1`, the same day", and docs/using.md
# (assets/time_main_job_jobs.json)
JOBS = asset('time_main_job_jobs.json')['runs']
J2, J1 = JOBS['jobs_2'], JOBS['jobs_1']
J_WIDE = ('lesson', 'prepare', 'estimate_ppl', 'claims', 'figures')  # alone: on both cores, or tiny
J_BOUND = sum(J2['timings_s'][k] for k in J_WIDE) + sum(
    v for k, v in J2['timings_s'].items() if k not in J_WIDE) / 2  # two slots at most
J_ROW, J1_ROW = ({r['model']: r for r in run['test_rows']} for run in (J2, J1))
J1_ONE = sum(v for k, v in J1['timings_s'].items() if k not in J_WIDE)
J_SLOWER = sum(v for k, v in J2['timings_s'].items() if k not in J_WIDE) / J1_ONE
JSON_CLAIMS += [
    ('docs/reports.md', r'\*\*([\d.]+) min\*\* with `--jobs 2`, \*\*([\d.]+) min\*\* with\s+`--jobs 1`',
     [J2['wall_s'] / 60, J1['wall_s'] / 60]),
    ('docs/reports.md', r'ran wide, on both cores \((\d+) and\s+(\d+) s\)',
     [J2['timings_s']['lesson'], J2['timings_s']['estimate_ppl']]),
    ('docs/reports.md', r'\(([\d.]+)x in all; the LM ([\d,]+) s against (\d+), BALM ([\d,]+) against '
                        r'(\d+)\): two side by side did about ([\d.]+)x',
     [J_SLOWER, J2['timings_s']['lm'], J1['timings_s']['lm'], J2['timings_s']['balm'],
      J1['timings_s']['balm'], 2 / J_SLOWER]),
    ('docs/reports.md', r'make\s+([\d,]+) s, the run ([\d,]+), so no order of these stages would save '
                        r'more than (\d+) s', [J_BOUND, J2['wall_s'], J2['wall_s'] - J_BOUND]),
    ('docs/reports.md', r'its LM kept step ([\d,]+) \(selection loss ([\d.]+), against ([\d.]+) at ([\d,]+) '
                        r'on two\) and tests worse \(PPL\s+([\d.]+) against ([\d.]+)\)',
     [J2['lms']['BASE']['best_step'], J2['lms']['BASE']['best_select_loss'],
      J1['lms']['BASE']['best_select_loss'], J1['lms']['BASE']['best_step'], J_ROW['BASE LM']['ppl'],
      J1_ROW['BASE LM']['ppl']]),
    ('docs/reports.md', r'BALM gains ([\d.]+) \(SE ([\d.]+)\) and C1 fails',
     [J_ROW['BALM']['gain_nats_per_token'], J_ROW['BALM']['gain_se']]),
    ('docs/using.md', r'each ran ([\d.]+)x slower, .{0,80}?\(([\d.]+) min against ([\d.]+) the same day',
     [J_SLOWER, J2['wall_s'] / 60, J1['wall_s'] / 60]),
]

# docs/addition.md, "The method alone", and README (assets/time_lesson6.json); the job's work: the run
# of d7f61f0 (M_AFTER), EXO's stage on both cores
L6, M_T = asset('time_lesson6.json'), M_AFTER['timings_s']
L6_T, L6_PROBE = L6['timings_s'], L6['chain_probe']
M_WORK = sum(M_T.values()) + M_T['exo']
WORK_SHARES = dict(exo=('exo',), balm=('balm',), bit=('bit', 'mlm'), ralm=('ralm', 'tailr'),
                   reports=('estimate_ppl', 'samples', 'samples_untruncated', 'claims', 'figures'),
                   method=('prepare', 'lm', 'neg_train', 'neg_select', 'unit', 'addition_eval'))
share = lambda group: 100 * sum(M_T[s] * (1 + (s == 'exo')) for s in WORK_SHARES[group]) / M_WORK
L6_ROWS = {  # the table's label: (lesson.json's decoder, or None: the beam's row), the seeds' row
    'LM greedy': ('LM greedy', 'BASE LM', 'greedy'),
    'LM log-prob rerank of 64': ('LM log-prob rerank of n', 'BASE LM', 'log-prob rerank, n = 64'),
    'joint model: Algorithm 1 of 64': ('joint model: Algorithm 1 of n', 'JOINT', 'Algorithm 1, n = 64'),
    'joint model: mode of 64': ('joint model: mode of n', 'JOINT', 'joint mode, n = 64'),
    'joint model: mode over beam and samples': (None, 'JOINT', 'joint mode, beam + samples, n = 64')}
SEEDS_EXACT = {(r['model'], r['method']): r['exact'] for r in asset('seeds_addition.json')['rows']}


def lesson6_row(label):
    """The table's row `label`: the --digits 6 run's exact match, and the seeds' (per_seed, mean, sd)."""
    key, model, method = L6_ROWS[label]
    mine = L6['test']['exact'][key] if key else L6['test']['beam_mode_exact']
    return mine, SEEDS_EXACT[model, method]


S6 = L6_PROBE['short']
NUM = r'([\d.]+)'
JSON_CLAIMS += [
    ('docs/addition.md', r'did ([\d,]+) s of\s+work, a core each second, EXO.s (\d+) s on both of its cores: '
                         r'on two cores it cannot end before\s+([\d,]+) s \(([\d.]+) min\), and it ended at '
                         r'([\d,]+)\.',
     [M_WORK, M_T['exo'], M_WORK / 2, M_WORK / 120, M_AFTER['wall_s']]),
    ('docs/addition.md', rf'EXO is {NUM}% of that work, BALM {NUM}%, the BIT and its MLM\s+{NUM}%, RALM and '
                         rf'TaiLr {NUM}%, Table 1 and the samples {NUM}%; the method itself \(the problems, '
                         rf'the LM, the\s+negatives, the UNIT and the accuracy table\) {NUM}%',
     [share(g) for g in ('exo', 'balm', 'bit', 'ralm', 'reports', 'method')]),
    ('docs/addition.md', r'\*\*([\d.]+) min\*\* \(([\d,]+) s\): LM (\d+) s, negatives (\d+) \+\s+(\d+), '
                         r'UNIT (\d+), the accuracy table (\d+)\.',
     [L6['wall_s'] / 60, L6['wall_s']]
     + [L6_T[k] for k in ('lm', 'neg_train', 'neg_select', 'unit', 'addition_eval')]),
    ('docs/addition.md', rf'Two threads buy\s+the LM {NUM}x, the negatives {NUM}x and the UNIT {NUM}x '
                         rf'\(short runs taken in turn, one thread then two:\s+500 LM steps {NUM} / {NUM} '
                         rf's, the negatives of 20,000 problems {NUM} / {NUM} s, 1,000 UNIT steps {NUM} '
                         rf'/\s+{NUM} s\); the same stages run as separate commands earlier that day '
                         r'took (\d+), (\d+) \+ (\d+), (\d+) and (\d+) s',
     [S6[f'{k}_1t'] / S6[f'{k}_2t'] for k in ('lm500', 'neg20k', 'unit1000')]
     + [S6[f'{k}_{n}t'] for k in ('lm500', 'neg20k', 'unit1000') for n in (1, 2)]
     + list(L6_PROBE['full_2_threads'].values())),
    ('docs/addition.md', rf'meets 15 min with\s+bf16 \({NUM}\), .{{0,200}}?stays at {NUM} min, {NUM} of them '
                         r'its work', [L6['wall_s'] / 60, M_AFTER['wall_s'] / 60, M_WORK / 120]),
    ('docs/addition.md', rf'meets the 15: `python -m\s+job.lesson --digits 6`, {NUM} min; the job.s own work '
                         rf'needs {NUM} min', [L6['wall_s'] / 60, M_WORK / 120]),
    ('README.md', rf'The method alone: `python -m job.lesson --digits 6`, {NUM} min', [L6['wall_s'] / 60]),
]
JSON_CLAIMS += [('docs/addition.md', rf'\| {re.escape(label)} \| {NUM} \| {NUM} \| {NUM} \({NUM}\) \|',
                 [mine, seeds['per_seed'][0], seeds['mean'], seeds['sd']])
                for label in L6_ROWS for mine, seeds in [lesson6_row(label)]]

def test_jobs_runs_of_the_main_job():
    """assets/time_main_job_jobs.json: --jobs 1 made Table 1 again (what docs/reports.md says), --jobs 2
    trained on one thread beside another (the lesson and Table 1 on two) and C1 failed there."""
    same = J1['same_as_results_json']
    assert same['rows_max_rel_diff'] < 1e-9 and all(same['claims_holds_equal'].values())
    assert {k: v.split(',')[0] for k, v in J2['threads'].items()} == dict(
        {k: 'threads: 1' for k in J2['timings_s'] if k not in J_WIDE}, lesson='threads: 2',
        estimate_ppl='threads: 2')
    assert J2['claims']['C1']['holds'] is False and J2['wall_s'] >= J_BOUND


def assert_same_numbers(same, run):
    """What a run that changed only the time made: the run before's eight models, negatives and tables."""
    assert all(same['models_equal'].values()) and len(same['models_equal']) == 8, run
    assert same['negative_tokens_equal'] and same['accuracy_txt_equal'] and same['ppl_txt_equal'], run
    assert same['negative_logp_max_abs_diff'] < 5e-5 and same['ppl_json_max_abs_diff'] < 4e-4, run


def test_distinct_decoding_changed_only_the_time():
    """assets/time_addition_distinct.json: the runs after each distinct sample once made the run before's
    models, negatives' tokens and tables (what docs/addition.md says of them), and its core-seconds
    count EXO, the wide stage, on both cores; the bench's decodings drew the same tokens."""
    for run, same in DISTINCT['same_as_before'].items():
        assert_same_numbers(same, run)
    for r in DISTINCT['runs']:
        assert math.isclose(r['core_s'], sum(r['timings_s'].values()) + r['timings_s']['exo'], abs_tol=0.2)
    assert D_BENCH['distinct_random_same_tokens'] and D_BENCH['distinct_sharpened_same_tokens']
    shares = DISTINCT['continuation_share']['share_by_token']  # of the job's samples, growing with each token
    assert 1 / ADDITION['neg']['num_samples'] <= shares[0] and shares == sorted(shares) and shares[-1] <= 1


def test_freed_memory_changed_only_the_time():
    """assets/time_addition_malloc.json: the job with freed memory kept made c8c5f55's models, negatives
    and tables bit for bit (docs/addition.md, Freed memory kept), and its run's wall time is its minutes."""
    same = MALLOC['same_as_before']
    assert_same_numbers(same, 'malloc')
    assert same['negative_logp_max_abs_diff'] == 0 and same['ppl_json_max_abs_diff'] == 0
    assert same['claims_txt_equal'] and [r['commit'] for r in MALLOC['runs']] == ['c8c5f55', 'd7f61f0']
    assert all(round(r['wall_s'] / 60, 1) == r['wall_min'] for r in MALLOC['runs'])


def test_main_job_rerun_made_table_1_again():
    """assets/time_main_job.json: what docs/reports.md's "Rerun, 2026-12-02" says of it: Table 1 to
    within 1e-9 relative, the LMs' steps and losses and the held-out gains equal, both negatives'
    stages with sleeping threads, and the burst probe as stated."""
    same = RERUN['same_as_before']
    assert same['rows_max_rel_diff'] < 1e-9 and same['rows_non_float_equal']
    assert same['lms_equal'] and same['held_out_gain_equal'] and len(same['claims_differing']) == 1
    sleeping = sorted(k for k, why in RERUN['threads'].items() if why.startswith('sleeping'))
    assert sleeping == ['lesson/neg_train', 'neg_train'] and RERUN['commit'] == '2243e81'
    burst = R_P['burst']
    assert burst['burst_0_5_s'] == dict(one_reading=['PASSIVE'] * 5, three_readings=['spinning'] * 5)
    assert burst['busy_5_s'] == dict(one_reading=['PASSIVE'] * 5, three_readings=['PASSIVE'] * 5)
    assert math.isclose(RERUN['wall_s'], sum(R_T.values()), rel_tol=0.01)


def test_avx2_run_within_one_sd_of_the_seeds():
    """assets/time_addition_avx2.json: each compared row's seeds' mean and SD are assets/seeds_addition.json's
    and lie within one SD of the run's exact match, as docs/addition.md says; the wall time is the spans'."""
    compared = [r for r in AVX2_ADD['test_exact']['rows'] if 'seeds_mean' in r]
    assert set(X_TABLE.values()) <= {(r['model'], r['method']) for r in compared}
    for r in compared:
        s = SEEDS_EXACT[r['model'], r['method']]
        assert (r['seeds_mean'], r['seeds_sd']) == (round(s['mean'], 4), round(s['sd'], 4)), r
        assert r['within_one_sd'] and abs(r['exact'] - s['mean']) <= s['sd'], r
    assert math.isclose(AVX2_ADD['wall_s'], max(e for _, e in X_S.values()), abs_tol=0.2)


def test_the_method_alone_within_one_sd_of_the_seeds():
    """assets/time_lesson6.json: `job.lesson --digits 6` at seed 1337, each decoder of docs/addition.md's
    table within one SD of the addition job's ten seeds' mean; its wall time covers its stages' (and no
    more than a process start beyond); the job's work is split among groups that hold each stage once."""
    for label in L6_ROWS:
        mine, seeds = lesson6_row(label)
        assert abs(mine - seeds['mean']) <= seeds['sd'], (label, mine, seeds['mean'], seeds['sd'])
    assert sum(L6_T.values()) <= L6['lesson_seconds'] <= L6['wall_s'] <= sum(L6_T.values()) + 5
    stages = [s for group in WORK_SHARES.values() for s in group]
    assert sorted(stages) == sorted(M_T) and math.isclose(sum(map(share, WORK_SHARES)), 100)


def test_doc_times_equal_the_committed_runs():
    """Every row of JSON_CLAIMS: the times the docs state from a committed run are assets/*.json's."""
    assert_json_claims_hold(JSON_CLAIMS, 20)


def test_a_planted_time_mismatch_fails():
    """The check can fail: a stage time of the kept recipe and the malloc run's wall time, each one line."""
    docs = claimed_docs(JSON_CLAIMS)
    text = docs['docs/addition.md']
    planted = text.replace(f"BALM {ADD_TIMES['balm']:,.0f} s (", 'BALM 9,999 s (').replace(
        f"took **{M_AFTER['wall_s'] / 60:.1f} min**", 'took **99.9 min**')
    assert planted.count('9,999') > text.count('9,999') and planted.count('99.9 min') > text.count('99.9 min')
    bad = json_mismatches(JSON_CLAIMS, dict(docs, **{'docs/addition.md': planted}))
    assert len(bad) == 2 and "'9,999'" in bad[0] and "'99.9'" in bad[1], bad

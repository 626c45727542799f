"""
The main job's recipes: sizes, budgets and what each stage trains on, as the flags of each stage's
script (job/reproduce.py turns them into commands). DEFAULT is the README's run on Shakespeare,
QUICK its tiny smoke test, QUICK_GPT2 the BPE path, ADDITION and ADDITION_QUICK the task with a
known answer (docs/addition.md); RELATIVE_TIME turns the LM stage's time into an estimate of a run.
"""

# Sizes and budgets (README has the stage timings). What was chosen on what (docs/experiments.md):
#   selection split: each model's best.pt and stopping, n = 64, the MLM's length, mu, EXO's lr;
#   val (before the protocol): the BIT's ALiBi, its NCE lr 1e-4, pooling over the continuation;
#   test (looked at, then fixed; no two recipes compared on it since): C6's unit (characters, not
#   words), the talk table's untruncated proposal, round 2's recipes, addition's N = 6;
#   not chosen: TaiLr's gamma = 0.01, the smallest tried (the selection NLL prefers gamma -> 0, MLE;
#   generation quality, the talk's criterion, was not measured).
# Stopping, this project's protocol (the paper trains for fixed budgets, its Table 4): BALM, RALM and
# TaiLr stop once their lowest selection loss improved by less than 0.1% over 2 evaluations
# (model.stopped_early, RULE), their best weights kept (best.pt); max_iters is a cap that
# `converged: false` reports. The base LM trains a fixed budget, the step at which that rule stopped it
# in the reference run (docs/reports.md). In the paper's structure: BALM = LM + UNIT parameters, RALM's
# residual the LM's shape, the BIT smaller than the UNIT (docs/experiments.md, 2026-11-26 late).
RULE = dict(max_iters=10000, patience=2, min_rel_delta=0.001)
DEFAULT = dict(
    # a fixed 6,250 steps, where the rule stopped it on 2 threads in the reference run (selection loss
    # 1.5591); the rule, on changes of 0.1%, stopped it at 4,500 on one thread or in fp32 and at 8,250 on
    # an Intel Xeon: rounding turned into thousands of steps, and so into another Table 1. The cosine
    # decay ends at step 3000, then min_lr
    lm=dict(n_layer=3, n_head=3, n_embd=96, block_size=256, batch_size=16, max_iters=6250,
            lr_decay_iters=3000, lr=3e-3, min_lr=3e-4, warmup_iters=40, eval_interval=250, patience=0,
            snapshots='500,1000,2000'),
    balm=dict(n_head=3, **RULE),                         # width chosen by --match_params (head size 48)
    residual=dict(n_layer=3, n_head=3, n_embd=96, **RULE),  # RALM's phi: the LM's shape, as in the paper
    # the energy's recipe, chosen on this corpus's selection split (assets/energy_recipes.json, 256 prefixes x
    # 64 samples): binary NCE (Eq. 3) on 2 LM samples per prefix, chunks of 32, best.pt by the held-out NCE
    # loss gained 0.00128 / 0.00124 nats/token (BIT / UNIT) there; nce_train.py's defaults (ranking NCE over
    # K = 8, best.pt by the held-out gain; addition's choice) 0.00094 / 0.00076 (paired: -0.00034, SE
    # 0.00034; -0.00048, SE 0.00038) for about 15 more minutes of the job
    neg=dict(prefix_len=128, gen_len=64, num_samples=2, train_prefixes=8000, select_prefixes=1024, chunk=32),
    # BIT: a 3x80 body (fewer parameters than the UNIT), MLM-pretrained from scratch with ALiBi
    # (without it the MLM sits at the unigram loss), fine-tuned by NCE at a low lr that keeps what
    # the MLM knows; UNIT: the LM's shape and weights, also at a low lr (docs/experiments.md)
    mlm=dict(n_layer=3, n_head=5, n_embd=80, max_iters=3000, eval_interval=500, alibi=True, patience=0,
             min_rel_delta=0, snapshots=''),  # the LM's flags otherwise
    # TaiLr (Ji et al., 2023): the base LM fine-tuned at its final lr, stopped by the LMs' rule; gamma
    # not chosen (the selection NLL cannot choose it: docs/experiments.md)
    tailr=dict(RULE, gamma=0.01, max_iters=2000, lr=3e-4, min_lr=3e-4, warmup_iters=0, snapshots=''),
    # the talk's metric energy: mu fitted on 512 selection prefixes x 64 LM samples; its table on test
    metrics=dict(num_prefixes=512, fit_samples=64, check_prefixes=64, table_prefixes=128, num_samples=32),
    # each energy early-stopped on its held-out NCE loss (its best.pt: steps after it are not used)
    bit=dict(batch_size=16, max_iters=2400, lr=1e-4, warmup_iters=30, eval_interval=300, eval_prefixes=1024,
             patience=2, loss='binary', select='loss'),
    unit=dict(batch_size=16, max_iters=1200, lr=1e-4, min_lr=1e-5, warmup_iters=50, eval_interval=200,
              eval_prefixes=1024, patience=2, loss='binary', select='loss'),
    # n = 64 on 256 prefixes: on the selection split (an earlier LM and its BIT, n_ref = 1,024) the
    # bounds' bias at n = 64 is -0.00013 / +0.00016 nats/token, under a quarter of the gain's SE
    # (docs/experiments.md). Fig. 1 on 128 prefixes, log Z every 16 positions; the sampled last step
    # (a check of the exact one) from 128 samples, the calibration on 8 prefixes (the budget's sizes)
    ppl=dict(num_prefixes=256, num_samples=64, ns='2,8,32,64', step_prefixes=128, step_samples=32,
             step_every=16, last_step_samples=128, calib_prefixes=8, calib_samples=1024),
    # Figs. 2 right and 3 on hundreds of prefixes
    samples=dict(num_prefixes=256, num_samples=64, logz_samples=32, table_prefixes=1, candidate_samples=16),
    # reproduce.py --ordering: each LM snapshot with its own negatives and BIT, scored on val
    ordering=dict(train_prefixes=4000, select_prefixes=256, bit_iters=400, num_prefixes=128, num_samples=32),
)
# the smoke test: tiny models, and a base LM deliberately undertrained (30 steps, char PPL ~21-25)
# so that the energy has a large, robust gain to find, which the CI test asserts
QUICK = dict(
    lm=dict(n_layer=2, n_head=2, n_embd=64, block_size=128, batch_size=16, max_iters=30, lr=3e-3,
            warmup_iters=10, eval_interval=15, final_eval_windows=256, snapshots='15'),
    balm=dict(),
    residual=dict(n_layer=1, n_head=2, n_embd=64),
    neg=dict(prefix_len=64, gen_len=32, num_samples=2, train_prefixes=1600, select_prefixes=64),
    mlm=dict(n_embd=32, max_iters=100, alibi=True),
    bit=dict(batch_size=16, max_iters=600, lr=1e-3, warmup_iters=10, eval_interval=150),
    unit=dict(batch_size=16, max_iters=300, lr=1e-3, warmup_iters=10, eval_interval=75),
    ppl=dict(num_prefixes=128, num_samples=64, ns='2,8,64', step_prefixes=2, step_samples=4,
             last_step_samples=64, calib_prefixes=4, calib_samples=512),
    samples=dict(num_prefixes=4, num_samples=32, logz_samples=8, table_prefixes=1, candidates=16,
                 candidate_samples=4),
    ordering=dict(train_prefixes=400, select_prefixes=32, bit_iters=100, num_prefixes=16, num_samples=8),
    tailr=dict(gamma=0.01, max_iters=20, lr=1e-3, eval_interval=10, final_eval_windows=256, snapshots=''),
    # an LM of 30 steps repeats no 4-gram in 32 characters, which real text does: no rep-N, div
    metrics=dict(metrics='tr-8,coh,logp', num_prefixes=64, fit_samples=64, check_prefixes=32,
                 table_prefixes=16, num_samples=8),
)
# the paper's tokenizer (GPT-2 BPE, 50,257 tokens) through every stage, with tiny models: a test
# that the BPE path runs end to end (the vocabulary makes the LM head and the exact last-step
# enumeration the big costs), not a result
QUICK_GPT2 = dict(
    lm=dict(n_layer=1, n_head=2, n_embd=32, block_size=64, batch_size=8, max_iters=30, lr=3e-3,
            warmup_iters=5, eval_interval=15, eval_iters=4, final_eval_windows=32, print_samples=0),
    balm=dict(),
    residual=dict(n_layer=1, n_head=2, n_embd=32),
    neg=dict(prefix_len=24, gen_len=8, num_samples=2, train_prefixes=32, select_prefixes=8),
    mlm=dict(n_embd=32, max_iters=20, alibi=True),
    bit=dict(batch_size=8, max_iters=20, lr=1e-3, warmup_iters=5, eval_interval=10),
    unit=dict(batch_size=8, max_iters=20, lr=1e-3, warmup_iters=5, eval_interval=10),
    ppl=dict(num_prefixes=4, num_samples=4, ns='2,4', step_prefixes=2, step_samples=2,
             last_step_samples=16, calib_prefixes=2, calib_samples=32),
    samples=dict(num_prefixes=2, num_samples=4, table_prefixes=1, candidates=4, keep=2, table_k=2,
                 candidate_samples=2),
    tailr=dict(gamma=0.01, max_iters=10, eval_interval=5, final_eval_windows=32, snapshots=''),
    # no metric energy: the samples of a 30-step BPE LM never reach real text's metrics (its real
    # text's log P_LM is above every sample's, its hidden states all alike), so nothing can match them
)
# --data addition (data/addition/prepare.py, docs/addition.md): problems `a+b=c` of N = 6 digits, the
# sum most-significant digit first; each window is one problem (prefix 2N + 2 = 14 tokens, the sum
# and end of text 8). No metric energy (repetition and coherence say nothing here); EXO distils the
# energy that gains more on the selection split (BIT or UNIT: reproduce.stronger_energy) into an LM
# (extensions/exo.py) and addition_eval.py scores every model against the known answer. Chosen on
# the selection split: the energies' recipe, BALM's lr and patience, EXO's K, lr and steps; the rest
# not tuned. Its time: 30.6 min idle with --jobs 2 on a 2-core AMD EPYC with bf16, with the EXO of 200
# steps from the LM (docs/addition.md); EXO's 600 on-policy steps from BALM cost more.
# Every LM here (BASE, BALM, RALM, TaiLr) is stopped and selected on the loss of the answer alone
# (train_lm.py --select_on continuation): the operands' digits are ~87% of the window's loss and
# irreducible, so 0.1% of the window's loss was ~10% of the answer's. The rule: less than 1% better
# on the answer over 2 evaluations; the caps are far enough for it to fire.
ADDITION = dict(
    data=dict(digits=6),
    # the base LM: a fixed 4,500 steps (the cosine ends at 4,000), best.pt by the answer's selection loss.
    # The stopping rule stopped it anywhere from 4,500 to 8,500 steps by thread count and CPU, on changes
    # of 0.4% where the curve is flat; a budget stops it at the same step everywhere. It under-trains 2 of 10
    # seeds (their LMs leave the loss plateau late); with job.reproduce --lm_max_iters 7000 (cosine to
    # 6,500) another seed's LM is the late one, and the joint decoders' mean over five seeds is the same
    # (docs/addition.md, The LM's budget over seeds); the seeds' table is this budget's
    lm=dict(n_layer=3, n_head=3, n_embd=96, block_size=66, batch_size=32, max_iters=4500, lr=3e-3,
            min_lr=3e-4, warmup_iters=40, lr_decay_iters=4000, eval_interval=500, patience=0,
            min_rel_delta=0.01, select_on='continuation', snapshots=''),
    # BALM: lr 1e-3 (of 3e-3 and 1e-3 by the selection loss), its cosine over a fixed 7,000 steps: answer loss
    # 0.028 on the selection split (the LM's 0.052), where the stopping rule's 14,000 steps (cosine to 12,000)
    # reached 0.022 in twice the time; 2e-3 over 5,000 stopped at 0.049, the LM's level (docs/addition.md, A
    # faster job). The caps below (RALM's, TaiLr's) let the stopping rule fire: (patience + 1) * eval_interval
    balm=dict(n_head=3, lr=1e-3, min_lr=1e-4, max_iters=7000, lr_decay_iters=7000, patience=0),
    # RALM and TaiLr keep the stopping rule (patience 2), which the base LM's fixed budget gives up
    residual=dict(n_layer=3, n_head=3, n_embd=96, max_iters=8000, lr_decay_iters=4000, patience=2),
    # the recipe (docs/addition.md, chosen on the selection split): 16 LM samples of every training
    # problem, ranking NCE over them, best.pt by the held-out joint gain with log Z from 64 samples;
    # the budget: half of it (4,000 steps, 128,000 problems) made 2.2 minutes less of each energy and
    # cost 5 points of exact match at n = 64 on the selection split (docs/addition.md, The job's budgets)
    neg=dict(prefix_len=14, gen_len=8, num_samples=16, select_samples=64, train_prefixes=None,
             select_prefixes=1024),
    mlm=dict(n_layer=3, n_head=3, n_embd=96, max_iters=2000, lr_decay_iters=2000, eval_interval=500,
             alibi=True, patience=0, min_rel_delta=0, lr=1e-3, select_on='window'),
    tailr=dict(gamma=0.01, max_iters=4000, lr=3e-4, min_lr=3e-4, warmup_iters=0, eval_interval=250,
               patience=2),
    # the energies' 8,000 steps: short at a seed where the energy learns late; with --energy_max_iters 16000
    # (and --lm_max_iters 7000) the mode over beam and samples rose from 0.993 to 0.999 over five seeds, for
    # about twice the energies' time (docs/addition.md, The energies' budget over seeds)
    bit=dict(batch_size=32, max_iters=8000, lr=3e-4, min_lr=3e-5, warmup_iters=50, eval_interval=500,
             eval_prefixes=1024, patience=4, select='gain_enumerated'),
    unit=dict(batch_size=32, max_iters=8000, lr=2e-4, min_lr=2e-5, warmup_iters=50, eval_interval=500,
              eval_prefixes=1024, patience=4, select='gain_enumerated'),
    # log Z's beam: 32, as the accuracy table's below (the width exact Z chose; the Table 1 of
    # assets/results_addition.json, from the run of 2026-11-28, used 8)
    ppl=dict(num_prefixes=512, num_samples=64, beam=32, ns='2,8,32,64', step_prefixes=64, step_samples=32,
             step_every=1, last_step_samples=128, calib_prefixes=8, calib_samples=1024),
    samples=dict(num_prefixes=128, num_samples=64, logz_samples=32, table_prefixes=1, candidate_samples=16),
    # EXO's K (--num_samples) and lr by the selection split's KL(pi_theta || joint) and P(correct): K = 64
    # of 8, 32, 64 (K = 8: lr 1e-5 of 3e-6, 1e-5, 3e-5, 1e-4; the loss dpo as well) (docs/addition.md); 200
    # steps: on the selection split the next 150 bought 5% of its reverse KL (2.07 at 150, 1.97 at 300, 2.04
    # at 400)
    # log Z of its three tables (selection, val, test) from 128 LM samples, not 1,024: 410 s of the stage's
    # 597 were those tables; best.pt is chosen by a KL whose log Z is one constant per prefix (the same
    # choice at any sample count), and val's and test's KL ranges are reported with their width.
    # On its own samples (--on_policy), from BALM (reproduce.exo's --init_from), 600 steps: on the selection
    # splits of five seeds greedy above BALM's at each, by 0.014-0.051, where the recipe above (off-policy,
    # from the LM) stayed below it; its reverse KL keeps falling past 1,000 steps where the LM's samples
    # turn up by 400 (docs/experiments.md, 2026-11-29 evening).
    # Over a set (since 2026-12-01): the KL on the LM's beam of 4 and K = 16 samples of each of 128 prefixes
    # a step, --beam_mass 5 (chosen of 0, 1, 5 at seed 2), lr 3e-5 cosine to 3e-6: selection greedy above
    # the K = 64 recipe's at seven seeds (0.946 against 0.921); its time against K = 64's is not measured on
    # one machine (docs/addition.md, The mass the set does not see; The job's EXO over a set). Its step in the
    # run's --dtype since 2026-12-01 (bf16 on this AMD: 1.6x fp32's step; at its last step the same greedy on
    # the held-out selection problems: docs/addition.md, EXO's step in bf16)
    exo=dict(num_samples=16, batch_size=128, beam=4, beam_mass=5, max_iters=600, lr=3e-5, min_lr=3e-6,
             eval_interval=50, eval_prefixes=256, eval_samples=16, logz_samples=128, forward_samples=64,
             on_policy=True),
    # log Z's known set: the LM's beam of 32, the narrowest of 8, 32, 128 whose log Z (with 64 samples) is
    # within 0.01 nats of the exact one on 95% of replicates where the energy is sharp (N = 3 enumerated,
    # the selection split; docs/exact_logz.md): 8 was within on 63% there
    accuracy=dict(num_prefixes=1000, ns='1,4,16,64', beam=32),
)
ADDITION_QUICK = dict(  # QUICK's tiny models on the same data
    {k: v for k, v in QUICK.items() if k not in ('metrics', 'ordering')}, data=ADDITION['data'],
    lm=dict(QUICK['lm'], block_size=66, max_iters=60, eval_interval=30, snapshots='',
            select_on='continuation'),
    mlm=dict(QUICK['mlm'], select_on='window'),
    neg=dict(prefix_len=14, gen_len=8, num_samples=2, train_prefixes=1600, select_prefixes=64),
    ppl=dict(QUICK['ppl'], step_every=1), samples=dict(QUICK['samples'], candidate_samples=2),
    exo=dict(num_samples=4, batch_size=8, beam=2, beam_mass=5, max_iters=20, lr=1e-4, eval_interval=10,
             eval_prefixes=32, eval_samples=4, logz_samples=64, forward_samples=16, on_policy=True),
    accuracy=dict(num_prefixes=64, ns='1,5,20'),
)


SIZE_FLAGS = ('lm_max_iters', 'energy_max_iters', 'test_problems')  # size_flags' (their dests)


def size_flags(parser, scope):
    """The addition job's sizes as flags (job/reproduce.py's recipe() applies them, job.seeds passes them
    on): --lm_max_iters, the base LM's steps, its cosine ending 500 steps before (as ADDITION's);
    --energy_max_iters, the UNIT's and the BIT's, each cosine to its end; --test_problems, the accuracy
    table's problems. `scope` begins their help."""
    for flag, (whose, default, study) in zip(SIZE_FLAGS[:2], (
            ('the base LM (its cosine ending 500 before)', ADDITION['lm']['max_iters'],
             "The LM's budget over seeds"),
            ('the UNIT and the BIT (each cosine to its end)', ADDITION['bit']['max_iters'],
             "The energies' budget over seeds"))):
        parser.add_argument(f'--{flag}', type=int, default=None, at_least=1000, at_most=10**6,
                            help=f"{scope}: the steps of {whose}; default {default:,} (docs/addition.md, "
                                 f"{study})")
    parser.add_argument('--test_problems', type=int, default=None, at_least=1, at_most=10**6,
                        help=f"{scope}: the accuracy table's test problems; default "
                             f"{ADDITION['accuracy']['num_prefixes']:,}, evenly spaced over the prepared "
                             f"test split; above its size the split is prepared larger for the table "
                             f"alone, into <data_dir>_test<N> (data.addition.prepare --extra_test_problems: "
                             f"the other splits unchanged)")


# job/lesson.py, the first thing `bash run.sh` shows: 4-digit addition (50,000 training problems), small
# enough that an idle 2-core CPU trains the LM and its energy in minutes (docs/reports.md has the measured
# runs). The UNIT's recipe chosen on the selection split (docs/experiments.md, 2026-11-29): ranking NCE
# over 4 of the 16 samples of 128 prefixes a step at lr 1e-3; 32 prefixes a step for 3x the steps, all 16
# samples, lr 2e-3 or 3e-3, binary NCE, no weight decay or a BIT from scratch each left Algorithm 1 at or
# below the LM's greedy sum: too soft an energy to resample with
LESSON = dict(
    data=dict(digits=4, train_problems=50000, select_problems=2000, val_problems=2000, test_problems=2000),
    lm=dict(n_layer=3, n_head=3, n_embd=96, block_size=64, batch_size=32, max_iters=1500, lr=3e-3,
            min_lr=3e-4, warmup_iters=40, lr_decay_iters=1500, eval_interval=250, patience=0,
            select_on='continuation', snapshots='', final_eval=0, print_samples=0),
    neg=dict(prefix_len=10, gen_len=6, num_samples=16, select_samples=64, train_prefixes=20000,
             select_prefixes=256),
    unit=dict(batch_size=128, max_iters=2000, lr=1e-3, min_lr=1e-4, warmup_iters=20, eval_interval=500,
              eval_prefixes=256, patience=0, num_neg=4, select='gain_enumerated'),
    accuracy=dict(num_prefixes=1000, ns='1,4,16,64', beam=0),
)
LESSON_QUICK = dict(  # the same stages with tiny sizes: a test that the lesson runs end to end
    data=dict(digits=4, train_problems=2000, select_problems=200, val_problems=200, test_problems=200),
    lm=dict(LESSON['lm'], n_layer=2, n_head=2, n_embd=32, max_iters=40, eval_interval=20, warmup_iters=5),
    neg=dict(LESSON['neg'], num_samples=4, select_samples=8, train_prefixes=400, select_prefixes=32),
    unit=dict(LESSON['unit'], batch_size=32, max_iters=40, eval_interval=20, eval_prefixes=32,
              warmup_iters=5),
    accuracy=dict(num_prefixes=64, ns='1,8', beam=0),
)


# job.lesson --digits 6: the lesson's five stages with the addition job's own recipe (its problems, LM,
# negatives, UNIT and accuracy table): the method alone at 6 digits, without the job's baselines, BIT and
# EXO (docs/addition.md, "The method alone")
LESSON_ADDITION = {k: ADDITION[k] for k in ('data', 'lm', 'neg', 'unit', 'accuracy')}


def lesson_recipe(quick, digits=4):
    """The lesson's stages and where its problems are prepared (job.lesson; job.seeds --lesson): tiny
    4-digit sizes with --quick, the addition job's own recipe and problems with --digits 6."""
    if quick and digits == 6:
        raise ValueError('--quick runs tiny 4-digit sizes: drop --quick, or --digits 6')
    if quick:
        return LESSON_QUICK, 'data/lesson_quick'
    return (LESSON_ADDITION, 'data/addition') if digits == 6 else (LESSON, 'data/lesson')


def large_batch(cfg, scale=4, step_share=0.5, trainers=('bit', 'unit'), chunk=4096):
    """--recipe gpu (docs/addition.md, "On a GPU"): a step of these models costs a GPU about the same
    at 32 sequences as at 128 (kernel launches and Python, not arithmetic), so each of `trainers`
    takes `scale` x the batch for `step_share` of the steps, its evaluations, warm-up and decay as
    many; the negatives are sampled `chunk` prefixes per call. Chosen on the selection split: a 4x
    batch for a quarter of the steps (the same tokens) left the BIT's held-out gain at 0.044 nats
    (0.052 with the CPU's recipe) and the base LM's answer loss at 0.072 (0.052): the energies take
    half the steps (twice the tokens), and the LMs keep the CPU's recipe. A recipe of its own."""
    steps = ('max_iters', 'lr_decay_iters', 'eval_interval', 'warmup_iters')

    def scaled(d):
        d = dict(d, **{k: max(1, round(v * step_share)) if v else 0 for k, v in d.items() if k in steps})
        return dict(d, batch_size=d['batch_size'] * scale)
    return dict(cfg, **{k: scaled(cfg[k]) for k in trainers}, neg=dict(cfg['neg'], chunk=chunk))


# Stage times of the default run (--jobs 1) relative to the LM's, from its idle run (2026-11-28, bf16
# CPU, docs/reports.md): the LM stage measures this machine's speed, these turn it into a rough
# estimate of the whole run (on a CPU without bf16, sampling is relatively faster: an overestimate).
RELATIVE_TIME = dict(lm=1.0, balm=0.91, ralm=0.19, neg_train=0.14, neg_select=0.01, mlm=0.53, bit=0.23,
                     unit=0.27, tailr=0.11, metrics=0.4, estimate_ppl=0.66, samples=0.14,
                     samples_untruncated=0.14, claims=0.013)


# What --jobs N schedules by (job/pipeline.py: among the stages ready to start, the longest chain of
# these first): each stage's seconds in a measured run of the job (the relative times for Shakespeare;
# addition's: seed 1337, idle, bf16, one thread a stage but the wide EXO's two, the Intel Xeon of
# docs/addition.md's "The job's EXO on both cores"). Only their order matters.
STAGE_SECONDS = dict(
    shakespeare=RELATIVE_TIME,
    addition=dict(prepare=4, lm=307, balm=770, mlm=136, neg_train=540, neg_select=11, bit=504, unit=502,
                  exo=724, ralm=144, tailr=112, estimate_ppl=99, samples=7, samples_untruncated=7,
                  addition_eval=128, claims=2, figures=3),
)

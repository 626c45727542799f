"""The settings the main job's flags choose (job.reproduce's recipe(): --recipe gpu, the addition job's
--lm_max_iters, --energy_max_iters and --test_problems, job.seeds passing them on) and the prepared data
it reuses only when made as it asks.
"""

import json
import os

import pytest


def test_gpu_recipe_larger_batches_fewer_steps():
    """--recipe gpu (job.configs.large_batch): the energies 4x the batch for half the steps, their
    evaluations, warm-up and decay as many; the negatives in larger chunks; nothing else changes.
    Only with --data addition, into its own folder."""
    from job import reproduce
    from job.configs import ADDITION, large_batch
    gpu = large_batch(ADDITION)
    for name in ('bit', 'unit'):
        old, new = ADDITION[name], gpu[name]
        assert set(old) == set(new) and new['batch_size'] == 4 * old['batch_size'], name
        for k in ('max_iters', 'lr_decay_iters', 'eval_interval', 'warmup_iters'):
            if k in old:
                assert abs(new[k] - old[k] / 2) <= 0.5 and new[k] > 0, (name, k)
        assert {k: v for k, v in new.items() if k not in ('batch_size', 'max_iters', 'lr_decay_iters',
                                                           'eval_interval', 'warmup_iters')} == \
            {k: v for k, v in old.items() if k not in ('batch_size', 'max_iters', 'lr_decay_iters',
                                                        'eval_interval', 'warmup_iters')}
    assert gpu['neg'] == dict(ADDITION['neg'], chunk=4096)
    assert {k: v for k, v in gpu.items() if k not in ('bit', 'unit', 'neg')} == \
        {k: v for k, v in ADDITION.items() if k not in ('bit', 'unit', 'neg')}
    args = reproduce.get_args(['--data', 'addition', '--recipe', 'gpu'])
    assert args.cfg == gpu and args.out_dir == 'out-addition-gpu'
    assert reproduce.get_args(['--data', 'addition']).cfg is ADDITION
    with pytest.raises(ValueError, match=r"--recipe gpu is the addition job's .*: add --data addition"):
        reproduce.get_args(['--recipe', 'gpu'])


def test_main_jobs_base_lm_trains_the_rules_step():
    """The main job's base LM trains a fixed budget (patience 0): the step at which the stopping rule
    stopped it in the run of assets/claims.json (an evaluation step); BALM, RALM and TaiLr keep the
    rule (job.configs.RULE), each with room for it to fire."""
    from job.configs import DEFAULT, RULE
    from tests.common import asset
    lm, base = DEFAULT['lm'], asset('claims.json')['lms']['BASE']
    assert lm['patience'] == 0 and lm['max_iters'] == base['last_step'] == base['best_step']
    assert lm['max_iters'] % lm['eval_interval'] == 0 and lm['lr_decay_iters'] < lm['max_iters']
    for name in ('balm', 'residual', 'tailr'):
        cfg = dict(lm, **DEFAULT[name])
        assert (cfg['patience'], cfg['min_rel_delta']) == (RULE['patience'], RULE['min_rel_delta']), name
        assert cfg['max_iters'] >= (cfg['patience'] + 1) * cfg['eval_interval'], name


def test_lm_max_iters_sets_the_base_lms_budget():
    """--lm_max_iters N (--data addition): the base LM's max_iters N, its cosine to N - 500 (the
    recipe's 4,500 / 4,000), every other flag and model as the recipe's, its own default folder; the
    seeds' command passes it to each job. Refused without --data addition."""
    from job import reproduce, seeds
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--lm_max_iters', '7000'])
    assert args.cfg['lm'] == dict(ADDITION['lm'], max_iters=7000, lr_decay_iters=6500)
    rest = lambda cfg: {k: v for k, v in cfg.items() if k != 'lm'}
    assert rest(args.cfg) == rest(ADDITION)
    assert ADDITION['lm']['max_iters'] - ADDITION['lm']['lr_decay_iters'] == 500  # the default's gap
    assert args.out_dir == 'out-addition-lm7000'
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--lm_max_iters', '7000']), 2, 'r/seed2')
    assert cmd[cmd.index('--lm_max_iters') + 1] == '7000'
    assert reproduce.get_args(cmd[3:]).cfg == args.cfg
    assert '--lm_max_iters' not in seeds.seed_command(seeds.get_args(['--seeds', '1,2']), 2, 'r/seed2')
    with pytest.raises(ValueError, match=r"--lm_max_iters is the addition job's .*: add --data addition"):
        reproduce.get_args(['--lm_max_iters', '7000'])


def test_energy_max_iters_sets_the_energies_budget():
    """--energy_max_iters N (--data addition): the UNIT's and the BIT's max_iters N (their cosine to the
    end, as the recipe's), nothing else changed, its own default folder (with --lm_max_iters too); the
    seeds' command passes both budgets to each job. Refused without --data addition."""
    from job import reproduce, seeds
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--energy_max_iters', '16000'])
    for e in ('unit', 'bit'):
        assert args.cfg[e] == dict(ADDITION[e], max_iters=16000) and 'lr_decay_iters' not in ADDITION[e]
    rest = lambda cfg: {k: v for k, v in cfg.items() if k not in ('unit', 'bit')}
    assert rest(args.cfg) == rest(ADDITION) and args.out_dir == 'out-addition-e16000'
    both = ['--lm_max_iters', '7000', '--energy_max_iters', '16000']
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2'] + both), 2, 'r/seed2')
    assert cmd[-4:] == both
    args = reproduce.get_args(cmd[3:])
    assert args.cfg['lm']['max_iters'] == 7000 and args.cfg['bit']['max_iters'] == 16000
    assert reproduce.get_args(['--data', 'addition'] + both).out_dir == 'out-addition-lm7000-e16000'
    with pytest.raises(ValueError, match=r"--energy_max_iters is the addition job's .*: add --data addition"):
        reproduce.get_args(['--energy_max_iters', '16000'])


def test_test_problems_sets_the_accuracy_tables_problems(tmp_path):
    """--test_problems N (--data addition): the accuracy table's num_prefixes N, nothing else changed, its
    own default folder; the seeds' command passes it on. Above the prepared test split, a stage prepares
    the data again with the extra test problems (--extra_test_problems) into <data_dir>_test<N>, which
    only the accuracy table reads: every other split byte for byte the job's, the first test problems
    too. At or below it, no stage and no flag. Refused without --data addition."""
    from data.addition import prepare
    from job import reproduce, seeds, stages
    from job.configs import ADDITION
    args = reproduce.get_args(['--data', 'addition', '--test_problems', '10000'])
    assert args.cfg['accuracy'] == dict(ADDITION['accuracy'], num_prefixes=10000)
    rest = lambda cfg: {k: v for k, v in cfg.items() if k != 'accuracy'}
    assert rest(args.cfg) == rest(ADDITION) and args.out_dir == 'out-addition-test10000'
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--test_problems', '10000']), 2, 'r/seed2')
    assert cmd[-2:] == ['--test_problems', '10000'] and reproduce.get_args(cmd[3:]).cfg == args.cfg
    with pytest.raises(ValueError, match=r"--test_problems is the addition job's .*: add --data addition"):
        reproduce.get_args(['--test_problems', '10000'])
    data = tmp_path / 'addition'
    sizes = dict(digits=3, train_problems=40, select_problems=10, val_problems=10, test_problems=10)
    prepare.main(['--out_dir', str(data), '--seed', '1337', '--quiet', *stages.flags(sizes)])

    class Pipe:  # records the stages declared
        runs = []

        def run(self, name, cmd, done, deps=()):
            self.runs.append((name, cmd, done))
    for n, want in ((10, ([], [])), (25, (['--data_dir', f'{data}_test25'], ['prepare_test']))):
        args = reproduce.get_args(['--data', 'addition', '--data_dir', str(data), '--test_problems', str(n)])
        args.cfg = dict(args.cfg, data=sizes)
        assert reproduce.accuracy_data(Pipe(), args) == want
    (name, cmd, done), = Pipe.runs
    assert name == 'prepare_test' and done == os.path.join(f'{data}_test25', 'meta.json')
    assert cmd[:2] == ['-m', 'data.addition.prepare'] and cmd[-2:] == ['--extra_test_problems', '15']
    prepare.main(cmd[2:])
    more = tmp_path / 'addition_test25'
    for split in ('train', 'select', 'val'):
        assert (more / f'{split}.bin').read_bytes() == (data / f'{split}.bin').read_bytes()
    assert (more / 'test.bin').read_bytes().startswith((data / 'test.bin').read_bytes())
    assert json.load(open(more / 'meta.json'))['num_docs']['test'] == 25


def test_data_of_other_flags_is_not_reused(tmp_path):
    """Issue 57, item 4: prepared data records its flags and seed (meta.json's made_with); the job
    asking for another --data_seed or other sizes is refused before its first stage, in one line
    naming the flag and the fix (it said "[prepare] done already" and trained on seed 1337's
    problems). A meta.json from before the record counts as made by the job's defaults."""
    from data.addition import prepare
    from job import reproduce, stages
    data = tmp_path / 'addition'
    sizes = dict(digits=6, train_problems=40, select_problems=10, val_problems=10, test_problems=10)
    prepare.main(['--out_dir', str(data), '--seed', '1337', '--quiet', *stages.flags(sizes)])

    def check(*argv, cfg_data=sizes):
        args = reproduce.get_args(['--data', 'addition', '--quick', '--data_dir', str(data), *argv])
        args.cfg = dict(args.cfg, data=cfg_data)
        reproduce.check_data_dir(args)
    check()
    check('--data_seed', '1337')
    for seed in ('5', '9'):
        with pytest.raises(ValueError, match=rf"--data_dir {data} was prepared with --seed 1337 \(its "
                                             rf"meta.json\), not the --data_seed {seed} this job asks for: "
                                             rf"pass --data_seed 1337 to use it, or a new --data_dir"):
            check('--data_seed', seed)
    with pytest.raises(ValueError, match=r"was prepared with --train_problems 40 \(its meta.json\), not the "
                                         r"--train_problems 200000 this job asks for: pass a new --data_dir"):
        check(cfg_data=dict(digits=6))  # the job's own sizes: 200,000 training problems
    meta = json.load(open(data / 'meta.json'))
    del meta['made_with']  # prepared before the record
    (data / 'meta.json').write_text(json.dumps(meta))
    check()
    with pytest.raises(ValueError, match=r"was prepared with --seed 1337 .*not the --data_seed 5"):
        check('--data_seed', '5')


def test_a_stopped_exo_stage_resumes(tmp_path, monkeypatch):
    """The job's EXO stage continues a stopped run's ckpt.pt with --resume (exo.py resumes exactly:
    test_exo_runs) and starts a new one with --force; its folder is the stage's, so that one made
    from something else is kept aside by the scheduler, which drops the --resume. It is declared wide
    (alone, on every core: the last long stage of the job's critical path), and takes the job's --dtype
    (its training step under autocast)."""
    from job import reproduce
    monkeypatch.setattr(reproduce, 'stronger_energy', lambda path: 'bit')
    declared = {}

    def script(name, cmd, done, deps, folder=None, wide=False, dtype=False):
        declared.update(name=name, cmd=cmd, folder=folder, wide=wide, dtype=dtype)
    path = lambda *a: str(tmp_path.joinpath(*a))
    reproduce.exo(script, path, 'lm.pt', dict(prefix_len=14, gen_len=8), dict(exo=dict(max_iters=600)))
    assert declared['name'] == 'exo' and declared['folder'] == path('exo')
    assert declared['wide'] and declared['dtype']
    assert declared['cmd']()[-3:] == ['--max_iters', '600', '--force']
    os.makedirs(path('exo'))
    open(path('exo', 'ckpt.pt'), 'wb').close()
    assert declared['cmd']()[-3:] == ['--max_iters', '600', '--resume']

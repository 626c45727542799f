"""
The stage commands the jobs share (job/reproduce.py, the main job, and job/lesson.py, its lesson): a
config dict as flags, the data's preparation and its check against prepared data, NCE's negatives,
and the energy's NCE training, each the command a user would type, run by job/pipeline.py.
"""

import os

from job.pipeline import flag_values


def flags(d):
    """{'lr': 1e-3, 'alibi': True} -> ['--lr', '0.001', '--alibi']"""
    return [f for k, v in d.items() if v is not False
            for f in ((f'--{k}',) if v is True else (f'--{k}', str(v)))]


def device_flags(args):
    """--device, and --deterministic if given: what every stage takes."""
    return ['--device', args.device] + ['--deterministic'] * args.deterministic


def prepare_command(args, data_seed=None, out_dir=None):
    """The preparation this job asks for: the prepare.py command (its --seed: --data_seed), into out_dir
    (default: --data_dir)."""
    return (['-m', f'data.{args.data}.prepare', '--out_dir', out_dir or args.data_dir]
            + (flags(args.cfg['data']) if 'data' in args.cfg else ['--tokenizer', args.tokenizer])
            + ['--seed', str(args.data_seed if data_seed is None else data_seed)]
            + (['--quiet'] if args.quiet else []))


DATA_SEED = 1337  # --data_seed's default: what prepared data without a record was made with


def check_made_with(args, meta):
    """Prepared data is reused only when made as this job would make it: meta.json's made_with
    (data.made_with: the preparation's flags and their defaults) against prepare_command; one line
    naming the flag and the fix otherwise. A meta.json from before the record is taken as made by
    the job's defaults (--data_seed 1337, the config's sizes; Shakespeare's split ignores the seed)."""
    rec, source = meta.get('made_with'), 'its meta.json'
    if rec is None:
        if args.data != 'addition':
            return
        rec = dict(corpus='addition', flags=dict(seed=DATA_SEED), defaults={})
        source = "the default: its meta.json predates the record"
    if not (isinstance(rec, dict) and isinstance(rec.get('flags'), dict)
            and isinstance(rec.get('defaults'), dict)):
        raise ValueError(f"{os.path.join(args.data_dir, 'meta.json')}: made_with is not a record of flags; "
                         f"delete {args.data_dir} to prepare it again")
    if rec.get('corpus') != args.data:  # your own text (data/text/prepare.py): used as it is
        return
    given = flag_values(prepare_command(args))
    for k, made in rec['flags'].items():
        ask = given.get(f'--{k}', rec['defaults'].get(k, made))
        if not same_flag(made, ask):
            job_flag = '--data_seed' if k == 'seed' else f'--{k}'
            fix = (f"pass --data_seed {made} to use it, or a new --data_dir (e.g. {args.data_dir}_seed{ask}) "
                   f"to prepare seed {ask} there" if k == 'seed' else
                   f"pass a new --data_dir to prepare this job's data there, or delete {args.data_dir}")
            raise ValueError(f"--data_dir {args.data_dir} was prepared with --{k} {made} ({source}), "
                             f"not the {job_flag} {ask} this job asks for: {fix}")


def same_flag(made, ask):
    """A recorded flag value (typed, from JSON) and the job's (a command-line string, or a default)."""
    if isinstance(ask, str) and not isinstance(made, str):
        if isinstance(made, bool):
            return made == (ask == '(set)')
        try:
            return made == type(made)(ask) if made is not None else ask == 'None'
        except (TypeError, ValueError):
            return False
    return made == ask


def negatives(stage, path, lm_ckpt, neg, name, train_prefixes, select_prefixes, deps):
    """K LM samples per prefix of the train split (NCE's negatives) and of the selection split
    (the held-out prefixes that choose the energy's best.pt, their log Z from select_samples of
    them where given: more samples, a tighter Eq. 4); a count of None: every prefix of the split."""
    for split, count in (('train', train_prefixes), ('select', select_prefixes)):
        K = neg.get('select_samples', neg['num_samples']) if split == 'select' else neg['num_samples']
        stage(f'{name}_{split}', ['negatives.py', '--lm', lm_ckpt, '--split', split,
                                  '--out_dir', path(f'{name}_{split}')]
              + flags({k: v for k, v in dict(num_prefixes=count, num_samples=K, prefix_len=neg['prefix_len'],
                                             gen_len=neg['gen_len'], chunk=neg.get('chunk')).items()
                       if v is not None}),
              path(f'{name}_{split}', 'meta.json'), deps, path(f'{name}_{split}'))


def nce(stage, path, kind, lm_ckpt, neg, init, settings, deps, out_name=None):
    """Conditional NCE (Eq. 3) of a BIT or UNIT energy on the negatives `neg`_train, best.pt
    chosen on `neg`_select."""
    out_name = out_name or kind
    resume = ['--resume'] if os.path.exists(path(out_name, 'ckpt.pt')) else []
    stage(out_name, ['nce_train.py', '--lm', lm_ckpt, '--negatives', path(f'{neg}_train'),
                     '--held_out_negatives', path(f'{neg}_select'), '--body', kind, '--init_from', init,
                     '--out_dir', path(out_name)] + flags(settings) + resume,
          path(out_name, 'results.json'), [f'{neg}_train', f'{neg}_select'] + deps, path(out_name))

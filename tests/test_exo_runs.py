"""exo.py's runs on the addition task (tests/conftest.py's addition_run): an LM every script loads, on-policy
from a bigger LM, resume, precision, and the bad input of addition_eval.py and exo.py. EXO's objective
against exact enumeration: test_exo.py.
"""

import json
import math
import os
import shutil

import pytest
import torch

import estimate_ppl
import train_lm
from model import load_checkpoint, load_lm
from plumbing import choose_dtype, save_checkpoint
from extensions import addition_eval, exo
from data.addition import prepare as addition_prepare
from tests.common import TRAIN_FLAGS, UNWRITABLE


def test_addition_and_exo_bad_input(addition_run, lm_ckpt, tmp_path):
    """Bad flags and a corpus that holds no problems stop the new scripts with one clear message."""
    d, lm_path = addition_run
    cases = [(addition_prepare.main, ['--digits', '0', '--out_dir', str(tmp_path / 'a')], '--digits 0'),
             (addition_prepare.main, ['--chain', '2', '--out_dir', str(tmp_path / 'a')],
              '--chain 2.0: must be at most 1'),
             (addition_eval.main, ['--lm', lm_path, '--ns', '1,x', '--out', str(tmp_path / 'e.json')],
              'comma-separated'),
             (addition_eval.main, ['--lm', lm_ckpt, '--out', str(tmp_path / 'e.json')],
              'fixed-length problems'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--num_samples', '1'], '--num_samples 1'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--beta_r', '0'], '--beta_r 0.0: must be above 0'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--logz_samples', '8', '--forward_samples', '9'], 'at most --logz_samples 8'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--beam_mass', '5'], '--beam_mass 5.0 needs a beam: give --beam W too'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--num_samples', '1000000'], 'at most 65,536'),
             # issue 40, items 1 and 7: sizes without a bound, --plot checked before --out is written
             (addition_prepare.main, ['--train_problems', '1000000000', '--out_dir', str(tmp_path / 'a')],
              r'drawing 1,000,015,000 problems \(--train_problems, --select_problems, ...\) needs .* GiB'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--plot', f'{UNWRITABLE}/a.png'],
              f'--plot {UNWRITABLE}/a.png: cannot write'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--plot', str(tmp_path)],
              f'--plot {tmp_path} is a folder'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'),
                                   '--extra_lm', f'X={lm_path}', f'X={lm_ckpt}'],
              '--extra_lm: the name X is given twice'),
             (addition_eval.main, ['--lm', lm_path, '--out', str(tmp_path / 'e.json'), '--ns', '1,100000000'],
              '--ns 100000000: must be at most 65,536'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--prefix_len', '8', '--gen_len', '5', '--batch_size', '100000000'],
              'a step of --batch_size 100000000 x --num_samples 8 samples needs'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--resume'], '--resume: .*ckpt.pt does not exist'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--resume', '--force'], '--resume and --force contradict'),
             # issue 40: windows that cut across the 13-token problems of 3 digits
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                         '--prefix_len', '10', '--gen_len', '5'],
              '--prefix_len 10 --gen_len 5 do not fit .* 13 tokens: pass --prefix_len 8 --gen_len 5'),
             (exo.main, ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x')],
              '--prefix_len 128 --gen_len 64 do not fit')]
    for main, argv, match in cases:
        with pytest.raises(ValueError, match=match):
            main(argv)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # not --out, not a folder of --out_dir



def test_exo_cli_writes_an_lm_that_every_script_loads(addition_run, tmp_path):
    """exo.py: best.pt is an LM checkpoint (load_lm), chosen on the selection split, whose exact
    PPL estimate_ppl.py reports beside the base LM's."""
    d, lm_path = addition_run
    out = tmp_path / 'exo'
    exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--prefix_len', '8', '--gen_len', '5',
              '--out_dir', str(out), '--num_samples', '4', '--batch_size', '4', '--max_iters', '4',
              '--eval_interval', '2',
              '--eval_prefixes', '8', '--eval_samples', '4', '--logz_samples', '32', '--forward_samples', '8',
              '--lr', '1e-2', '--quiet'])
    res = json.loads((out / 'results.json').read_text())
    assert [c['iter'] for c in res['curve']] == [0, 2, 4]
    assert res['selected_by'] == 'kl_reverse_high'
    assert (res['logz_samples'], res['forward_samples']) == (32, 8)
    assert res['best']['select_kl_reverse_high'] == min(c['select_kl_reverse_high'] for c in res['curve'])
    assert res['curve'][0]['select_kl_to_base'] == 0  # pi_theta starts as the LM
    curve = [{k.removeprefix('select_'): v for k, v in c.items()} for c in res['curve']]
    for kl in curve + [*res['final'].values()]:  # both KLs to the joint model, each a range
        assert kl['kl_reverse_low'] <= kl['kl_reverse_high'] and kl['kl_forward_low'] <= kl['kl_forward_high']
    load_lm(str(out / 'best.pt'))
    kept = (out / 'best.pt').read_bytes()
    # not replaced
    with pytest.raises(ValueError, match='ckpt.pt exists: pass --resume to continue it, --force'):
        exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(out)])
    (out / 'results.json').unlink()  # best.pt without ckpt.pt or results: refused too, kept as it was
    (out / 'ckpt.pt').unlink()
    with pytest.raises(ValueError, match='best.pt already exist.*pass --force'):
        exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(out)])
    assert (out / 'best.pt').read_bytes() == kept
    hint = exo.resume_hint(['--lm', lm_path, '--energy', 'e', '--out_dir', str(out)])
    assert 'holds the best policy so far, but there is no' in hint and hint.endswith('--force')
    estimate_ppl.main(['--lm', lm_path, '--extra_lm', f"EXO={out / 'best.pt'}", '--split', 'test',
                       '--prefix_len', '8', '--gen_len', '5', '--num_prefixes', '4', '--num_samples', '4',
                       '--calib_prefixes', '0', '--quiet', '--out', str(tmp_path / 'ppl.json')])
    rows = json.loads((tmp_path / 'ppl.json').read_text())['rows']
    assert {'BASE LM', 'EXO'} <= {r['model'] for r in rows}
    with pytest.raises(ValueError, match='unknown loss'):
        exo.exo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), loss='kl')



def test_exo_on_policy_from_a_bigger_lm(addition_run, tmp_path):
    """--init_from: pi_theta starts as another LM of the data (BALM's place: here a wider one), so
    best.pt has that LM's shape and its KL to the base LM is not 0 at step 0; --on_policy trains it
    from its own samples, best.pt chosen by --select greedy_exact; a RALM as --init_from is refused in
    one line, before anything is written."""
    d, lm_path = addition_run
    wide = list(TRAIN_FLAGS)
    wide[wide.index('--n_embd') + 1] = '48'
    train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(tmp_path / 'wide'), '--max_iters', '10',
                   '--eval_interval', '10', '--final_eval', '0', '--lr', '3e-3', *wide])
    out, wide_lm = tmp_path / 'exo', str(tmp_path / 'wide' / 'best.pt')
    exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--init_from', wide_lm, '--on_policy',
              '--prefix_len', '8', '--gen_len', '5', '--out_dir', str(out), '--num_samples', '4',
              '--batch_size', '4', '--max_iters', '2', '--eval_interval', '2', '--eval_prefixes', '8',
              '--eval_samples', '4', '--logz_samples', '16', '--forward_samples', '8', '--quiet',
              '--select', 'greedy_exact'])
    res = json.loads((out / 'results.json').read_text())
    assert res['curve'][0]['select_kl_to_base'] > 0 and res['args']['on_policy']
    order = lambda c: (-c['select_greedy_exact'], c['select_kl_reverse_high'])  # --select greedy_exact
    assert res['selected_by'] == 'greedy_exact' and res['best'] == min(res['curve'], key=order)
    assert all(0 <= r['greedy_exact'] <= 1 for r in res['final'].values())
    assert load_lm(str(out / 'best.pt'))[0].config.n_embd == 48
    best = torch.load(out / 'best.pt', weights_only=True)  # EXO's record, not the wide LM's training's
    assert best['exo']['init_from'] == wide_lm and not {'args', 'best'} & set(best)
    train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(tmp_path / 'ralm'), '--max_iters', '2',
                   '--eval_interval', '2', '--final_eval', '0', '--residual_of', lm_path, *TRAIN_FLAGS])
    with pytest.raises(ValueError, match=r'--init_from .*ralm/best.pt is a RALM: EXO fine-tunes a plain'):
        exo.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--out_dir', str(tmp_path / 'x'),
                  '--init_from', str(tmp_path / 'ralm' / 'best.pt'), '--prefix_len', '8', '--gen_len', '5'])
    assert not (tmp_path / 'x').exists()



def test_exo_resume_checks_what_it_resumes(addition_run, tmp_path):
    """exo.py --resume by content (issue 48, item 2): a ckpt.pt of the wrong kind (an LM's, an EXO
    best.pt), another run's ckpt.pt beside this run's best.pt, and an --energy replaced at the same
    path are each one line, before any step."""
    d, lm_path = addition_run
    energy = str(tmp_path / 'energy.pt')
    shutil.copy(d / 'bit.pt', energy)
    flags = ['--lm', lm_path, '--energy', energy, '--prefix_len', '8', '--gen_len', '5', '--num_samples', '4',
             '--batch_size', '4', '--eval_interval', '2', '--eval_prefixes', '8', '--eval_samples', '4',
             '--logz_samples', '32', '--forward_samples', '8', '--max_iters', '2', '--quiet']
    run, other = tmp_path / 'run', tmp_path / 'other'
    exo.main([*flags, '--out_dir', str(run)])
    exo.main([*flags, '--out_dir', str(other), '--lr', '0.1'])
    mine = (run / 'ckpt.pt').read_bytes()
    wrong = [(lm_path, r'ckpt.pt is not an EXO checkpoint \(a train_lm.py or nce_train.py one\?\): '
                       r'it lacks exo, optimizer'),
             (run / 'best.pt', r'ckpt.pt is an EXO best.pt \(the policy alone\): it lacks optimizer'),
             (other / 'ckpt.pt', r'best.pt is not the best policy of the run .*ckpt.pt holds')]
    for ckpt, match in wrong:
        shutil.copy(ckpt, run / 'ckpt.pt')
        with pytest.raises(ValueError, match=match):
            exo.main([*flags, '--out_dir', str(run), '--resume', '--max_iters', '4'])
    (run / 'ckpt.pt').write_bytes(mine)
    shutil.copy(d / 'zero.pt', energy)
    with pytest.raises(ValueError, match=r'--energy .*energy.pt is not the energy .*ckpt.pt trained from'):
        exo.main([*flags, '--out_dir', str(run), '--resume', '--max_iters', '4'])



def test_exo_resume_is_exact_and_divergence_keeps_best(addition_run, tmp_path):
    """exo.py --resume (issue 40, item 1): 2 iterations, then resumed to 4, gives the weights, the
    curve and the results of 4 in one go, on --lr's cosine decay to --min_lr at --lr_decay_iters (the
    last step's rate is the formula's), over a set with --beam_mass; a flag that would change the run
    is refused (--lr, --beam_mass), --max_iters left out is the checkpoint's; the Ctrl-C hint gives
    the command. --lr 1e30 stops with one line at the first non-finite loss, best.pt (iteration 0:
    the LM itself) intact."""
    d, lm_path = addition_run
    flags = ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--prefix_len', '8', '--gen_len', '5',
             '--num_samples', '4', '--batch_size', '4', '--eval_interval', '2', '--eval_prefixes', '8',
             '--eval_samples', '4', '--logz_samples', '32', '--forward_samples', '8', '--lr', '1e-2',
             '--min_lr', '1e-3', '--lr_decay_iters', '4', '--beam', '2', '--beam_mass', '1', '--quiet']
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    exo.main([*flags, '--out_dir', one, '--max_iters', '4'])
    exo.main([*flags, '--out_dir', two, '--max_iters', '2'])
    hint = exo.resume_hint([*flags, '--out_dir', two, '--max_iters', '4'])
    assert f'{two}/ckpt.pt holds iteration 2 of 4' in hint and hint.endswith('--resume')
    for bad, match in ((['--lr', '0.5'], '--lr 0.5 contradicts .*ckpt.pt'),
                       (['--beam_mass', '2'], '--beam_mass 2.0 contradicts .*ckpt.pt'),
                       (['--max_iters', '1'], '--max_iters 1 is below the 2 iterations')):
        with pytest.raises(ValueError, match=match):
            exo.main([*flags, '--out_dir', two, '--resume', *bad])
    exo.main([*flags, '--out_dir', two, '--max_iters', '4', '--resume'])
    a, b = (load_checkpoint(os.path.join(p, 'ckpt.pt')) for p in (one, two))
    assert a['iter_num'] == b['iter_num'] == 4
    last_lr = 1e-3 + 0.5 * (1 + math.cos(math.pi * 3 / 4)) * (1e-2 - 1e-3)  # the step at iteration 3
    assert abs(b['optimizer']['param_groups'][0]['lr'] - last_lr) < 1e-12
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    ra, rb = (json.loads(open(os.path.join(p, 'results.json')).read()) for p in (one, two))
    assert ra['curve'] == rb['curve'] and ra['final'] == rb['final'] and ra['best'] == rb['best']
    exo.main([*flags, '--out_dir', two, '--resume'])  # --max_iters left out: the checkpoint's 4, no step more
    assert load_checkpoint(os.path.join(two, 'ckpt.pt'))['iter_num'] == 4
    far = str(tmp_path / 'far')
    with pytest.raises(ValueError, match=r'the policy diverged at iteration 1 \(its loss nan.*lower --lr .*'
                                         r'best.pt \(iteration 0\) is intact'):
        exo.main([*flags, '--out_dir', far, '--max_iters', '4', '--lr', '1e30'])
    best, lm = load_checkpoint(os.path.join(far, 'best.pt')), load_checkpoint(lm_path)
    assert best['iter_num'] == 0 and all(torch.equal(best['model'][k], lm['model'][k]) for k in lm['model'])



def test_exo_precision_is_decided_once_and_kept(addition_run, tmp_path):
    """exo.py --dtype: the training step under autocast, the precision recorded with the flags ('auto'
    as the hardware decides it); a --resume continues in it (a contradicting --dtype refused), exactly as
    the run in one go, fp16's GradScaler state travelling in ckpt.pt; a ckpt.pt from before --dtype
    resumes in float32; the evaluations stay in float32 (step 0's, of the same policy, equal to a
    float32 run's). fp16 (emulated on a CPU) stands for any autocast precision."""
    d, lm_path = addition_run
    flags = ['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--prefix_len', '8', '--gen_len', '5',
             '--num_samples', '4', '--batch_size', '4', '--eval_interval', '2', '--eval_prefixes', '8',
             '--eval_samples', '4', '--logz_samples', '16', '--forward_samples', '8', '--lr', '1e-2',
             '--beam', '2', '--quiet']
    one, two, half = (str(tmp_path / n) for n in ('one', 'two', 'half'))
    exo.main([*flags, '--out_dir', one, '--max_iters', '4', '--dtype', 'float16'])
    exo.main([*flags, '--out_dir', two, '--max_iters', '2', '--dtype', 'float16'])
    with pytest.raises(ValueError, match=r'--dtype float32 contradicts .*ckpt.pt \(trained in float16\)'):
        exo.main([*flags, '--out_dir', two, '--max_iters', '4', '--resume', '--dtype', 'float32'])
    exo.main([*flags, '--out_dir', two, '--max_iters', '4', '--resume'])
    ra, rb = (json.loads(open(os.path.join(p, 'results.json')).read()) for p in (one, two))
    assert ra['args']['dtype'] == rb['args']['dtype'] == 'float16'
    assert ra['curve'] == rb['curve'] and ra['curve'][0]['select_kl_to_base'] == 0
    a, b = (load_checkpoint(os.path.join(p, 'ckpt.pt')) for p in (one, two))
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    assert a['scaler'] == b['scaler'] and a['scaler']['scale'] > 0
    exo.main([*flags, '--out_dir', half, '--max_iters', '4', '--dtype', 'float32'])
    fp32 = load_checkpoint(os.path.join(half, 'ckpt.pt'))['model']
    assert not torch.equal(a['model']['lm_head.weight'], fp32['lm_head.weight'])  # fp16 took the steps
    step0 = json.loads(open(os.path.join(half, 'results.json')).read())['curve'][0]
    assert ra['curve'][0] == step0  # the same policy evaluated: in float32 both
    exo.main([*flags, '--out_dir', half, '--max_iters', '2', '--force'])  # --dtype auto
    ckpt = load_checkpoint(os.path.join(half, 'ckpt.pt'))
    assert ckpt['exo']['dtype'] == choose_dtype('cpu')[0]
    del ckpt['exo']['dtype'], ckpt['scaler']  # as saved before --dtype: a float32 run
    save_checkpoint(ckpt, os.path.join(half, 'ckpt.pt'))
    exo.main([*flags, '--out_dir', half, '--max_iters', '4', '--resume'])
    assert json.loads(open(os.path.join(half, 'results.json')).read())['args']['dtype'] == 'float32'


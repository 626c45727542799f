"""extensions/exact_logz.py and extensions/enumeration.py: the enumeration against brute force
on a tiny vocabulary, the replicate sampler against P_LM, estimate_fast against
energy.logz_enumerate, a sharp energy where Eq. 4 at n = 8 is far off and logz_enumerate is not,
MIN_ESS's rule, and the job's estimator by beam width.
"""

import itertools
import math
import statistics

import numpy as np
import torch

from energy import logz_bounds, logz_enumerate
from extensions import enumeration, exact_logz
from tests.common import NULL, rand_energy, tiny_gpt

V, P, L = 4, 2, 3


def brute(lm, energy, prompts):
    """log P_LM and E (B, V^L) of every continuation, one full sequence at a time, in
    itertools.product's order."""
    cont = torch.tensor(list(itertools.product(range(V), repeat=L)))
    lp, E = [], []
    with torch.no_grad():
        for p in prompts:
            x = torch.cat([p.expand(len(cont), -1), cont], 1)
            lp.append(lm.sequence_logprob(x, P).double())
            E.append(energy(x, P).double())
    return cont, torch.stack(lp), torch.stack(E)


def test_enumeration_matches_brute_force():
    lm, energy = tiny_gpt(vocab_size=V, block_size=8, std=0.5), rand_energy(V, causal=True)
    prompts = torch.tensor([[0, 1], [3, 2], [2, 2]])
    cont, lp_ref, E_ref = brute(lm, energy, prompts)
    assert torch.equal(enumeration.all_continuations(V, L), cont)
    assert torch.equal(enumeration.index_of(cont, V), torch.arange(V ** L))
    log_p = enumeration.lm_logprobs(lm, prompts, L, V, rows=5)  # the trie's last level in 4 blocks
    assert (log_p.logsumexp(-1).exp() - 1).abs().max() < 1e-12  # sums to 1
    assert (log_p - lp_ref).abs().max() < 1e-5  # float32 forward against float32 sequence_logprob
    assert log_p.exp().std(-1).min() > 0.01  # not uniform: a wrong order would show
    E = enumeration.energies(energy, prompts, P, L, V, NULL, rows=5)
    assert (E - E_ref).abs().max() < 1e-5 and E.std() > 0.5
    whole = rand_energy(V, causal=True, pool='all')  # pooled over the prompt's states too
    E_whole = enumeration.energies(whole, prompts, P, L, V, NULL, rows=64)  # the last level at once
    assert (E_whole - brute(lm, whole, prompts)[2]).abs().max() < 1e-5
    bit = rand_energy(V)  # bidirectional: whole sequences, in blocks of 7 continuations (the last one short)
    E_bit = enumeration.energies(bit, prompts, P, L, V, NULL, rows=7)
    assert (E_bit - brute(lm, bit, prompts)[2]).abs().max() < 1e-5 and (E_bit - E).abs().max() > 0.5
    real = torch.tensor([5, 17, 60])
    ex = exact_logz.exact_values(log_p, E, real)
    log_z = torch.logsumexp(lp_ref - E_ref, -1)  # Eq. 2's normaliser, from the brute force
    assert (ex['log_z'] - log_z).abs().max() < 1e-5
    joint = lp_ref - E_ref - log_z[:, None]
    assert (ex['joint_ll'] - joint[torch.arange(3), real]).abs().max() < 1e-5
    assert torch.equal(ex['joint_mode_correct'], joint.argmax(-1) == real)


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return ((counts - expected) ** 2 / expected).sum().item()


def test_sampler_draws_from_p_lm():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(2, 20, dtype=torch.float64) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    idx = exact_logz.sample_indices(probs.cumsum(-1), 40000, g)
    assert idx.min() >= 0 and idx.max() < 20
    for b in range(2):
        counts = torch.bincount(idx[b], minlength=20).double()
        assert chi_square(counts, probs[b]) < 50  # 19 dof: p ~ 1e-4 at 50
        assert chi_square(counts, probs[b].flip(0)) > 500  # a wrong distribution fails
        assert chi_square(counts, probs[1 - b]) > 500


def random_case(B=5, C=30, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(B, C, dtype=torch.float64, generator=g) * 2, -1)
    E = torch.randn(B, C, dtype=torch.float64, generator=g) * 2
    known_rows = torch.randint(0, C, (B, k), generator=g)
    known_rows[0, 1] = known_rows[0, 0]  # a known set with a repeat
    return log_p, E, known_rows, g


def test_fast_estimator_equals_logz_enumerate():
    """estimate_fast (sorted runs) is logz_enumerate (pairwise ids): repeats, samples in the known set."""
    C, L3 = 30, 3
    cont = torch.tensor(list(itertools.product(range(4), repeat=L3)))[:C]
    for n in (2, 8, 64):
        log_p, E, known_rows, g = random_case(C=C, seed=n)
        idx = exact_logz.sample_indices(log_p.exp().cumsum(-1), 3 * n, g).view(-1, 3, n)
        assert exact_logz.check_fast(idx, cont, log_p, E, known_rows) < 1e-12
        # and check_fast can fail: a wrong log_p gives another estimate
        log_p2 = log_p.roll(1, -1)
        B, r = idx.shape[:2]
        rows = torch.cat([known_rows[:, None].expand(-1, r, -1), idx], -1).reshape(B * r, -1)
        ref = logz_enumerate(cont[rows], log_p.repeat_interleave(r, 0).gather(1, rows),
                             (-E).repeat_interleave(r, 0).gather(1, rows), known=known_rows.size(1))
        known = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, known_rows, True)
        _, est2 = exact_logz.estimate_fast(idx, log_p2 - E, -E, torch.log1p(-log_p2.exp()), known)
        assert (ref['estimate'].view(B, r) - est2).abs().max() > 1e-3


def sharp_case():
    """One continuation of P_LM 1e-3 with E = -25 (weight e^25), the rest E = 0: Z is all in it."""
    C = 64
    p = torch.full((1, C), (1 - 1e-3) / (C - 1), dtype=torch.float64)
    p[0, 7] = 1e-3
    E = torch.zeros(1, C, dtype=torch.float64)
    E[0, 7] = -25.0
    return p.log(), E


def test_sharp_energy_eq4_far_off_enumerate_exact():
    log_p, E = sharp_case()
    log_z = (log_p - E).logsumexp(-1)
    n, R = 8, 400
    g = torch.Generator().manual_seed(0)
    idx = exact_logz.sample_indices(log_p.exp().cumsum(-1), R * n, g).view(1, R, n)
    w = (-E).gather(1, idx.view(1, -1)).view(1, R, n)
    T_n, upper = logz_bounds(w)
    missed = (idx != 7).all(-1)  # the sharp continuation drawn in none of the n: most replicates
    assert missed.double().mean() > 0.9
    assert (log_z - upper[missed]).min() > 15  # Eq. 4's whole range ~18 nats below log Z
    known = torch.zeros_like(log_p, dtype=torch.bool)
    known[0, 7] = True
    sure, est = exact_logz.estimate_fast(idx, log_p - E, -E, torch.log1p(-log_p.exp()), known)
    assert (est - log_z).abs().max() < 1e-6 and (sure <= log_z + 1e-12).all()
    # without the sharp continuation known, the estimate misses it as Eq. 4 does
    nothing = torch.zeros_like(known)
    _, est0 = exact_logz.estimate_fast(idx, log_p - E, -E, torch.log1p(-log_p.exp()), nothing)
    assert (log_z - est0[missed]).min() > 15
    # the replicate pipeline reports the same: coverage 0 for Eq. 4, error < 1e-6 for the estimate
    cont = enumeration.all_continuations(4, 3)[:64]
    reps = exact_logz.replicate_errors(log_p, E, log_z, torch.tensor([[7]]), cont, [8], 50, 0, 'test',
                                       check=1)
    row = exact_logz.error_table(reps, 0.01)[0]
    assert row['estimate']['within_tol'] == 1.0 and row['estimate']['mean_abs'] < 1e-6
    assert row['eq4_coverage'] < 0.1 and row['fast_vs_logz_enumerate'] < 1e-12


def test_exact_values_by_hand():
    """exact_values on 2 prompts x 4 continuations where the LM's mode and the joint model's differ:
    each field against its definition written out (the real continuation's log P_LM and E, whose mode
    is right, the LM's lost mass)."""
    log_p = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64))
    E = torch.tensor([[3.0, 0.0, 0.0, 1.0], [0.5, -1.0, 0.0, 2.0]], dtype=torch.float64)
    real = torch.tensor([0, 1])
    v = exact_logz.exact_values(log_p, E, real)
    for b in range(2):
        lpw = [float(log_p[b, j] - E[b, j]) for j in range(4)]
        log_z = math.log(sum(math.exp(t) for t in lpw))
        r = int(real[b])
        assert abs(v['log_z'][b].item() - log_z) < 1e-12
        assert abs(v['joint_ll'][b].item() - (lpw[r] - log_z)) < 1e-12
        assert v['lm_logp'][b].item() == log_p[b, r].item() and v['energy'][b].item() == E[b, r].item()
        assert bool(v['lm_mode_correct'][b]) == (max(range(4), key=lambda j: log_p[b, j]) == r)
        assert bool(v['joint_mode_correct'][b]) == (max(range(4), key=lambda j: lpw[j]) == r)
        assert abs(v['lm_mass_error'][b].item() - (float(log_p[b].exp().sum()) - 1)) < 1e-12
    assert v['lm_mode_correct'].tolist() == [True, False]  # the modes differ: the two fields apart
    assert v['joint_mode_correct'].tolist() == [False, True]


def test_error_table_and_threshold_curve_by_loops():
    """replicate_errors on random_case, then error_table and threshold_curve, against loops over the
    (prompt, replicate) pairs: each estimator's bias, spread over replicates (per prompt, averaged),
    mean |error|, RMSE and share within tol; Eq. 4's coverage, exact and within the slack (T_n at most
    slack above log Z, the upper end at most slack below); each threshold's flagged share (ESS below
    it, or the sure-bound flag) and the coverage of the rest."""
    log_p, E, known, _ = random_case()
    log_z = (log_p - E).logsumexp(-1)
    cont = enumeration.all_continuations(4, 3)[:30]
    slack, tol = 0.05, 0.1
    reps = exact_logz.replicate_errors(log_p, E, log_z, known, cont, [4, 16], 20, 0, 'test', slack=slack,
                                       check=2)
    rows = exact_logz.error_table(reps, tol)
    curve = exact_logz.threshold_curve(reps, [2.0, 3.0])
    for row, (n, r) in zip(rows, reps.items(), strict=True):
        B, R = r['T_n'].shape
        pairs = [(b, k) for b in range(B) for k in range(R)]
        near = [float(r['T_n'][b, k]) <= slack and float(r['upper'][b, k]) >= -slack for b, k in pairs]
        assert row['n'] == n and abs(row['eq4_coverage_slack'] - sum(near) / len(pairs)) < 1e-12
        covered = [float(r['T_n'][b, k]) <= 0 <= float(r['upper'][b, k]) for b, k in pairs]
        assert abs(row['eq4_coverage'] - sum(covered) / len(pairs)) < 1e-12
        for key in ('T_n', 'upper', 'estimate', 'sure'):
            e = [[float(r[key][b, k]) for k in range(R)] for b in range(B)]
            flat = [x for p in e for x in p]
            spread = sum(statistics.stdev(p) for p in e) / B
            want = dict(bias=sum(flat) / len(flat), spread=spread, mean_abs=sum(map(abs, flat)) / len(flat),
                        rmse=math.sqrt(sum(x * x for x in flat) / len(flat)),
                        within_tol=sum(abs(x) <= tol for x in flat) / len(flat))
            assert all(abs(row[key][k] - w) < 1e-9 for k, w in want.items()), (n, key, row[key], want)
        for c in curve:
            point = next(p for p in c['per_n'] if p['n'] == n)
            flagged = [float(r['ess'][b, k]) < c['min_ess'] or bool(r['sure_flag'][b, k]) for b, k in pairs]
            kept = [i for i, f in enumerate(flagged) if not f]
            assert abs(point['flagged'] - sum(flagged) / len(pairs)) < 1e-12
            assert point['unflagged'] == len(kept)
            assert abs(point['coverage_slack_unflagged'] - sum(near[i] for i in kept) / len(kept)) < 1e-12
    assert 0 < rows[0]['eq4_coverage'] < rows[0]['eq4_coverage_slack'] < 1  # the slack changes something
    assert any(0 < p['flagged'] < 1 for c in curve for p in c['per_n'])  # the curve flags some, not all


def test_min_ess_rule():
    cov = 'coverage_slack_unflagged'
    curve = [dict(min_ess=t, per_n=[{'n': 8, cov: c8}, {'n': 64, cov: c64}])
             for t, c8, c64 in ((1, 0.5, 0.95), (2, 0.85, 0.97), (4, 0.92, 0.96), (8, None, 0.99))]
    assert exact_logz.choose_threshold(curve, 0.9) == (4, True)
    assert exact_logz.choose_threshold(curve, 0.98) == (8, True)  # n = 8 all flagged: met
    assert exact_logz.choose_threshold(curve[:3], 0.99) == (4, False)  # none meets: the best worst n


def test_beam_curve_and_the_job_width(monkeypatch):
    """The job's estimator by beam width: a beam of every continuation (V^L = 64) leaves nothing to
    sample, so the estimate is the exact log Z; a beam of 1 leaves a sure part short of it."""
    lm, energy = tiny_gpt(vocab_size=V, block_size=8, std=0.5), rand_energy(V, causal=True)
    prompts = torch.tensor([[0, 1], [3, 2], [2, 2]])
    log_p = enumeration.lm_logprobs(lm, prompts, L, V)
    E = enumeration.energies(energy, prompts, P, L, V, NULL)
    log_z, cont = (log_p - E).logsumexp(-1), enumeration.all_continuations(V, L)
    real = torch.tensor([5, 17, 60])
    one, every = exact_logz.beam_curve(lm, prompts, real, log_p, E, log_z, cont, [1, V ** L], 8, 20, 0, 's',
                                       0.01)
    assert one['beam'] == 1 and every['beam'] == V ** L and every['n'] == 8
    assert abs(every['estimate_bias']) < 1e-12 and abs(every['sure_bias']) < 1e-12
    assert every['within_tol'] == 1
    assert one['sure_bias'] < -0.05 and one['within_tol'] < 1  # 2 continuations known of 64
    # with the one-token edits of the beam's first: the known set handed to the replicates, against loops
    seen, replicate_errors = [], exact_logz.replicate_errors
    monkeypatch.setattr(exact_logz, 'replicate_errors', lambda lp, E, lz, known, *a: seen.append(known) or
                        replicate_errors(lp, E, lz, known, *a))
    edited, = exact_logz.beam_curve(lm, prompts, real, log_p, E, log_z, cont, [2], 8, 20, 0, 's', 0.01,
                                    edits=1)
    beam = lm.beam_search(prompts, L, 2)[0].tolist()
    for b in range(3):
        S = {tuple(beam[b][0][:t] + [v] + beam[b][0][t + 1:]) for t in range(L) for v in range(V)}
        S |= {tuple(r) for r in beam[b]} | {tuple(cont[real[b]].tolist())}
        assert {tuple(cont[i].tolist()) for i in seen[0][b]} == S
    assert edited['edits'] == 1 and edited['sure_bias'] > one['sure_bias']
    rows = [dict(beam=8, within_tol=0.9), dict(beam=32, within_tol=0.97), dict(beam=128, within_tol=0.99)]
    assert exact_logz.choose_beam(rows, 0.95) == (32, True)
    assert exact_logz.choose_beam(rows, 0.995) == (128, False)  # none: the closest


def test_cache_resumes(tmp_path, monkeypatch):
    """enumerate_split with a cache: a rerun loads every chunk (no model call) and gives the same values;
    another beam width reuses the scored continuations and searches only its beam."""
    lm, energy = tiny_gpt(vocab_size=V, block_size=8, std=0.5), rand_energy(V, causal=True)
    data = torch.randint(0, V, (5 * 7,), generator=torch.Generator().manual_seed(0)).numpy()
    run = lambda beam=2: enumeration.enumerate_split(lm, energy, data, P, L, V, 7, NULL, beam, lambda s: None,
                                                    str(tmp_path), 'k', chunk=3)
    first = run()
    assert len(list(tmp_path.glob('k_[0-9]*.pt'))) == 3  # chunks of 3, 3, 1 problems
    assert len(list(tmp_path.glob('k_beam2_*.pt'))) == 3
    monkeypatch.setattr(enumeration, 'energies', lambda *a: 1 / 0)  # a rerun must not score again
    second = run()
    assert len(first) == len(second)
    for a, b in zip(first[:6], second[:6]):
        assert torch.equal(a, b)
    assert first[4].shape == (7, 3) and torch.equal(first[4][:, 0], first[3])  # real, then the beam of 2
    wider = run(beam=4)
    assert torch.equal(wider[1], first[1]) and torch.equal(wider[2], first[2]) and wider[4].shape == (7, 5)
    assert torch.equal(wider[4][:, 1:], enumeration.index_of(lm.beam_search(wider[0][:, :P], L, 4)[0], V))


def test_a_damaged_cache_is_computed_again(tmp_path, capsys):
    """Issue 57, item 2: a cache chunk cut in half, overwritten with random bytes, or of another shape
    is computed again, with one line naming it, and gives the values of a clean run (it was a
    PytorchStreamReader RuntimeError, an UnpicklingError traceback, or wrong values used)."""
    lm, energy = tiny_gpt(vocab_size=V, block_size=8, std=0.5), rand_energy(V, causal=True)
    data = torch.randint(0, V, (5 * 7,), generator=torch.Generator().manual_seed(0)).numpy()
    run = lambda: enumeration.enumerate_split(lm, energy, data, P, L, V, 7, NULL, 2, lambda s: None,
                                             str(tmp_path), 'k', chunk=3)
    first = run()
    cut, junk, shape = tmp_path / 'k_0.pt', tmp_path / 'k_3.pt', tmp_path / 'k_beam2_6.pt'
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    junk.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)))
    torch.save(torch.zeros(1, 5, dtype=torch.int64), shape)
    capsys.readouterr()
    second = run()
    said, damaged = capsys.readouterr().err.splitlines(), (cut, junk, shape)
    assert len(said) == len(damaged) == 3, said
    for p, s in zip(damaged, said):
        assert f"the cache file {p} is damaged (" in s and s.endswith(': computing it again'), s
    assert "not a (1, 2) tensor of continuation indices" in said[2]
    assert len(first) == len(second)
    for a, b in zip(first[:6], second[:6]):
        assert torch.equal(a, b)
    run()
    assert capsys.readouterr().err == ''  # each was saved again, whole


def test_the_recipes_run_as_written():
    """Every `python` command of RECIPE, RECIPE_SHARP and RECIPE_SHARPER (the models docs/exact_logz.md
    was run on) gives only flags its script takes (its --help): a renamed flag fails here, not a reader's
    run."""
    from tests.common import run_scripts
    from tests.test_layout import help_flags
    commands = [c.split() for c in exact_logz.RECIPE + exact_logz.RECIPE_SHARP + exact_logz.RECIPE_SHARPER
                if c.startswith('python ')]
    scripts = sorted({tuple(c[1:3]) if c[1] == '-m' else (c[1],) for c in commands})
    assert len(commands) >= 15 and len(scripts) >= 4, scripts
    helps = dict(zip(scripts, run_scripts([[*s, '--help'] for s in scripts])))
    bad = [(s, f) for c in commands for s in [tuple(c[1:3]) if c[1] == '-m' else (c[1],)]
           for f in c if f.startswith('--') and f not in help_flags(helps[s].stdout)]
    assert not bad, bad

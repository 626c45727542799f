"""The addition task: its problems and windows, the LM stopped on the answer, and addition_eval.py's
decoders and P(correct sum) against brute force and exact enumeration. exo.py's runs on it:
test_exo_runs.py; EXO's objective against exact enumeration: test_exo.py.
"""

import collections
import contextlib
import json
import math
import re

import pytest
import torch

import train_lm
from data import load_meta, load_split, window_tokens, windows
from energy import load_any_energy, score_continuations
from model import load_lm
from data.tokenizer import EOT, load_tokenizer
from extensions import addition_eval
from data.addition import prepare as addition_prepare
from tests.common import TRAIN_FLAGS, logprobs64
from tests.test_carry import lookahead_by_enumeration


def test_addition_problems_are_sums_in_disjoint_splits():
    """Every document is `a+b=c` with c = a + b, zero-padded to fixed widths; no problem (nor its
    mirror b+a) is in two splits or twice in one; --chain 1 makes every digit pair sum to 9."""
    docs = addition_prepare.make_problems(dict(train=3000, select=100, val=100, test=100), 3, 0.3, seed=0)
    keys = []
    for split, lines in docs.items():
        for line in lines:
            m = re.fullmatch(r'(\d{3})\+(\d{3})=(\d{4})', line)
            assert m and int(m[1]) + int(m[2]) == int(m[3]), line
            keys.append((min(int(m[1]), int(m[2])), max(int(m[1]), int(m[2]))))
    assert len(keys) == 3300 == len(set(keys))
    chain = addition_prepare.make_problems(dict(train=5, select=1, val=1, test=1), 4, 1.0, seed=0)
    assert all(line.endswith('=09999') for lines in chain.values() for line in lines)
    with pytest.raises(ValueError, match='too many'):
        addition_prepare.make_problems(dict(train=30, select=1, val=1, test=1), 1, 0.3, seed=0)


def test_extra_test_problems_leave_every_split_as_it_was():
    """--extra_test_problems M: the same train, select and val problems and the same first test
    problems as without it (so trained models still apply), then M more test problems, new to every
    split (mirrors too); as the flag of prepare, recorded in meta.json's made_with."""
    sizes = dict(train=3000, select=100, val=100, test=100)
    base = addition_prepare.make_problems(sizes, 3, 0.3, seed=0)
    more = addition_prepare.make_problems(sizes, 3, 0.3, seed=0, extra_test=400)
    assert all(more[s] == base[s] for s in ('train', 'select', 'val'))
    assert more['test'][:100] == base['test'] and len(more['test']) == 500
    key = lambda line: tuple(sorted(line[:-5].split('+')))
    assert len({key(d) for docs in more.values() for d in docs}) == 3700
    with pytest.raises(ValueError, match='too many'):
        addition_prepare.make_problems(dict(train=20, select=1, val=1, test=1), 1, 0.3, seed=0, extra_test=10)


def test_addition_windows_are_the_problems(addition_run):
    """The pipeline's windows (data.windows, prefix 2N+2 and continuation N+2) are exactly the
    problems: `a+b=` then the sum and the end of text; addition_eval reads that layout back."""
    d, _ = addition_run
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'test', meta)
    tok = load_tokenizer(meta)
    offsets = windows(data, 8, 5)
    assert len(offsets) == 64
    for o in offsets:
        text = tok.decode(data[o:o + 13].tolist())
        assert re.fullmatch(r'\d{3}\+\d{3}=\d{4}' + re.escape(EOT), text), text
    assert addition_eval.answer_layout(data, meta) == (8, 5)


def test_lm_selected_on_the_answer(addition_run, tmp_path):
    """train_lm.py --select_on continuation: the selection loss is the mean NLL of the answers' tokens
    (the sum and the end of text) given their problems, over evenly spaced problems of the selection
    split, equal to a float64 forward of those problems; text data is refused in one line."""
    d, _ = addition_run
    out = tmp_path / 'lm'
    res = train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(out), '--max_iters', '6',
                         '--eval_interval', '3', '--final_eval', '0', '--select_on', 'continuation',
                         *TRAIN_FLAGS])
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'select', meta)
    lm = load_lm(str(out / 'best.pt'))[0]
    args = train_lm.get_args(['--data_dir', str(d / 'data'), '--out_dir', str(tmp_path / 'x'),
                              '--select_on', 'continuation', *TRAIN_FLAGS])
    n = 2 * args.batch_size * (args.block_size // 13)  # as many tokens as the windows' rule would score
    x = window_tokens(data, windows(data, 8, 5, max_windows=n), 13)
    lp = logprobs64(lm, x[:, :-1])[:, 7:].gather(-1, x[:, 8:, None]).squeeze(-1)  # (problems, 5)
    assert res['select_on'] == 'continuation'
    assert res['best_select_loss'] == pytest.approx(-lp.mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match='--select_on continuation needs problem data'):
        train_lm.main(['--data_dir', str(d / 'data'), '--out_dir', str(tmp_path / 'm'), '--objective', 'mlm',
                       '--max_iters', '2', '--select_on', 'continuation', *TRAIN_FLAGS])


def test_addition_eval_against_brute_force(addition_run, tmp_path):
    """The base LM's greedy answers and its probability of the correct sums, recomputed by a
    float64 forward; with E = 0 the joint model's probability is the LM's (log Z = 0 exactly) and
    Algorithm 1's scores are those of plain LM samples; every problem's outcome is saved."""
    d, lm_path = addition_run
    out = tmp_path / 'acc.json'
    addition_eval.main(['--lm', lm_path, '--energy', str(d / 'zero.pt'), '--ns', '1,8',
                        '--num_prefixes', '16',
                        '--extra_lm', f'TWIN={lm_path}', '--out', str(out)])
    res = json.loads(out.read_text())
    rows = {(r['model'], r['method']): r for r in res['rows']}
    meta = load_meta(str(d / 'data'))
    data = load_split(str(d / 'data'), 'test', meta)
    x = window_tokens(data, windows(data, 8, 5, max_windows=16), 13)
    lm = load_lm(lm_path)[0]
    seq = x[:, :8]
    for _ in range(5):
        seq = torch.cat([seq, logprobs64(lm, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    hit = seq[:, 8:] == x[:, 8:]
    assert rows['BASE LM', 'greedy']['exact'] == pytest.approx(hit.all(1).double().mean().item())
    assert rows['BASE LM', 'greedy']['digit'] == pytest.approx(hit[:, :4].double().mean().item())
    lp = logprobs64(lm, x[:, :-1])[:, 7:].gather(-1, x[:, 8:, None]).squeeze(-1).sum(1)
    p = lp.exp().mean().item()
    assert rows['BASE LM', 'sampled']['p_correct'] == pytest.approx(p, rel=1e-5)
    assert rows['TWIN', 'greedy']['exact'] == rows['BASE LM', 'greedy']['exact']
    for n in (1, 8):
        joint = rows['JOINT', f'Algorithm 1, n = {n}']
        # E = 0: Eq. 4 is exact (8 equal weights: ESS 8, not flagged)
        assert joint['eq4_flagged'] == 0 and joint['eq4_ess'] == pytest.approx(8)
        assert joint['p_correct_low'] == pytest.approx(p, rel=1e-5) == joint['p_correct_high']
        assert 0 < joint['p_correct'] <= 1  # logz_enumerate: unbiased in Z, not exact
        assert joint['exact'] <= joint['oracle_exact'] and joint['digit'] <= joint['oracle_digit']
    per = res['per_problem']
    assert per['BASE LM']['greedy_exact'] == hit.all(1).double().tolist()
    assert len(per['JOINT']['a1_8_exact']) == 16 and set(per['JOINT']['a1_8_exact']) <= {0.0, 1.0}


@pytest.mark.parametrize('top_k', [0, 2])
def test_p_correct_against_exact_enumeration(top_k):
    """joint_columns' log P_joint(correct) (Eq. 2, log Z by logz_enumerate) against the exact one, each of
    the V^L = 625 continuations scored on its own, on a toy whose LM is diffuse (the 256 samples see
    part of them: the sure lower bound of log Z is well below it) and whose energy is far from zero;
    with top_k the decoders' samples are top-k ones, and log Z still comes from P_LM's own. Eq. 4's
    range is ordered, and over the problems where it is not flagged its midpoint lies near the exact
    value on average (a range from 256 samples need not hold it: Eq. 4 bounds log Z in expectation)."""
    import itertools
    from tests.common import rand_energy, tiny_gpt
    V, P, L, B, m = 5, 3, 4, 6, 256
    lm = tiny_gpt(vocab_size=V, block_size=8, std=0.3, seed=4)
    energy = rand_energy(V, seed=3, head_std=1.0)
    g = torch.Generator().manual_seed(0)
    pre = torch.randint(V, (B, P), generator=g)
    gold = torch.randint(V, (B, L), generator=g)
    samples = addition_eval.lm_columns(lm, pre, gold, [1, m], top_k, g)[1]
    out = addition_eval.joint_columns(lm, energy, pre, gold, samples, [1, m], top_k, g, beam=4)
    conts = torch.tensor(list(itertools.product(range(V), repeat=L)))  # (V^L, L)
    mids, exacts = [], []
    for b in range(B):
        seqs = torch.cat([pre[b].expand(len(conts), -1), conts], 1)
        lp = logprobs64(lm, seqs)[:, P - 1:-1].gather(-1, conts[..., None]).squeeze(-1).sum(1)
        with torch.no_grad():
            E = energy(seqs, P).double()
        log_z = torch.logsumexp(lp - E, 0).item()
        i = int((conts == gold[b]).all(1).nonzero())
        exact = (lp[i] - E[i]).item() - log_z
        assert abs(out['logp_correct'][b].item() - exact) < 0.1, (b, out['logp_correct'][b].item(), exact)
        low, high = out['logp_correct_low'][b].item(), out['logp_correct_high'][b].item()
        assert low <= high
        if not out['eq4_flagged'][b]:
            mids, exacts = mids + [(low + high) / 2], exacts + [exact]
    assert len(mids) >= 3 and abs(sum(mids) / len(mids) - sum(exacts) / len(exacts)) < 0.1, (mids, exacts)
    assert (out['logp_correct_low'] < out['logp_correct_high']).any()  # not all raised to the sure bound


def test_p_correct_never_above_one_and_eq4_flagged(addition_run, tmp_path):
    """A sharp random energy: P(correct) from logz_enumerate is at most 1 on every problem (the answer
    is in the scored set), Eq. 4's range is reported only where it flags no problem, and the share
    flagged is in the JSON and the table."""
    d, lm_path = addition_run
    out = tmp_path / 'acc.json'
    addition_eval.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--ns', '1,16',
                        '--num_prefixes', '32', '--out', str(out), '--quiet'])
    res = json.loads(out.read_text())
    assert max(res['per_problem']['JOINT']['logp_correct']) <= 1e-12
    assert max(res['per_problem']['JOINT']['logp_correct_low']) <= 1e-12
    for r in (r for r in res['rows'] if r['model'] == 'JOINT'):
        assert 0 <= r['eq4_flagged'] <= 1 and r['p_correct'] <= 1
        assert r['p_correct_high'] is None or r['p_correct_high'] <= 1
        assert (r['p_correct_low'] is None) == (r['eq4_flagged'] > 0)
    assert 'flagged' in out.with_suffix('.txt').read_text()


def hand_built_decoding():
    """Two problems, continuations of 2 tokens A, B, C (the last a stand-in for the end of text),
    their log P_LM and energies chosen so that majority vote, log-prob reranking and the joint mode
    pick different continuations. gold: B, then C; (exact, digit) of A B C: (0 1) (1 1) (0 0), then
    (0 0) (0 0) (1 1)."""
    A, B, C = [1, 2], [1, 3], [4, 2]
    x = torch.tensor([[A, B, B, A, C], [C, C, B, A, B]])
    logp = torch.tensor([[-3., -1, -1, -3, -0.5], [-2., -2, -4, -1, -4]], dtype=torch.float64)
    E = torch.tensor([[-1., 0, 0, -1, 3], [-3., -3, 0, 2, 0]], dtype=torch.float64)
    return x, logp, E, torch.tensor([B, C])


def test_addition_decoders_on_hand_built_samples():
    """Each decoder's pick among the first n, known by hand (hand_built_decoding). Problem 0 at
    n = 5: majority vote A (A and B tie at 2: the first to occur), reranking C (argmax log P_LM),
    the joint mode B (argmax log P_LM - E: -2, -1, -3.5; argmax -E alone would be A), the oracle B;
    at n = 3 majority B. Problem 1: majority C (its own counts; counted over both problems B would
    win), reranking A, mode C."""
    x, logp, E, gold = hand_built_decoding()
    lm = addition_eval.lm_decoders(x, logp, gold, [1, 3, 5])
    joint = addition_eval.joint_decoders(x, logp, E, gold, [1, 3, 5], torch.Generator().manual_seed(0))
    want = {'majority_5': [(0, 1), (1, 1)], 'rerank_5': [(0, 0), (0, 0)], 'oracle_5': [(1, 1), (1, 1)],
            'majority_3': [(1, 1), (1, 1)], 'rerank_3': [(1, 1), (1, 1)], 'mode_5': [(1, 1), (1, 1)],
            'mode_3': [(1, 1), (1, 1)], 'majority_1': [(0, 1), (1, 1)], 'rerank_1': [(0, 1), (1, 1)],
            'oracle_1': [(0, 1), (1, 1)], 'mode_1': [(0, 1), (1, 1)], 'a1_1': [(0, 1), (1, 1)]}
    cols = {**lm, **joint}
    for key, pairs in want.items():
        got = list(zip(cols[f'{key}_exact'].tolist(), cols[f'{key}_digit'].tolist()))
        assert got == [(float(e), float(d)) for e, d in pairs], (key, got)
    ids, first = addition_eval.distinct(x)  # each sample's first repeat in its problem, by flat index
    assert len(first) == 6 and first[ids.flatten()].tolist() == [0, 1, 1, 0, 4, 5, 5, 7, 8, 7]


def test_addition_algorithm_1_resamples_by_energy():
    """Algorithm 1 among the first 5 of problem 0 (hand_built_decoding), over 4,000 independent
    draws: B (E = 0, twice) is picked with probability 2 / (2 e + 2 + e^-3) = 0.267 and C with
    e^-3 / (...) = 0.0067 (Deng et al. 2020, Algorithm 1: ∝ exp(-E), counted by multiplicity)."""
    x, logp, E, gold = hand_built_decoding()
    N = 4000
    cols = addition_eval.joint_decoders(x[:1].expand(N, -1, -1), logp[:1].expand(N, -1), E[:1].expand(N, -1),
                                        gold[:1].expand(N, -1), [5], torch.Generator().manual_seed(0))
    w = torch.tensor([math.e, 1, 1, math.e, math.exp(-3)])
    for got, p in ((cols['a1_5_exact'].mean().item(), (w[1] + w[2]) / w.sum()),
                   (1 - cols['a1_5_digit'].mean().item(), w[4] / w.sum())):
        assert abs(got - p) < 4 * math.sqrt(p * (1 - p) / N), (got, p)


def test_edits_join_the_known_set_of_log_z(addition_run, tmp_path, monkeypatch):
    """--edits k: log Z's exactly scored set is the correct sum, the LM's beam and every one-token edit
    of the beam's first k (built here by loops), each with its log P_LM by a float64 forward and its E;
    the decoders (beam + samples) are unchanged, P(correct) changes and stays at most 1."""
    d, lm_path = addition_run
    seen, prompts = [], []
    enumerate_real, lm_columns = addition_eval.logz_enumerate, addition_eval.lm_columns
    monkeypatch.setattr(addition_eval, 'logz_enumerate', lambda x, lp, lw, known: seen.append(
        (x[:, :known], lp[:, :known], -lw[:, :known])) or enumerate_real(x, lp, lw, known))
    monkeypatch.setattr(addition_eval, 'lm_columns',
                        lambda lm, pre, *a: prompts.append(pre) or lm_columns(lm, pre, *a))

    def run(k):
        out = tmp_path / f'edits{k}.json'
        addition_eval.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--ns', '1,4', '--num_prefixes',
                            '6', '--beam', '4', '--edits', str(k), '--out', str(out), '--quiet'])
        return json.loads(out.read_text())

    plain, edited = run(0), run(2)
    (x0, _, _), (x, lp, E), pre = seen[0], seen[1], prompts[0]
    lm, energy = load_lm(lm_path)[0], load_any_energy(str(d / 'bit.pt'), lm_path, 'cpu')[0]
    assert x0.size(1) == 5 and torch.equal(x[:, :5], x0)  # the correct sum and the beam of 4 come first
    V, (B, k, L) = lm.config.vocab_size, x.shape
    for b in range(B):
        want = {tuple(r) for r in x0[b].tolist()}
        for j in (1, 2):
            row = x0[b, j].tolist()
            want |= {tuple(row[:t] + [v] + row[t + 1:]) for t in range(L) for v in range(V)}
        assert sorted({tuple(r) for r in x[b].tolist()}) == sorted(want)
    seq = torch.cat([pre.repeat_interleave(k, 0), x.flatten(0, 1)], 1)
    lp_ref = logprobs64(lm, seq[:, :-1])[:, 7:].gather(-1, seq[:, 8:, None]).sum((1, 2)).view(B, k)
    assert torch.allclose(lp, lp_ref, atol=1e-4)
    assert torch.allclose(E, score_continuations(energy, pre, x, 8, contextlib.nullcontext()), atol=1e-5)
    rows = lambda res: {r['method']: r['exact'] for r in res['rows'] if r['model'] == 'JOINT'}
    assert rows(plain) == rows(edited) and edited['edits'] == 2
    p0, p2 = (res['per_problem']['JOINT']['logp_correct'] for res in (plain, edited))
    assert max(p2) <= 1e-12 and p0 != p2


def test_addition_decoders_against_brute_force(addition_run, tmp_path, monkeypatch):
    """The decoders' rows of addition_eval.main with a random BIT energy, recomputed from the
    samples it drew: log P_LM by a float64 forward, E of every sample (none skipped as a
    repeat), majority vote by collections.Counter (ties: first encountered), reranking, the
    joint mode and the oracle by Python loops over the first n."""
    d, lm_path = addition_run
    drawn = collections.defaultdict(list)
    lm_columns = addition_eval.lm_columns

    def record(lm, pre, gold, ns, top_k, g):
        out, samples = lm_columns(lm, pre, gold, ns, top_k, g)
        drawn[id(lm)].append((pre, gold, *samples))
        return out, samples

    monkeypatch.setattr(addition_eval, 'lm_columns', record)
    out, png = tmp_path / 'acc.json', tmp_path / 'acc.png'
    addition_eval.main(['--lm', lm_path, '--energy', str(d / 'bit.pt'), '--ns', '1,4', '--num_prefixes', '16',
                        '--chunk', '8', '--out', str(out), '--quiet', '--plot', str(png)])
    rows = {(r['model'], r['method']): r for r in json.loads(out.read_text())['rows']}
    pre, gold, x, logp = (torch.cat(t) for t in zip(*next(iter(drawn.values()))))
    B, m, L = x.shape
    seq = torch.cat([pre.repeat_interleave(m, 0), x.flatten(0, 1)], 1)
    lp = logprobs64(load_lm(lm_path)[0], seq[:, :-1])[:, 7:].gather(-1, seq[:, 8:, None]).sum((1, 2))
    lp = lp.view(B, m)
    assert torch.allclose(logp, lp, atol=1e-4)
    energy = load_any_energy(str(d / 'bit.pt'), lm_path, 'cpu')[0]
    E = score_continuations(energy, pre, x, 8, contextlib.nullcontext())
    hit = x == gold[:, None]
    score = dict(exact=hit.all(-1).double(), digit=hit[..., :-1].double().mean(-1))  # (B, m) each
    for n in (1, 4):
        picks = dict(majority=[], rerank=[], mode=[])
        for b in range(B):
            cont = [tuple(c) for c in x[b, :n].tolist()]
            picks['majority'].append(cont.index(collections.Counter(cont).most_common(1)[0][0]))
            picks['rerank'].append(max(range(n), key=lambda i: lp[b, i].item()))
            picks['mode'].append(max(range(n), key=lambda i: lp[b, i].item() - E[b, i].item()))
        want = {(k, s): v[torch.arange(B), picks[k]].mean().item() for k in picks for s, v in score.items()}
        for model, method, k in (('BASE LM', 'majority vote', 'majority'),
                                 ('BASE LM', 'log-prob rerank', 'rerank'), ('JOINT', 'joint mode', 'mode')):
            for s in score:
                assert rows[model, f'{method}, n = {n}'][s] == pytest.approx(want[k, s]), (method, n, s)
        for s, v in score.items():
            oracle = v[:, :n].amax(1).mean().item()
            assert rows['BASE LM', f'oracle, n = {n}'][s] == pytest.approx(oracle)
            assert rows['JOINT', f'Algorithm 1, n = {n}'][f'oracle_{s}'] == pytest.approx(oracle)
            assert rows['JOINT', f'Algorithm 1, n = {n}'][s] <= oracle
    # the fixture's samples tell the decoders apart (per digit), so a swap of two of them fails (the
    # random energy's scale dwarfs log P_LM's here: a mode by -E alone is hand_built_decoding's case)
    assert len({want[k, 'digit'] for k in picks}) == 3, want
    assert png.stat().st_size > 0 and (tmp_path / 'acc_carry.png').stat().st_size > 0
    # the joint mode over the LM's beam (the tool's default width) and the samples: argmax log P_LM - E
    # over the union, by loops
    W = json.loads(out.read_text())['beam']
    beam = load_lm(lm_path)[0].beam_search(pre, L, W)[0]  # (B, W, L)
    bseq = torch.cat([pre.repeat_interleave(W, 0), beam.flatten(0, 1)], 1)
    blp = logprobs64(load_lm(lm_path)[0], bseq[:, :-1])[:, 7:].gather(-1, bseq[:, 8:, None]).sum((1, 2))
    bE = score_continuations(energy, pre, beam, 8, contextlib.nullcontext())
    for n in (1, 4):
        cand = [[(blp[b * W + i].item() - bE[b, i].item(), beam[b, i]) for i in range(W)]
                + [(lp[b, i].item() - E[b, i].item(), x[b, i]) for i in range(n)] for b in range(B)]
        hit = torch.stack([max(c, key=lambda t: t[0])[1] for c in cand]) == gold
        row = rows['JOINT', f'joint mode, beam + samples, n = {n}']
        assert row['exact'] == pytest.approx(hit.all(-1).double().mean().item()), n
        assert row['digit'] == pytest.approx(hit[:, :-1].double().mean().item()), n
    # the longest carry chain of each problem, by integer arithmetic
    res = json.loads(out.read_text())
    chars = '+0123456789='
    assert len(res['carry_chain']) == len(pre)
    for p, chain in zip(pre.tolist(), res['carry_chain']):
        a, b = (int(t) for t in ''.join(chars[i - 1] for i in p).rstrip('=').split('+'))
        runs, run, k = [0], 0, 1
        while k <= 10 ** 7:
            run = run + 1 if (a % (10 * k)) + (b % (10 * k)) >= 10 * k else 0  # column k carries out
            runs.append(run)
            k *= 10
        assert chain == max(runs), (a, b, chain)
    assert sum(res['by_carry_chain']['count'].values()) == B and len(res['by_carry_chain']['count']) > 1
    for p, ahead in zip(pre.tolist(), res['lookahead']):
        assert ahead == lookahead_by_enumeration(*''.join(chars[i - 1] for i in p).rstrip('=').split('+'))
    by = res['by_lookahead']
    assert sum(by['count'].values()) == B
    for v, n in by['count'].items():
        greedy = res['per_problem']['BASE LM']['greedy_exact']
        hits = [h for h, a in zip(greedy, res['lookahead']) if a == int(v)]
        assert len(hits) == n and by['exact']['BASE LM']['greedy_exact'][v] == pytest.approx(sum(hits) / n)



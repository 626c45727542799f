"""
Every continuation of a prompt, scored: the enumeration behind extensions/exact_logz.py's exact Z.
A continuation of L tokens over a V-token vocabulary is a row of all_continuations(V, L) (V^L rows:
N = 2 addition 28,561, N = 3 371,293); the LM's log-probability and a causal energy's E of every row
come from walking the trie of continuations with the model's KV cache (trie_states: each prefix runs
once; a BIT's E comes from whole sequences), and enumerate_split does it for evenly spaced problems
of a split, each chunk cached on disk (cached: a damaged chunk is made again).
"""

import os
import sys
import time

import torch

from data import window_tokens, windows
from energy import score_continuations
from model import GPT, KVCache
from plumbing import atomic_write

MAX_CONTINUATIONS = 2 ** 20  # V^L above this is not enumerated (N = 2 addition: 28,561)

def all_continuations(V, L):
    """Every continuation (V^L, L) int64, row-major: row i is i written in base V, most significant
    token first (itertools.product's order), so row s * V + v extends row s of all_continuations(V, L-1)."""
    i = torch.arange(V ** L)
    return torch.stack([(i // V ** (L - 1 - t)) % V for t in range(L)], 1)


def index_of(x, V):
    """Continuations x (..., L) -> their rows in all_continuations (...), int64."""
    L = x.size(-1)
    return (x.long() * (V ** torch.arange(L - 1, -1, -1, device=x.device))).sum(-1)


def expand(cache, V):
    """Each row's (k, v) of every layer copied to V consecutive rows: its V children's caches."""
    return [(k.repeat_interleave(V, 0), v.repeat_interleave(V, 0)) for k, v in cache]


def one_token_edits(x, V):
    """Every continuation one token away from a row of x (B, k, L): (B, k L V, L), row (j, t, v) is
    x[:, j] with token t set to v (x itself among them, L times)."""
    B, k, L = x.shape
    out = x[:, :, None, None, :].repeat(1, 1, L, V, 1)  # (B, k, L, V, L)
    t = torch.arange(L, device=x.device)
    out[:, :, t, :, t] = torch.arange(V, device=x.device, dtype=x.dtype).expand(L, B, k, V)  # (t, b, j, v)
    return out.reshape(B, k * L * V, L)


@torch.no_grad()
def trie_states(body, prompt, L, V, rows=4096):
    """The final hidden states of a causal GPT body on every continuation of one prompt (P,), walked
    as a trie, level by level: yields (0, the prompt's states (P, C)), then (t, h) for t = 1..L, h
    (V^t, C) the states at the t-th continuation token, row i the continuation i of
    all_continuations(V, t). Each prefix runs once, its K/V cached and copied to its V children:
    about V^(L-1) V / (V - 1) one-token steps, where whole sequences cost V^(L-1) (P + L - 1)
    tokens (N = 3 addition: 11x fewer). The last level, `rows` parents at a time, attends to its
    parents' caches shared, not copied (KVCache's prompt sharing, groups of V rows)."""
    P, S = prompt.numel(), prompt.numel() + L - 1
    cache = body.new_cache(1, S)
    yield 0, body.hidden(prompt[None], cache)[0]
    if L == 0:
        return
    children = lambda n: torch.arange(V, device=prompt.device).repeat(n)[:, None]  # row r V + v
    n = 1
    for t in range(1, L):
        cache = expand(cache, V)
        yield t, body.hidden(children(n), cache, pos=P + t - 1)[:, -1]
        n *= V
    last = []
    for c in range(0, n, rows):
        parents = [(k[c:c + rows], v[c:c + rows]) for k, v in cache]
        m = parents[0][0].size(0)
        kv = [KVCache(k, v, *p) for (k, v), p in zip(body.new_cache(m * V, 1), parents)]
        last.append(body.hidden(children(m), kv, pos=S)[:, -1])
    yield L, torch.cat(last)


@torch.no_grad()
def lm_logprobs(lm, prompts, L, V, rows=4096):
    """log P_LM (B, V^L) in float64 of every continuation of each prompt (B, P), from the trie's
    states (trie_states: each prefix run once), each next-token distribution normalised in float64
    (so the V^L probabilities sum to 1 up to float64 rounding)."""
    if type(lm) is not GPT:
        raise ValueError(f"--lm: the enumeration walks a plain GPT's cache, not a {type(lm).__name__}")
    out = []
    for p in prompts:
        log_p = torch.zeros(1, dtype=torch.float64, device=p.device)
        for t, h in trie_states(lm, p, L - 1, V, rows):
            logits = lm.lm_head(h[-1:] if t == 0 else h)  # (V^t, V): the next token's
            log_p = (log_p[:, None] + torch.log_softmax(logits.double(), -1)).reshape(-1)  # row r V + v
        out.append(log_p)
    return torch.stack(out)


@torch.no_grad()
def energies(energy, prompts, P, L, V, ctx, rows=4096):
    """E (B, V^L) in float64 of every continuation of each prompt (B, P). A causal energy that sees
    the whole prompt (UNIT): the trie's states (trie_states), summed along each path, then pooled and
    projected as Energy.forward pools them (its mean over the pooled positions). Any other (a BIT,
    whose prompt states depend on the continuation): whole sequences, `rows` continuations a block."""
    if not getattr(energy, 'config', None) or not energy.config.causal or energy.context_cut(P):
        cont = all_continuations(V, L).to(prompts.device)
        return torch.stack([torch.cat([score_continuations(energy, p[None], c[None], P, ctx)[0]
                                       for c in cont.split(rows)]) for p in prompts])
    pooled_from = P if energy.pool == 'continuation' else 0
    out = []
    for p in prompts:
        with ctx:
            for t, h in trie_states(energy.body, p, L, V, rows):
                h = h.float()
                total = h[pooled_from:].sum(0, keepdim=True) if t == 0 else total.repeat_interleave(V, 0) + h
        out.append(energy.project(total / (P - pooled_from + L)).double())
    return torch.stack(out)


def enumerate_split(lm, energy, data, P, L, V, count, ctx, beam, log, cache=None, key='', chunk=20):
    """Exact log P_LM and E (B, V^L) of every continuation of `count` evenly spaced problems, the
    problems' rows, the real continuation's row and the known set's rows (real + the LM's beam).
    With a cache folder, each `chunk` of problems is saved there once enumerated, and reused by a
    rerun whose key (models' hashes, split, count, dtype) is the same; the LM's beam is saved apart,
    by its width, so that another --beam reuses the scored continuations."""
    x = window_tokens(data, windows(data, P, L, max_windows=count), P + L)
    prompts, real = x[:, :P], index_of(x[:, P:], V)
    cont = all_continuations(V, L)
    parts, times = [], dict(lm_s=0.0, energy_s=0.0)
    for c0 in range(0, len(x), chunk):
        pr = prompts[c0:c0 + chunk]
        part = cached(cache and os.path.join(cache, f'{key}_{c0}.pt'),
                      lambda: scored(lm, energy, pr, P, L, V, ctx),
                      lambda o: scored_shape(o, len(pr), V ** L))
        part['beam'] = cached(cache and os.path.join(cache, f'{key}_beam{beam}_{c0}.pt'),
                              lambda: index_of(lm.beam_search(pr, L, beam)[0], V),
                              lambda o: rows_shape(o, len(pr), beam, V ** L))
        parts.append(part)
        times['lm_s'] += part['lm_s']
        times['energy_s'] += part['energy_s']
        log(f"  {c0 + len(part['E'])} of {len(x)} prompts enumerated")
    log_p, E = torch.cat([p['log_p'] for p in parts]), torch.cat([p['E'] for p in parts])
    known_rows = torch.cat([real[:, None], torch.cat([p['beam'] for p in parts])], 1)
    # the shared-prefix energies against whole sequences scored apart, on the known rows
    direct = score_continuations(energy, prompts, cont[known_rows], P, ctx)
    times['energy_vs_direct'] = (E.gather(1, known_rows) - direct).abs().max().item()
    log(f"  {len(prompts)} prompts x {V ** L:,} continuations: LM {times['lm_s']:.0f} s, "
        f"energy {times['energy_s']:.0f} s (against whole sequences: {times['energy_vs_direct']:.2g})")
    return x, log_p, E, real, known_rows, cont, times


def scored(lm, energy, prompts, P, L, V, ctx):
    """log P_LM and E of every continuation of `prompts`, with the seconds each took."""
    t0 = time.time()
    part = dict(log_p=lm_logprobs(lm, prompts, L, V))
    t1 = time.time()
    part['E'] = energies(energy, prompts, P, L, V, ctx)
    return dict(part, lm_s=t1 - t0, energy_s=time.time() - t1)


def scored_shape(o, B, C):
    """What is wrong with a cached chunk of scored() for B problems of C continuations (None: nothing)."""
    if not isinstance(o, dict) or not {'log_p', 'E', 'lm_s', 'energy_s'} <= o.keys():
        return "not a chunk of scores"
    for k in ('log_p', 'E'):
        t = o[k]
        if not isinstance(t, torch.Tensor) or t.shape != (B, C) or not t.is_floating_point():
            return f"its {k} is not a ({B}, {C}) float tensor"
    if torch.isnan(o['log_p']).any() or torch.isnan(o['E']).any():
        return "it holds NaN"
    if not all(isinstance(o[k], float) for k in ('lm_s', 'energy_s')):
        return "its seconds are not numbers"
    return None


def rows_shape(o, B, beam, C):
    """What is wrong with a cached beam of B problems (None: nothing): (B, beam) row indices below C."""
    if not isinstance(o, torch.Tensor) or o.shape != (B, beam) or o.dtype != torch.int64:
        return f"not a ({B}, {beam}) tensor of continuation indices"
    if len(o) and not (0 <= int(o.min()) and int(o.max()) < C):
        return f"an index beyond the {C} continuations"
    return None


def cached(path, make, wrong=lambda o: None):
    """What path holds (read weights only: tensors, no code) where it exists and `wrong` finds
    nothing amiss with it, else make(), saved there atomically (no path: make()). A damaged file
    (truncated, overwritten, another shape) is made again, with one line on stderr saying so."""
    if path and os.path.exists(path):
        try:
            obj = torch.load(path, weights_only=True)
            why = wrong(obj)
        except Exception as e:  # torch.load's errors on a damaged file are of many types
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else 'unreadable'}"
        if why is None:
            return obj
        print(f"the cache file {path} is damaged ({why}): computing it again", file=sys.stderr, flush=True)
    obj = make()
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(obj, tmp))
    return obj

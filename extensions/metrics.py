"""
A residual energy built from evaluation metrics and fitted without training (Ji et al.,
ICLR 2024). Among all distributions p(y|x) whose expected metrics equal real text's,

    E_x E_{y~p(.|x)}[f_k(x, y)] = E_x E_{y~data}[f_k(x, y)]   for k = 1..K            (constraints)

the one closest to the LM in KL, argmin KL(p || P_LM), is a residual EBM with a *linear* energy

    p*(y|x) = P_LM(y|x) exp(-mu . f(x, y)) / Z_mu(x)                                  (the talk's EBM)

(a global mu, the prefix's own Z_mu(x), as Eq. 2 of the paper). mu minimises the convex dual

    D(mu) = mean_x log Z_mu(x) + mu . mean_x f(x, y_real)                            (dual)

whose gradient, E_data[f] - E_p*[f], is zero exactly when the constraints hold. D(mu) is also
minus the mean log-likelihood of real text under p* (up to log P_LM), so the fit can only help:
by exactly the KL of the projection (the talk's Pythagorean identity)

    H(p_data, p*) = H(p_data, P_LM) - KL(p* || P_LM).                                  (Pythagoras)

Z_mu(x) and E_p*[f] come from n untruncated LM samples per prefix, weighted softmax(-mu . f): the
self-normalised importance sampling behind T_n of Eq. 4.

The metrics f_k(x, y), on token ids (characters or BPE), y the continuation of the prefix x:
  rep-N   sequence repetition: the fraction of y's N-grams that repeat an earlier N-gram of y (SR-4)
  tr-W    token repetition: the fraction of y's tokens found among the W tokens before them (TR-32)
  div     diversity: (1 - rep-2)(1 - rep-3)(1 - rep-4) (DIV)
  coh     coherence: the cosine of the base LM's mean hidden states over x and over y (COH)
  logp    log P_LM(y | x) per token
and any trained energy (nce_train.py) as one more f_k: the talk's aggregation of evaluation functions.
"""

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from energy import load_energy, register_energy_loader
from model import load_lm
from plumbing import file_hash

METRIC_HELP = 'rep-N (sequence repetition), tr-W (token repetition in a window), div, coh, logp'


def parse_metrics(spec, vocab_size, gen_len):
    """The metric names of a comma-separated spec, checked: 'rep-4,tr-32,div,coh,logp'."""
    names = [s for s in spec.split(',') if s]
    if not names:
        raise ValueError(f"--metrics is empty: name some of {METRIC_HELP}")
    if len(set(names)) != len(names):
        raise ValueError(f"--metrics names a metric twice: {spec}")
    for name in names:
        m = re.fullmatch(r'(rep|tr)-([1-9][0-9]*)|div|coh|logp', name)
        if not m:
            raise ValueError(f"unknown metric '{name}': use {METRIC_HELP}")
        n = int(m.group(2)) if m.group(1) == 'rep' else 4 if name == 'div' else 1  # the longest n-gram
        if n > gen_len:
            raise ValueError(f"metric '{name}' needs continuations of at least {n} tokens "
                             f"(--gen_len {gen_len})")
        if vocab_size ** n >= 2 ** 63:
            raise ValueError(f"metric '{name}': {n}-grams of a {vocab_size}-token vocabulary overflow an "
                             f"int64 code: use rep-N with N <= {int(63 / math.log2(vocab_size))}")
    return names


def repetition(y, n, vocab_size):
    """rep-n of each row of y (N, L): 1 - distinct n-grams / n-grams."""
    codes = torch.zeros(y.size(0), y.size(1) - n + 1, dtype=torch.long, device=y.device)
    for i in range(n):  # each n-gram as one integer, base vocab_size
        codes = codes * vocab_size + y[:, i:y.size(1) - n + 1 + i]
    codes = codes.sort(1).values
    distinct = 1 + (codes[:, 1:] != codes[:, :-1]).sum(1)
    return 1 - distinct.double() / codes.size(1)


def token_repetition(x, prefix_len, window):
    """tr-window of each row of x (N, T): the fraction of continuation tokens x_t (t >= prefix_len)
    equal to one of x_{t-window}..x_{t-1} (prefix tokens count as context)."""
    P, T = prefix_len, x.size(1)
    hit = torch.zeros(x.size(0), T - P, dtype=torch.bool, device=x.device)
    for d in range(1, min(window, T - 1) + 1):  # no token has more than T - 1 before it
        start = max(P, d)  # the first position with a token d before it
        hit[:, start - P:] |= x[:, start:] == x[:, start - d:T - d]
    return hit.double().mean(1)


def lm_metrics(lm, x, prefix_len):
    """(coh, logp) of each row of x (N, T) from one forward of the base LM: the cosine of its mean
    final hidden states over the prefix and over the continuation, and log P_LM(y|x) per token."""
    P = prefix_len
    h = lm.hidden(x)  # (N, T, C)
    coh = F.cosine_similarity(h[:, :P].float().mean(1), h[:, P:].float().mean(1), dim=-1)
    logp = F.log_softmax(lm.lm_head(h[:, P - 1:-1]).float(), -1)  # (N, L, V): predicts x_P..x_{T-1}
    logp = logp.gather(-1, x[:, P:, None]).squeeze(-1).mean(1)
    return coh.double(), logp.double()


class MetricEnergy(nn.Module):
    """E(x) = mu . f(x) for the named metrics (and `energies`, {name: Energy}, each one more
    metric): an energy as energy.py's interface asks (forward(idx, prefix_len) -> (B,),
    forward_shared, energies), so that estimate_ppl.py and sample.py use it as any other energy.
    mu = 0: the joint model is P_LM."""

    def __init__(self, names, lm, energies=None, mu=None):
        super().__init__()
        self.names, self.lm = list(names), lm.eval()
        self.energies = nn.ModuleDict(energies or {})
        device = lm.lm_head.weight.device  # mu on the LM's: a MetricEnergy made on a GPU scores there
        mu = torch.zeros(self.num_metrics, dtype=torch.float64) if mu is None else mu.double()
        self.register_buffer('mu', mu.to(device))
        self.config = lm.config  # its block_size bounds the sequences (each energy's is checked on load)

    @property
    def num_metrics(self):
        return len(self.names) + len(self.energies)

    def feature_names(self):
        return self.names + [f'E:{name}' for name in self.energies]

    def num_params(self):
        """What the joint model adds to P_LM: mu, and the trained energies among the metrics."""
        return self.num_metrics + sum(e.num_params() for e in self.energies.values())

    def features(self, x, prefix_len, lm_f=None, known=None):
        """f (N, K) in float64 for the rows of x (N, T), prefix_len tokens of prefix each; lm_f:
        (coh, logp) when the caller has them (forward_shared), else from a forward of the LM;
        known: {energy: (N,)} of energies among the metrics already scored on these rows."""
        y, V = x[:, prefix_len:], self.lm.config.vocab_size
        if lm_f is None and {'coh', 'logp'} & set(self.names):
            lm_f = lm_metrics(self.lm, x, prefix_len)
        cols = []
        for name in self.names:
            kind, _, n = name.partition('-')
            if kind == 'rep':
                cols.append(repetition(y, int(n), V))
            elif kind == 'tr':
                cols.append(token_repetition(x, prefix_len, int(n)))
            elif kind == 'div':
                cols.append(math.prod(1 - repetition(y, k, V) for k in (2, 3, 4)))
            else:
                cols.append(lm_f[0] if kind == 'coh' else lm_f[1])
        known = known or {}
        cols += [known[e] if e in known else e(x, prefix_len).double() for e in self.energies.values()]
        return torch.stack(cols, 1)

    def forward(self, idx, prefix_len, lengths=None):
        assert lengths is None, 'a metric energy scores unpadded rows'
        return self.features(idx, prefix_len) @ self.mu

    def shares_prompt(self, prompt_len, prefix_len):
        return True  # the LM is causal; score_continuations then calls forward_shared

    def forward_shared(self, prompt, tokens, prefix_len, rows=256, known=None):
        """E (B, n) of the sequences [prompt_b; tokens[b, i]]: features_shared(...) @ mu."""
        return self.features_shared(prompt, tokens, prefix_len, rows, known) @ self.mu

    def features_shared(self, prompt, tokens, prefix_len, rows=256, known=None):
        """f (B, n, K) of the sequences [prompt_b; tokens[b, i]] for prompts (B, P') and
        continuations (B, n, L), prefix_len <= P': the base LM runs each prompt once and its n
        continuations on that K/V cache (as energy.Energy.forward_shared; a causal state does not
        depend on later tokens), which is features() of each sequence for a third of the LM's
        work at 128 + 64. Token metrics and trained energies see the whole sequences; known:
        {energy: (B, n)} of energies among the metrics already scored on these continuations."""
        (B, Pp), L, P = prompt.shape, tokens.size(2), prefix_len
        cache = self.lm.new_cache(B, Pp)
        hp = self.lm.hidden(prompt, cache)  # (B, P', C)
        lp = F.log_softmax(self.lm.lm_head(hp[:, P - 1:]).float(), -1)  # (B, P'-P+1, V): from position P-1 on
        prompt_lp = lp[:, :-1].gather(-1, prompt[:, P:, None]).sum((1, 2))  # (B,) the prompt's tokens after P
        pre_mean, mid_sum = hp[:, :P].float().mean(1), hp[:, P:].float().sum(1)  # (B, C) each
        out, done = [], 0
        for t in tokens.split(max(1, rows // B), dim=1):  # (B, m, L)
            m, y = t.size(1), t.flatten(0, 1)
            known_t = {e: v[:, done:done + m].reshape(-1) for e, v in (known or {}).items()}
            done += m
            rep = lambda a: a.repeat_interleave(m, 0)
            own = self.lm.new_cache(B * m, L)
            hc = self.lm.hidden(y, [(k, v, *p) for (k, v), p in zip(own, cache)], pos=Pp)  # (B m, L, C)
            cont_lp = F.log_softmax(self.lm.lm_head(hc[:, :-1]).float(), -1)  # (B m, L-1, V)
            cont_lp = cont_lp.gather(-1, y[:, 1:, None]).sum((1, 2))
            first_lp = rep(lp[:, -1]).gather(-1, y[:, :1]).squeeze(-1)  # the first new token, from the prompt
            logp = (rep(prompt_lp) + first_lp + cont_lp) / (Pp + L - P)
            post_mean = (rep(mid_sum) + hc.float().sum(1)) / (Pp + L - P)  # (B m, C) over positions >= P
            coh = F.cosine_similarity(rep(pre_mean), post_mean, dim=-1)
            f = self.features(torch.cat([rep(prompt), y], 1), P, (coh.double(), logp.double()), known_t)
            out.append(f.view(B, m, -1))
        return torch.cat(out, 1)


# -----------------------------------------------------------------------------
# moment matching: mu from the dual, by Newton's method in float64

def dual(mu, f_data, f_pool, log_p0=None):
    """D(mu) = mean_x log sum_j p0_j exp(-mu . f(x, y_j)) + mu . mean_x f(x, y_real), its gradient
    g = E_data[f] - E_p*[f] (the moment gap) and Hessian H = mean_x Cov_p*(f). f_data (B, K): the real
    continuations' metrics; f_pool (B, n, K): those of a pool per prefix, with weights p0 (B, n):
    1/n each for n untruncated LM samples (the default: Monte Carlo), or P_LM(y|x) itself when the
    pool enumerates every continuation (exact)."""
    log_p0 = -math.log(f_pool.size(1)) if log_p0 is None else log_p0
    lw = log_p0 - f_pool @ mu  # (B, n)
    w = torch.softmax(lw, -1)  # p*(y_j | x) on the pool
    m = torch.einsum('bn,bnk->bk', w, f_pool)  # (B, K) E_p*[f | x]
    c = f_pool - m[:, None]
    H = torch.einsum('bn,bnk,bnl->kl', w, c, c) / f_pool.size(0)
    D = torch.logsumexp(lw, -1).mean() + mu @ f_data.mean(0)
    return D, f_data.mean(0) - m.mean(0), H


def check_feasible(f_data, f_pool, names):
    """The moment constraints can be met only inside what the pools can reach: each target mean
    strictly between the mean of the per-prefix minima and maxima, and every metric varying."""
    target, lo, hi = f_data.mean(0), f_pool.amin(1).mean(0), f_pool.amax(1).mean(0)
    for k, name in enumerate(names):
        if hi[k] - lo[k] <= 1e-12 * (1 + abs(hi[k])):
            raise ValueError(f"metric {name} does not vary among the LM samples of a prefix: "
                             f"drop it from --metrics")
        if not lo[k] < target[k] < hi[k]:
            raise ValueError(f"metric {name}: real text's mean {target[k]:.4g} is outside what the LM "
                             f"samples reach ({lo[k]:.4g} to {hi[k]:.4g}): the constraints cannot be met; "
                             f"drop it or sample more (--fit_samples)")


def fit_mu(f_data, f_pool, names=None, log_p0=None, tol=1e-10, max_steps=100, accept=1e-6):
    """mu* = argmin of the dual (Newton with backtracking; D is convex). Stops when every moment
    gap is below tol x (1 + |target|), or, once no step lowers D any more (float64 sums over a
    large pool stall near 1e-10) or after max_steps steps, below accept x (1 + |target|); each
    verdict is on the gaps at the mu returned. Returns (mu (K,), Newton steps)."""
    f_data, f_pool = f_data.double(), f_pool.double()
    K = f_data.size(1)
    check_feasible(f_data, f_pool, names or [str(k) for k in range(K)])
    mu = torch.zeros(K, dtype=torch.float64, device=f_data.device)
    scale = 1 + f_data.mean(0).abs()
    for step in range(max_steps + 1):  # the last pass only measures the gaps at the last step's mu
        D, g, H = dual(mu, f_data, f_pool, log_p0)
        if (g.abs() <= tol * scale).all():
            return mu, step
        if step == max_steps:
            break
        try:
            delta = -torch.linalg.solve(H, g)  # Newton: H delta = -grad D (and grad D = g)
        except torch.linalg.LinAlgError:
            listed = ', '.join(names or map(str, range(K)))
            raise ValueError(f"the metrics {listed} are linearly dependent on the LM samples (singular "
                             f"covariance): drop one") from None
        t, promised = 1.0, -(g @ delta)  # the fall of D along delta that its slope promises
        while dual(mu + t * delta, f_data, f_pool, log_p0)[0] > D - 0.25 * t * promised and t > 1e-10:
            t /= 2  # Armijo backtracking: keep a quarter of the promise
        if t <= 1e-10:
            break  # D is at its minimum to float precision
        mu = mu + t * delta
    gap = (g.abs() / scale).max().item()
    if gap <= accept:
        return mu, step
    raise ValueError(f"moment matching did not converge in {step} Newton steps (largest gap {gap:.2e}): "
                     f"the metrics may be collinear or the pool too small; drop a metric or raise "
                     f"--fit_samples")


# -----------------------------------------------------------------------------
# checkpoints

def metric_energy_state(energy, lm_path, lm_hash, meta, energy_files, fit):
    """What a metric-energy checkpoint records: the module that registers its loader (load below;
    named where it is not imported), the metric names, mu, the base LM (by hash), the trained
    energies among the metrics (path and hash each) and how mu was fitted."""
    return dict(kind='metric_energy', loader='extensions.metrics', names=energy.names,
                model=dict(mu=energy.mu.cpu()), lm_path=lm_path, lm_hash=lm_hash, meta=meta,
                energies=energy_files, fit=fit)


def load(ckpt, path, lm_path=None, device='cpu'):
    """A MetricEnergy from its checkpoint, checked to be fitted to the LM at lm_path: the loader
    of kind 'metric_energy' that this module registers (energy.py's interface), below."""
    lm_path = lm_path or ckpt['lm_path']
    if file_hash(lm_path) != ckpt['lm_hash']:
        raise ValueError(f"metric energy {path} was fitted to another LM ({ckpt['lm_path']}) than {lm_path}: "
                         f"pass the LM it was fitted with, or fit it again (metric_ebm.py)")
    lm = load_lm(lm_path, device, meta=ckpt['meta'])[0]
    energies = {}
    for name, (e_path, e_hash) in ckpt['energies'].items():
        if file_hash(e_path) != e_hash:
            raise ValueError(f"metric energy {path}: its metric E:{name} ({e_path}) has changed since "
                             f"the fit: fit it again")
        energies[name] = load_energy(e_path, lm_path, device)[0]
    return MetricEnergy(ckpt['names'], lm, energies, ckpt['model']['mu']).to(device).eval()


register_energy_loader('metric_energy', load)  # importing this module plugs the metric energy in

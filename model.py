"""
The base language model P_LM of the residual EBM: a GPT (nanoGPT's names and config), read in
two parts.

The plain path first: GPTConfig; self-attention as nanoGPT writes it (q, k, v, then
scaled_dot_product_attention: a causal mask for the LM, none with causal=False, which gives
energy.py its bidirectional BIT from the same blocks; optionally ALiBi's distance bias); MLP,
Block; the one-token sampling step with the proposal's log-probs (top-k / top-p / temperature);
GPT with its forward, `generate_plain` (nanoGPT's sampling loop), `sequence_logprob`,
log P_LM(x_{p+1..T} | x_{1..p}) of Eq. 2, and `beam_search_plain`, the likely continuations whose
log Z part energy.logz_enumerate scores exactly; then RALM, the residual baseline of Eq. 6.

Then, under one banner, the speed-ups that the method's volume of samples needs (negatives for
NCE, samples for the log Z of Eq. 4, proposals for Algorithm 1), each with what it equals and the
test that proves it: a KV cache, decoding that shares each prompt's K/V across its samples, CPU
bf16 attention by matmuls, and last `generate` (decode_steps; distinct_decode_steps, which runs
each distinct history once, as a peaked LM's samples repeat; then cached_generate),
generate_plain's cached twin, which also returns the log-probs of its tokens under the untruncated
LM and under the proposal; and `beam_search` (cached_beam_search), beam_search_plain's cached twin.

Last, sizing helpers; what both trainers take of nanoGPT's training (AdamW's groups, the cosine
schedule) and this project's stopping rule; and load_lm, a trained P_LM from a checkpoint whose
checks live in plumbing.checkpoints (data.load_lm_and_data: an LM with the data it goes with).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import check_checkpoint, load_weights
from plumbing import checkpoints
from plumbing.checkpoints import check_finite, check_kind, check_vocab, residual_base
from plumbing.guards import check_sampling


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 96
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = False
    causal: bool = True  # False: bidirectional attention (the BIT energy of energy.py)
    alibi: bool = False  # add ALiBi's distance penalty -m_h |i - j| to the attention scores


class SelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.causal, self.alibi = (config.n_head, config.dropout, config.causal,
                                                              config.alibi)

    def forward(self, x, cache=None, pos=0, mask=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). Without a cache the T tokens attend to
        each other (training, scoring: causal for an LM, bidirectional for a BIT); with one they also
        attend to the K/V of the earlier positions it holds (decoding: cached_attention, in the speed
        section). mask: optional boolean (B, 1, T, T_keys), True = may attend (overrides causality)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache is None:
            mask, is_causal = self.attention_mask(T, pos, T, mask, q)
            y = attention(q, k, v, mask, is_causal, self.dropout if self.training else 0.0)
        else:
            y = cached_attention(self, q, k, v, cache, pos, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def attention_mask(self, T, pos, n_keys, mask, q):
        """(mask, is_causal) of T queries at positions pos.. over keys at 0..n_keys-1: the mask given,
        else causality for an LM (is_causal where the kernel aligns it: queries from position 0),
        and ALiBi's distance biases on top (an additive mask, -inf where masked)."""
        is_causal = False
        if mask is None and self.causal and T > 1:
            if pos == 0:
                is_causal = True
            else:  # queries start at pos: is_causal would align them with key 0, so be explicit
                mask = torch.ones(T, pos + T, dtype=torch.bool, device=q.device).tril(diagonal=pos)
        if self.alibi:
            if is_causal:
                mask, is_causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), False
            bias = alibi_bias(self.n_head, pos, T, n_keys, q.dtype, q.device)
            mask = bias if mask is None else bias.masked_fill(~mask, float('-inf'))
        return mask, is_causal


# On a CPU, bf16 is chosen only where its matmuls run on bf16 units; SDPA's CPU kernel does not
# use them (no faster in bf16 than in fp32), two plain matmuls do: bench.py measures the difference
# (matmul_attention, in the speed section below)
CPU_BF16_MATMUL_ATTENTION = True


def attention(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v for q, k, v (B, nh, T, hs): scaled_dot_product_attention
    (on a CPU in bf16, matmul_attention of the speed section, which equals it within bf16 rounding).
    mask: boolean (True = may attend) or additive, broadcast to (B, nh, T, T_keys)."""
    if CPU_BF16_MATMUL_ATTENTION and q.device.type == 'cpu' and q.dtype == torch.bfloat16:
        return matmul_attention(q, k, v, mask, is_causal, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)


def alibi_bias(n_head, pos, T, T_keys, dtype, device):
    """(1, n_head, T, T_keys) ALiBi biases -m_h |i - j| for queries at pos..pos+T-1, with slopes
    m_h = 2^(-8(h+1)/n_head) (Press et al., 2022). A bidirectional body with learned absolute
    positions starts as a bag of tokens and can sit there for hundreds of steps (an MLM at the
    unigram loss); the distance penalty makes it look at its neighbours from the first step."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, n_head + 1, device=device) / n_head)
    dist = (torch.arange(pos, pos + T, device=device)[:, None]
            - torch.arange(T_keys, device=device)[None]).abs()
    # 4-D: with a 3-D mask, CPU scaled_dot_product_attention falls back to its 3x slower math path
    return (-slopes[:, None, None] * dist).to(dtype)[None]


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, pos=0, mask=None):
        x = x + self.attn(self.ln_1(x), cache, pos, mask)
        return x + self.mlp(self.ln_2(x))


# sampling one token: the draw of generate_plain (and of the cached generate below)

def proposal_logprobs(logits, top_k=None, top_p=None, temperature=1.0):
    """Log-probs of the distribution that sampling draws from: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches top_p). Removed tokens get -inf."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already enough
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float('-inf'))
    return F.log_softmax(logits, dim=-1)


def sample_next(logits, top_k=None, top_p=None, temperature=1.0, generator=None):
    """One sampling step. Returns (token, log P_LM(token), log q(token)) for each row of logits."""
    logp = F.log_softmax(logits.float(), dim=-1)
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1), torch.zeros_like(tok, dtype=logp.dtype)
    logq = logp if (top_k, top_p, temperature) == (None, None, 1.0) else \
        proposal_logprobs(logits, top_k, top_p, temperature)
    tok = torch.multinomial(logq.exp(), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), logq.gather(-1, tok[:, None]).squeeze(-1)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embeddings
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def hidden(self, idx, cache=None, pos=0, mask=None):
        """Final (layer-normed) hidden states (B, T, C) of tokens idx at positions pos..pos+T-1.
        cache: None (the plain forward), or one KVCache per layer (the speed section)."""
        T = idx.size(1)
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens is longer than the model's "
                             f"block_size {self.config.block_size}: use a shorter prompt/length")
        positions = torch.arange(pos, pos + T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, C)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if cache is None else cache[i], pos, mask)
        return self.transformer.ln_f(x)

    def logits(self, idx, cache=None, pos=0, from_pos=0):
        """Next-token logits from position from_pos on (earlier positions skip the LM head)."""
        return self.lm_head(self.hidden(idx, cache, pos)[:, from_pos:])  # (B, T - from_pos, V)

    def forward(self, idx, targets=None, cache=None, pos=0):
        logits = self.logits(idx, cache, pos)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate_plain(self, idx, max_new_tokens, num_samples=1, top_k=None, top_p=None, temperature=1.0,
                       generator=None):
        """Ancestral sampling as nanoGPT writes it: at every step each of the B * num_samples rows
        runs the whole model over its whole sequence, and its next token is drawn from the last
        position's distribution (sample_next). Returns the new tokens (B, num_samples, L)."""
        x = idx.repeat_interleave(num_samples, 0)  # (B n, P): the samples of a prompt are consecutive rows
        for _ in range(max_new_tokens):
            logits = self.logits(x, from_pos=x.size(1) - 1)[:, -1]  # (B n, V)
            tok = sample_next(logits, top_k, top_p, temperature, generator)[0]  # (B n,)
            x = torch.cat([x, tok[:, None]], dim=1)
        return x[:, idx.size(1):].view(idx.size(0), num_samples, max_new_tokens)

    # generate_plain's cached twin, in the speed section below its banner (these two only name its functions)

    def generate(self, idx, max_new_tokens, num_samples=1, top_k=None, top_p=None, temperature=1.0,
                 return_proposal=False, generator=None, max_rows=512):
        """generate_plain's draws, each prompt run once, with their log-probs: cached_generate."""
        return cached_generate(self, idx, max_new_tokens, num_samples, top_k, top_p, temperature,
                               return_proposal, generator, max_rows)

    def new_cache(self, batch_size, length):
        """Empty (k, v) buffers of each layer for decoding: empty_cache."""
        return empty_cache(self, batch_size, length)

    def sequence_logprob(self, idx, start, per_token=False):
        """log P_LM(x_start..x_{T-1} | x_0..x_{start-1}) for each row of idx (B, T): the first
        factor of Eq. 2. Only positions that predict a scored token go through the LM head.
        Returns (B,) sums in float32, and also the (B, T-start) per-token terms if per_token."""
        if not 1 <= start < idx.size(1):
            raise ValueError(f"start={start} must be in [1, {idx.size(1) - 1}] "
                             f"for sequences of length {idx.size(1)}")
        logp = F.log_softmax(self.logits(idx[:, :-1], from_pos=start - 1).float(), dim=-1)
        tok_logp = logp.gather(-1, idx[:, start:, None]).squeeze(-1)
        return (tok_logp.sum(1), tok_logp) if per_token else tok_logp.sum(1)

    @torch.no_grad()
    def beam_search_plain(self, idx, max_new_tokens, width):
        """The `width` continuations of highest log P_LM that beam search finds for each prompt of
        idx (B, P): tokens (B, width, L) and their log P_LM (B, width) in float64, best first. Not
        sampled: a fixed set of likely continuations, which log Z's exact part (energy.logz_enumerate)
        scores exactly. Each step reruns the whole sequences, as generate_plain does."""
        B, P = idx.shape
        x, score = idx[:, None], torch.zeros(B, 1, dtype=torch.float64, device=idx.device)  # one beam
        for _ in range(max_new_tokens):
            b, T = x.size(1), x.size(2)
            logits = self.logits(x.flatten(0, 1), from_pos=T - 1)[:, -1]
            logp = F.log_softmax(logits.double(), -1).view(B, b, -1)
            V = logp.size(-1)
            score, i = (score[..., None] + logp).flatten(1).topk(min(width, b * V), 1)  # (B, width')
            x = torch.cat([x.gather(1, (i // V)[..., None].expand(-1, -1, T)), (i % V)[..., None]], 2)
        return x[..., P:], score

    def beam_search(self, idx, max_new_tokens, width):
        """beam_search_plain's beams, each prompt run once and each new token once: cached_beam_search."""
        return cached_beam_search(self, idx, max_new_tokens, width)


class RALM(GPT):
    """The residual autoregressive baseline of Eq. 6: log P_RALM(x_t|x_<t) = log P_LM(x_t|x_<t) +
    log P_phi(x_t|x_<t) + const. Adding the logits of the frozen base LM and of this GPT (phi)
    before one softmax is exactly that: each log-softmax differs from its logits by a per-position
    constant. phi starts from the usual random init: zeroing its output layer (to start exactly at
    the base LM) would also zero its tied input embedding. Both were tried on Shakespeare and
    ended alike (val 1.9016 vs 1.9010 nats/char, base LM 1.9050).
    Sampling, caching and sequence_logprob all go through `logits`, so they use the combination."""

    def __init__(self, config, base):
        super().__init__(config)
        if base.config.vocab_size != config.vocab_size or base.config.block_size < config.block_size:
            raise ValueError("a RALM residual needs the base LM's vocabulary and at most its block_size")
        self.base = base.requires_grad_(False).eval()

    def train(self, mode=True):
        super().train(mode)
        self.base.eval()  # the base LM stays frozen, dropout included
        return self

    def logits(self, idx, cache=None, pos=0, from_pos=0):
        n = self.config.n_layer
        residual, base = (None, None) if cache is None else (cache[:n], cache[n:])
        return super().logits(idx, residual, pos, from_pos) + self.base.logits(idx, base, pos, from_pos)

    def new_cache(self, batch_size, length):
        return super().new_cache(batch_size, length) + self.base.new_cache(batch_size, length)

    def residual_state_dict(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith('base.')}


# ---- speed: what each variant equals, and the test that proves it ----
#
# - SelfAttention with a cache (cached_attention over a KVCache, GPT.new_cache): decoding at
#   positions pos.. equals the last rows of the plain forward over the whole sequence,
#   one token or several at a time: test_cached_decoding_matches_full_forward,
#   test_cached_decoding_float64 (to 1e-12: only the summation order differs).
# - shared_prompt_attention: equals attention over each row's own copy of its prompt's K/V
#   followed by its own: test_shared_prompt_attention_reference (float64, written out), and
#   decoding with it equals the copy-per-sample decoding it replaced:
#   test_shared_prompt_decode_matches_copied_cache.
# - matmul_attention (a CPU in bf16, CPU_BF16_MATMUL_ATTENTION): equals scaled_dot_product_attention,
#   outputs and gradients, within bf16 rounding: test_cpu_bf16_attention_reference.
# - GPT.generate (cached_generate, distinct_decode_steps): draws the very tokens of generate_plain
#   from the same generator: test_generate_plain_and_cached_draw_the_same; in chunks of max_rows
#   rows, its log-probs are sequence_logprob's: test_generate_shapes_chunking_and_prompt_rows.
#   distinct_decode_steps, each distinct history run once, draws the tokens of decode_steps on every
#   row, with their log-probs: test_distinct_decoding_draws_every_row_s_tokens (samples that repeat),
#   over prompt groups of unequal size: test_shared_prompt_attention_unequal_groups.
# - GPT.beam_search (cached_beam_search): beam_search_plain's beams and log-probs, its caches'
#   rows following each beam's parent: test_beam_search_plain_and_cached_agree.

class KVCache(NamedTuple):
    """One layer's decoding cache. k, v (N, nh, S, hs): the buffers each step writes its keys and
    values into, at positions start..start+S-1 of each of the N rows. prompt_k, prompt_v
    (n_prompts, nh, P, hs), as generate decodes: positions 0..P-1 of n_prompts prompts, each
    shared (not copied) by N / n_prompts consecutive rows; start is then P, else 0. Plain (k, v)
    and (k, v, prompt_k, prompt_v) tuples are read as the same fields."""
    k: torch.Tensor
    v: torch.Tensor
    prompt_k: Optional[torch.Tensor] = None
    prompt_v: Optional[torch.Tensor] = None
    prompt_rows: Optional[tuple] = None  # groups of unequal size: group_slots


def empty_cache(model, batch_size, length):
    """Empty (k, v) buffers for each layer, in the dtype attention computes in (under autocast,
    a float32 cache would be cast at every decoding step)."""
    c = model.config
    shape = (batch_size, c.n_head, length, c.n_embd // c.n_head)
    p = model.lm_head.weight
    dtype = (torch.get_autocast_dtype(p.device.type) if torch.is_autocast_enabled(p.device.type)
             else p.dtype)
    return [(torch.empty(shape, dtype=dtype, device=p.device),
             torch.empty(shape, dtype=dtype, device=p.device)) for _ in range(c.n_layer)]


def cached_attention(attn, q, k, v, cache, pos, mask):
    """SelfAttention `attn` with a cache (KVCache): this step's keys and values are written into
    it, and the queries at pos..pos+T-1 attend over every position up to theirs."""
    T = q.size(2)
    k_buf, v_buf, prompt_k, prompt_v, prompt_rows = KVCache(*cache)
    start = 0 if prompt_k is None else prompt_k.size(2)  # positions before start: the shared prompt's
    k_buf[:, :, pos - start:pos - start + T] = k
    v_buf[:, :, pos - start:pos - start + T] = v
    k, v = k_buf[:, :, :pos - start + T], v_buf[:, :, :pos - start + T]  # (B, nh, pos - start + T, hs)
    mask, is_causal = attn.attention_mask(T, pos, start + k.size(2), mask, q)
    if prompt_k is not None:
        return shared_prompt_attention(q, k, v, prompt_k, prompt_v, mask, prompt_rows)
    return attention(q, k, v, mask, is_causal, attn.dropout if attn.training else 0.0)


def shared_prompt_attention(q, k, v, prompt_k, prompt_v, mask=None, prompt_rows=None):
    """softmax(q [prompt_k; k]^T / sqrt(hs) + mask) [prompt_v; v] for q (N, nh, T, hs) and k, v
    (N, nh, S, hs) whose rows come in n_prompts groups of n = N / n_prompts, group b reading prompt
    b of prompt_k/v (n_prompts, nh, P, hs). The prompt part is one matmul per prompt over the
    queries of all its rows, with no per-row copy of its K/V (copying it per row and reading the
    copies back made attention over half of a decoding step); one softmax over both parts keeps it
    exact. prompt_rows: groups of unequal size (distinct_decode_steps), as group_slots gives them:
    each prompt's queries are padded with zeros to the largest group's number, never its K/V.
    mask: (..., T, P + S), boolean (True = may attend) or additive."""
    (N, nh, T, hs), (n_prompts, P) = q.shape, prompt_k.shape[::2]
    q = q * hs ** -0.5
    group, slot, n = prompt_rows or (None, None, N // n_prompts)  # n: rows per prompt, or the most
    grouped = lambda x: (x.view(n_prompts, n, *x.shape[1:]) if group is None
                         else x.new_zeros(n_prompts, n, *x.shape[1:]).index_put_((group, slot), x))
    rows = lambda x: x.reshape(N, *x.shape[2:]) if group is None else x[group, slot]
    s_prompt = rows(torch.einsum('bnhtd,bhpd->bnhtp', grouped(q), prompt_k))  # (N, nh, T, P)
    s_rows = (k @ q.transpose(-1, -2)).transpose(-1, -2)  # as q @ k^T, 2-3x slower on the strided cache view
    s = torch.cat([s_prompt, s_rows], dim=-1)
    if mask is not None:
        s = s.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else s + mask
    a = s.softmax(-1).to(v.dtype)
    return rows(torch.einsum('bnhtp,bhpd->bnhtd', grouped(a[..., :P]), prompt_v)) + a[..., P:] @ v


def group_slots(prompt_rows, n_prompts):
    """shared_prompt_attention's prompt_rows for rows sorted by their prompt, prompt_rows (N,): each
    row's (prompt, place among its prompt's rows), and the largest group's size."""
    counts = torch.bincount(prompt_rows, minlength=n_prompts)
    first = counts.cumsum(0) - counts  # each prompt's first row
    return prompt_rows, torch.arange(len(prompt_rows), device=prompt_rows.device) - first[prompt_rows], \
        int(counts.max())


def matmul_attention(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """attention() as two matmuls, for a CPU in bf16: a bf16 training step of the BIT 1.5x, of the
    LM 1.2x faster than SDPA's; its scores are then rounded to bf16, as any bf16 matmul's output."""
    s = (q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else s + mask
    a = s.softmax(-1)
    return (F.dropout(a, dropout_p) if dropout_p else a).to(v.dtype) @ v


def decode_steps(model, logits, cache, pos, steps, top_k, top_p, temperature, generator):
    """`steps` tokens for each row of logits (N, V), the first drawn from them and each next one
    from the model's logits through the cache (positions pos..). Returns (tokens, logp, logq),
    each (N, steps). Every row runs at every step (generate runs each distinct history once:
    distinct_decode_steps, tested equal to this)."""
    N = logits.size(0)
    tokens = torch.empty(N, steps, dtype=torch.long, device=logits.device)
    logp, logq = (torch.empty(N, steps, device=logits.device) for _ in range(2))
    for t in range(steps):
        tok, logp[:, t], logq[:, t] = sample_next(logits, top_k, top_p, temperature, generator)
        tokens[:, t] = tok
        if t + 1 < steps:
            logits = model(tok[:, None], cache=cache, pos=pos + t)[0][:, -1]
    return tokens, logp, logq


def distinct_decode_steps(model, logits, n, prompt_cache, steps, top_k, top_p, temperature, generator):
    """decode_steps' draws for n samples of each prompt whose K/V prompt_cache holds (logits (B, V):
    its last position's), the model run once per distinct history: samples whose tokens so far are
    equal have equal next-token logits, so each draws its token from its history's row (the very
    call decode_steps makes on all B n rows, the same generator), and only the distinct (history,
    token) pairs go on through the model. A peaked LM repeats itself: its 16 samples of an addition
    problem hold about 2 distinct histories. Returns (tokens, logp, logq), each (B n, steps)."""
    (B, V), P = logits.shape, prompt_cache[0][0].size(2)
    hist = torch.arange(B, device=logits.device).repeat_interleave(n)  # each sample's history (row)
    prompt_rows, rows_cache = torch.arange(B, device=logits.device), model.new_cache(B, steps)
    tokens = torch.empty(B * n, steps, dtype=torch.long, device=logits.device)
    logp, logq = (torch.empty(B * n, steps, device=logits.device) for _ in range(2))
    for t in range(steps):
        tokens[:, t], logp[:, t], logq[:, t] = sample_next(logits[hist], top_k, top_p, temperature, generator)
        if t + 1 == steps:
            break
        pair, hist = torch.unique(hist * V + tokens[:, t], return_inverse=True)  # sorted: by prompt still
        parent = pair // V
        if len(pair) > len(prompt_rows):  # a history branched: each new row copies its parent's cache
            rows_cache, prompt_rows = follow_parents(rows_cache, parent), prompt_rows[parent]
        rows = None if len(pair) == B * n else group_slots(prompt_rows, B)  # None: n rows a prompt
        cache = [KVCache(k, v, *prompt, rows) for (k, v), prompt in zip(rows_cache, prompt_cache)]
        logits = model((pair % V)[:, None], cache=cache, pos=P + t)[0][:, -1]
    return tokens, logp, logq


@torch.no_grad()
def cached_generate(model, idx, max_new_tokens, num_samples=1, top_k=None, top_p=None, temperature=1.0,
                    return_proposal=False, generator=None, max_rows=512):
    """GPT.generate: generate_plain's draws, num_samples continuations of each prompt of idx (B, P),
    with each prompt run once and each distinct new token once (distinct_decode_steps). A prompt's
    K/V cache is shared, not copied, by its samples' rows, in chunks of at most max_rows samples (so
    memory stays bounded), whose own caches hold only their new tokens. Returns (tokens, logp[,
    logq]), each (B, num_samples, L): log P_LM of each token under the untruncated LM at temperature
    1 (what Eq. 2-5 need), and log q under the distribution sampled from (top-k/top-p/temperature;
    0: greedy), which resampling corrects by. With top_k, top_p None and temperature 1 it is exact
    ancestral sampling from P_LM."""
    B, P = idx.shape
    check_sampling(model.config, P, max_new_tokens, top_k, top_p, temperature)
    prompt_cache = model.new_cache(B, P)
    logits = model.logits(idx, prompt_cache, from_pos=P - 1)[:, -1]  # (B, V): the head at the last position
    per_chunk = max(1, max_rows // B)  # samples of each prompt per chunk
    chunks = []
    for s in range(0, num_samples, per_chunk):
        n = min(per_chunk, num_samples - s)
        out = distinct_decode_steps(model, logits, n, prompt_cache, max_new_tokens, top_k, top_p,
                                    temperature, generator)
        chunks.append([t.view(B, n, max_new_tokens) for t in out])
    tokens, logp, logq = (torch.cat(ts, dim=1) for ts in zip(*chunks))
    return (tokens, logp, logq) if return_proposal else (tokens, logp)


@torch.no_grad()
def cached_beam_search(model, idx, max_new_tokens, width):
    """GPT.beam_search: beam_search_plain's steps, with each prompt's K/V computed once and shared by
    its beams (as cached_generate's samples share it) and each beam's new tokens cached; after each
    step a beam's cache rows are copied from its parent's. On addition's problems (a prompt of 14,
    8 new tokens) a step of the plain search reruns every beam's whole sequence."""
    B, P = idx.shape
    prompt_cache = model.new_cache(B, P)
    logits = model.logits(idx, prompt_cache, from_pos=P - 1)[:, -1]  # (B, V)
    score, b = torch.zeros(B, 1, dtype=torch.float64, device=idx.device), 1  # one beam
    x = idx.new_empty(B, 1, 0)
    rows_cache = model.new_cache(B, max_new_tokens)
    for t in range(max_new_tokens):
        logp = F.log_softmax(logits.double(), -1).view(B, b, -1)
        V = logp.size(-1)
        score, i = (score[..., None] + logp).flatten(1).topk(min(width, b * V), 1)  # (B, width')
        parent, b = i // V, i.size(1)
        x = torch.cat([x.gather(1, parent[..., None].expand(-1, -1, t)), (i % V)[..., None]], 2)
        if t + 1 == max_new_tokens:
            break
        rows = parent + torch.arange(B, device=idx.device)[:, None] * logp.size(1)  # the parents' rows
        rows_cache = follow_parents(rows_cache, rows.flatten())
        cache = [KVCache(k, v, *prompt) for (k, v), prompt in zip(rows_cache, prompt_cache)]
        logits = model(x[:, :, -1].reshape(B * b, 1), cache=cache, pos=P + t)[0][:, -1]
    return x, score


def follow_parents(cache, rows):
    """Each layer's (k, v) cache rows for the new beams: row j a copy of its parent's, rows[j]."""
    return [(k[rows], v[rows]) for k, v in cache]


# -----------------------------------------------------------------------------
# sizing: the width that matches a parameter count (BALM)

def width_for_params(target, n_layer, n_head, vocab_size, block_size, bias=False, head_multiple=16):
    """The n_embd whose GPT has the parameter count closest to target, among widths whose head
    size is a multiple of head_multiple (what matmul units run well): how BALM is sized to match
    base LM + energy. Counted on the meta device, so it is free."""
    def count(c):
        with torch.device('meta'):
            return GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                                 n_head=n_head, n_embd=c, bias=bias)).num_params()
    widths = range(n_head * head_multiple, 8192 + 1, n_head * head_multiple)
    lo, hi = 0, len(widths) - 1
    while lo < hi:  # the count grows with the width: bisect for the first width >= target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(widths[mid]) < target else (lo, mid)
    cands = [widths[i] for i in (lo - 1, lo) if 0 <= i < len(widths)]
    return min(cands, key=lambda c: abs(count(c) - target))


# -----------------------------------------------------------------------------
# training: nanoGPT's optimiser and schedule, and the stopping rule, for both trainers

def configure_optimizer(model, lr, weight_decay, betas, device):
    """AdamW with weight decay on matrices only (nanoGPT's configure_optimizers), over the
    trainable parameters (a RALM's base LM stays frozen)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.startswith('cuda'))


def get_lr(it, lr, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup, then cosine decay from lr to min_lr at lr_decay_iters (nanoGPT's)."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def stopped_early(trail, patience, min_rel_delta=0.0):
    """Early stopping, this project's protocol for every model it trains (the paper trains for
    fixed budgets): trail holds the best selection figure (lower is better) after each evaluation;
    stop once it has improved by less than min_rel_delta, relative, over the last `patience`
    evaluations. Measured from the best so far, so a run still improving by small steps that add
    up goes on; with min_rel_delta 0, stop when the best is `patience` evaluations old."""
    if not patience or len(trail) <= patience:
        return False
    old, new = trail[-1 - patience], trail[-1]
    return not new < old - (min_rel_delta * abs(old) if math.isfinite(old) else 0)


# -----------------------------------------------------------------------------
# loading an LM: the method's entry point to a trained P_LM (its checks: plumbing.checkpoints)

def load_checkpoint(path):
    """A rebm checkpoint (plumbing.checkpoints.load_checkpoint: weights_only=True), its entries, config
    and size checked against GPTConfig before a model is built from it (check_checkpoint)."""
    ckpt = checkpoints.load_checkpoint(path)
    check_checkpoint(ckpt, path, GPTConfig)
    return ckpt


def load_lm(path, device='cpu', meta=None, kind='lm'):
    """A GPT (or RALM) from a train_lm.py checkpoint, in eval mode; with meta, checked against
    that data. kind='mlm' loads a masked-LM body instead."""
    ckpt = load_checkpoint(path)
    check_kind(ckpt, path, kind)
    if meta is not None:
        check_vocab(ckpt, meta, path)
    config = GPTConfig(**ckpt['config'])
    if ckpt.get('residual_of'):  # a RALM: its base LM is rebuilt from its own checkpoint
        model = RALM(config, load_lm(residual_base(ckpt, path))[0])
        missing = load_weights(model, ckpt['model'], path, strict=False).missing_keys
        assert all(k.startswith('base.') for k in missing), missing
    else:
        model = GPT(config)
        load_weights(model, ckpt['model'], path)
    check_finite(model, path)
    return model.to(device).eval(), ckpt

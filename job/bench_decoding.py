"""job/bench.py's sections that decode: sampling, beam search, each distinct history once, and log Z
estimation (estimation, estimate), each against its naive baseline in the same process. Run them with
`python -m job.bench`; what each measures is in its docstring there."""

import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from data import get_batch, load_split
from energy import Energy, joint_sample, logz_bounds, sample_log_weights, score, score_continuations
from job.bench_tools import DTYPES, forward_flops_per_token, lm_config, log, peak_rss_mb, timeit
from job.configs import ADDITION
from model import GPT, GPTConfig, alibi_bias, decode_steps, distinct_decode_steps
from plumbing import Precision, autocast


@torch.no_grad()
def bench_sampling(args, device, meta, dtypes, peak_fp32):
    B, P, K, L = args.num_prefixes, args.prefix_len, args.num_samples, args.gen_len
    torch.manual_seed(args.seed)
    model = GPT(lm_config(args, meta)).to(device).eval()  # random weights: speed does not depend on them
    val = load_split(args.data_dir, 'val', meta)
    offsets = torch.randint(len(val) - P - 1, (B,), generator=torch.Generator().manual_seed(args.seed))
    prompts = get_batch(val, offsets, P, device)[0]
    g = torch.Generator(device).manual_seed(args.seed)

    def cached():
        model.generate(prompts, L, num_samples=K, generator=g)

    def cached_bf16():
        with autocast(device, torch.bfloat16):
            model.generate(prompts, L, num_samples=K, generator=g)

    fns = dict(cached=cached, cached_bf16=cached_bf16) if 'bf16' in dtypes else dict(cached=cached)
    dt = timeit(fns, device, args.warmup, args.repeats)
    t_cached = dt['cached']
    log(args, f"  naive sampler: {B * K} rows x {L} full forwards...")
    naive = lambda: model.generate_plain(prompts, L, num_samples=K, generator=g)  # nanoGPT's loop, no cache
    t_naive = timeit(dict(naive=naive), device, 0, args.naive_repeats)['naive']  # too slow to warm up
    n = B * K
    # token-forwards each sampler runs (prompt + the L-1 fed-back tokens), ~ their FLOP ratio
    work_cached = B * P + n * (L - 1)
    work_naive = n * sum(P + t for t in range(L))
    res = dict(
        sampling_samples_per_s_cached=n / t_cached, sampling_tokens_per_s_cached=n * L / t_cached,
        sampling_samples_per_s_naive=n / t_naive, sampling_tokens_per_s_naive=n * L / t_naive,
        sampling_speedup=t_naive / t_cached,
        sampling_token_forwards_ratio=work_naive / work_cached,
        # MFU: the cached sampler's token-forwards at their mean context, against the fp32 matmul peak
        sampling_mfu_cached=work_cached * forward_flops_per_token(
            model.config, model.num_params(non_embedding=True), P + L // 2) / t_cached / (peak_fp32 * 1e9),
    )
    if 'bf16' in dtypes:
        t_bf16 = dt['cached_bf16']
        res.update(sampling_samples_per_s_cached_bf16=n / t_bf16,
                   sampling_tokens_per_s_cached_bf16=n * L / t_bf16,
                   sampling_bf16_speedup=t_cached / t_bf16)
    return res


BEAM_TOKENS = 8  # new tokens of a beam search: addition's answer (the known set of its log Z, EXO's set)


def bench_beam(args, device, meta):
    """GPT.beam_search (each prompt run once, each beam's new tokens cached) against beam_search_plain
    (every beam's whole sequence rerun at each step), --beam beams of each of --num_prefixes prompts."""
    B, P, W, L = args.num_prefixes, args.prefix_len, args.beam, BEAM_TOKENS
    torch.manual_seed(args.seed)
    model = GPT(lm_config(args, meta)).to(device).eval()
    val = load_split(args.data_dir, 'val', meta)
    offsets = torch.randint(len(val) - P - 1, (B,), generator=torch.Generator().manual_seed(args.seed))
    prompts = get_batch(val, offsets, P, device)[0]
    t = timeit(dict(cached=lambda: model.beam_search(prompts, L, W)), device, args.warmup, args.repeats)
    naive = lambda: model.beam_search_plain(prompts, L, W)
    t.update(timeit(dict(naive=naive), device, 0, args.naive_repeats))
    same = torch.equal(model.beam_search(prompts, L, W)[0], naive()[0])
    return dict(beam_prompts_per_s_cached=B / t['cached'], beam_prompts_per_s_naive=B / t['naive'],
                beam_speedup=t['naive'] / t['cached'], beam_same_beams=same)


# a negatives chunk of the addition job (ADDITION's LM shape, its 13 tokens): 186 prompts of 14 tokens,
# 16 samples of 8 (2**16 tokens)
DISTINCT = dict(prompts=186, prompt_len=14, new_tokens=8, samples=16, vocab_size=13, sharpen=12.0)


@torch.no_grad()
def bench_distinct(args, device, dtypes):
    """GPT.generate's decoding (model.distinct_decode_steps: each distinct history through the model
    once) against decode_steps on every row, the same draws, at the addition job's negatives chunk
    (DISTINCT), in bf16 where it runs natively: a random LM, whose samples are all distinct (what
    the bookkeeping costs), and that LM sharpened (its final layer norm's gain times 12), whose
    samples repeat as a trained addition LM's do (16 samples of a problem: about 2 distinct); and a
    BIT scoring the sharpened LM's samples, each distinct sequence once (energy.score_continuations)
    against every one (energy.score)."""
    B, P, L, n, V = (DISTINCT[k] for k in ('prompts', 'prompt_len', 'new_tokens', 'samples', 'vocab_size'))
    B = 16 if args.quick else B
    c = ADDITION['lm']
    config = GPTConfig(block_size=P + L, vocab_size=V, n_layer=c['n_layer'], n_head=c['n_head'],
                       n_embd=c['n_embd'])
    prompts = torch.randint(V, (B, P), generator=torch.Generator().manual_seed(args.seed)).to(device)
    res = {}
    for name, gain in (('random', 1.0), ('sharpened', DISTINCT['sharpen'])):
        torch.manual_seed(args.seed)
        lm = GPT(config).to(device).eval()
        lm.transformer.ln_f.weight.mul_(gain)

        def decode(steps):
            with autocast(device, torch.bfloat16) if 'bf16' in dtypes else nullcontext():
                prompt_cache = lm.new_cache(B, P)
                logits = lm.logits(prompts, prompt_cache, from_pos=P - 1)[:, -1]
                g = torch.Generator(device).manual_seed(args.seed)
                if steps is distinct_decode_steps:
                    return steps(lm, logits, n, prompt_cache, L, None, None, 1.0, g)[0]
                cache = [(k, v, *p) for (k, v), p in zip(lm.new_cache(B * n, L), prompt_cache, strict=True)]
                return steps(lm, logits.repeat_interleave(n, 0), cache, P, L, None, None, 1.0, g)[0]
        fns = dict(distinct=lambda: decode(distinct_decode_steps), every_row=lambda: decode(decode_steps))
        t = timeit(fns, device, args.warmup, args.repeats)
        tokens = decode(distinct_decode_steps)
        res.update({f'distinct_{name}_samples_per_s': B * n / t['distinct'],
                    f'distinct_{name}_samples_per_s_every_row': B * n / t['every_row'],
                    f'distinct_{name}_speedup': t['every_row'] / t['distinct'],
                    f'distinct_{name}_continuations_per_prompt':
                        sum(len(torch.unique(row, dim=0)) for row in tokens.view(B, n, L)) / B,
                    f'distinct_{name}_same_tokens': torch.equal(tokens, decode(decode_steps))})
    # a BIT of the LM's shape scoring those samples: each distinct sequence once, or every one
    bit = Energy(GPTConfig(**{**vars(config), 'causal': False})).to(device).eval()
    x = torch.cat([prompts[:, None].expand(-1, n, -1), tokens.view(B, n, L)], 2)
    fns = dict(distinct=lambda: score_continuations(bit, prompts, tokens.view(B, n, L), P, nullcontext()),
               every_row=lambda: score(bit, x.flatten(0, 1), P, nullcontext()))
    t = timeit(fns, device, args.warmup, args.repeats)
    res['distinct_score_speedup'] = t['every_row'] / t['distinct']
    return res


def bench_estimation(args, device, meta):
    """log Z estimation (LM samples drawn and scored per second) and joint sampling (Algorithm 1,
    top-k 10) at n = 10^3 and 10^4 samples for one prefix, with the process's peak memory after
    each: chunked, both should stay flat as n grows. A small model (2 layers, 128 wide) and
    prefix 64 + continuation 32 keep n = 10^4 affordable."""
    P, L = 64, 32
    torch.manual_seed(args.seed)
    lm = GPT(GPTConfig(block_size=P + L, vocab_size=meta['vocab_size'], n_layer=2, n_head=4,
                       n_embd=128)).to(device).eval()
    energy = Energy(GPTConfig(block_size=P + L, vocab_size=meta['vocab_size'] + 1, n_layer=2, n_head=4,
                              n_embd=128, causal=False)).to(device).eval()
    prefix = torch.randint(meta['vocab_size'], (1, P), device=device)
    g = torch.Generator(device).manual_seed(args.seed)
    res = {}
    for n in ((10 ** 3,) if args.quick else (10 ** 3, 10 ** 4)):
        t0 = time.perf_counter()
        logz_bounds(sample_log_weights(lm, [energy], prefix, L, n, Precision(), g)[0])
        res[f'logz_samples_per_s_n{n}'] = n / (time.perf_counter() - t0)
        res[f'logz_peak_rss_mb_n{n}'] = peak_rss_mb()
        t0 = time.perf_counter()
        joint_sample(lm, energy, prefix, n, L, top_k=10, generator=g)
        res[f'joint_samples_per_s_n{n}'] = n / (time.perf_counter() - t0)
        res[f'joint_peak_rss_mb_n{n}'] = peak_rss_mb()
    return res


@torch.no_grad()
def copy_cache_log_weights(lm, energy, prefixes, L, n, generator, max_rows):
    """The baseline: log w = -E(x) as commit 68ace2e computed it. Per chunk of max_rows
    sequences, the prefixes through the LM again, their K/V cache copied to every sample's row,
    attention by scaled_dot_product_attention over the copies, one energy forward per chunk."""
    B, P = prefixes.shape
    per = max(1, max_rows // B)
    out = []
    for s in range(0, n, per):
        c = min(per, n - s)
        cache = lm.new_cache(B, P + L)
        logits = lm(prefixes, cache=cache)[0][:, -1]
        rows = [(k.repeat_interleave(c, 0), v.repeat_interleave(c, 0)) for k, v in cache]
        tokens = decode_steps(lm, logits.repeat_interleave(c, 0), rows, P, L, None, None, 1.0,
                              generator)[0]
        out.append(-energy(torch.cat([prefixes.repeat_interleave(c, 0), tokens], 1), P).view(B, c))
    return torch.cat(out, 1)


def bench_estimate(args, device, meta, dtypes):
    """estimate_ppl.py's log Z loop at its default sizes, fp32: sample_log_weights (the prompt K/V
    shared by its samples, energies in cache-sized blocks) vs copy_cache_log_weights, runs
    alternating. Both energies use today's 4-D ALiBi bias, so the ratio leaves out what that fix
    alone gave the energy (alibi_sdpa_4d_speedup). Also the energy forward alone, fp32 vs bf16."""
    B, P, L, n = args.chunk, args.prefix_len, args.gen_len, args.logz_samples
    torch.manual_seed(args.seed)
    lm = GPT(lm_config(args, meta)).to(device).eval()
    energy = Energy(GPTConfig(block_size=P + L, vocab_size=meta['vocab_size'] + 1, n_layer=args.n_layer,
                              n_head=args.n_head, n_embd=args.energy_embd, causal=False,
                              alibi=True)).to(device).eval()
    prefixes = torch.randint(meta['vocab_size'], (B, P), device=device)
    g = torch.Generator(device).manual_seed(args.seed)
    fns = dict(shared=lambda: sample_log_weights(lm, [energy], prefixes, L, n, Precision(), g,
                                                 args.max_rows),
               copy_cache=lambda: copy_cache_log_weights(lm, energy, prefixes, L, n, g, args.max_rows))
    runs = 1 if args.quick else min(args.repeats, 2)  # runs of seconds to tens: the first is warm enough
    log(args, f"  {B} prefixes x {n} samples, {len(fns)} variants x {runs} runs...")
    dt = timeit(fns, device, 0, runs)
    res = dict(estimate_samples_per_s=B * n / dt['shared'],
               estimate_samples_per_s_copy_cache=B * n / dt['copy_cache'],
               estimate_speedup=dt['copy_cache'] / dt['shared'])
    # a causal energy (UNIT: the LM's shape) on 32 samples per prefix: each prompt once, or every
    # whole sequence
    unit, tokens = (Energy(lm.config).to(device).eval(),
                    torch.randint(meta['vocab_size'], (B, 32, L), device=device))
    x = torch.cat([prefixes[:, None].expand(-1, 32, -1), tokens], 2).flatten(0, 1)
    dt = timeit(dict(unit_shared=lambda: score_continuations(unit, prefixes, tokens, P, nullcontext(),
                                                             args.max_rows),
                     unit_whole=lambda: score(unit, x, P, nullcontext(), args.max_rows)), device, 0, runs)
    res.update(estimate_unit_seqs_per_s=B * 32 / dt['unit_shared'],
               estimate_unit_shared_speedup=dt['unit_whole'] / dt['unit_shared'])
    # the energy alone, in estimate_ppl.score's blocks: where bf16 autocast would pay for scoring
    x = torch.randint(meta['vocab_size'], (args.max_rows, P + L), device=device)
    fns = {name: lambda d=DTYPES[name]: score(energy, x, P, autocast(device, d), args.max_rows)
           for name in dtypes}
    dt = timeit(fns, device, 1, args.repeats)
    res.update({f'estimate_energy_seqs_per_s_{name}': args.max_rows / dt[name] for name in dtypes})
    if 'bf16' in dtypes:
        res['estimate_energy_bf16_speedup'] = dt['fp32'] / dt['bf16']
    # why alibi_bias is 4-D: with a 3-D mask, CPU SDPA takes its math path
    nh, hs = args.n_head, args.energy_embd // args.n_head
    q, k, v = (torch.randn(64, nh, P + L, hs, device=device) for _ in range(3))
    bias = alibi_bias(nh, 0, P + L, P + L, q.dtype, device)
    sdpa = lambda mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dt = timeit({'3d': lambda: sdpa(bias[0]), '4d': lambda: sdpa(bias)}, device, 1, args.repeats)
    res['alibi_sdpa_4d_speedup'] = dt['3d'] / dt['4d']
    return res

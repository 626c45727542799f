"""
Throughput benchmarks of rebm's building blocks, each against a baseline measured in the same
process:

- matmul_peak: fp32 and bf16 square-matmul GFLOP/s, the peak that MFU is measured against;
- train:       char-GPT training steps as train_lm.py runs them (forward + backward + clipping +
               AdamW on random train-split windows): tokens/s and MFU in fp32 and bf16 autocast;
               on a CPU, bf16 with model.attention's two matmuls vs SDPA's kernel;
- sampling:    K continuations of each of B prompts with GPT.generate (the prompts' KV cache is
               computed once and shared by their K samples), in fp32 and bf16 autocast, vs a
               naive sampler without a cache that re-runs the model over the whole sequence for
               every new token of every sample (nanoGPT's generate); the cached one's fp32 MFU;
- distinct:    GPT.generate's decoding (each distinct history once) against decode_steps on every
               row, the same draws, at a negatives chunk of the addition job: a random LM (samples
               all distinct) and that LM sharpened (samples that repeat, as a trained one's);
- beam:        GPT.beam_search (each prompt's K/V once, the beams' new tokens cached) against
               beam_search_plain (every beam's whole sequence rerun at each step): --beam beams of
               8 new tokens (addition's answer) after each of --num_prefixes prompts;
- energy:      the BIT energy's forward (sequences/s at prefix 128 + continuation 64) and one
               binary-NCE training step (positives and negatives in one forward), tokens/s, and
               the fp32 MFU of each (with train's and sampling's: each stage's MFU at the job's
               sizes when run with the job's --n_layer --n_head --n_embd --block_size);
- estimation:  log Z estimation (LM samples drawn and scored per second) and joint sampling
               (Algorithm 1) at n = 10^3 and 10^4 samples, with the process's peak memory: both
               run in chunks, so memory should stay flat as n grows;
- estimate:    estimate_ppl.py's log Z loop at its default sizes (the char GPT above, a 4x128
               ALiBi BIT, 16 prefixes of 128 + 64 tokens, 64 samples each, fp32): samples drawn
               and scored per second, vs the copy-the-prompt-cache decoding of commit 68ace2e;
               a causal (UNIT) energy scoring each prompt once for its samples vs every whole
               sequence; and the energy forward in fp32 vs bf16 autocast;
- metric_fit:  the talk's metric energy (metrics.py): mu fitted by Newton's method on the dual at
               the main job's sizes (512 prefixes x 32 LM samples, 5 metrics), vs L-BFGS on the
               same dual to the same moment gap; and its five metrics per second vs a BIT's forward;
- graphs:      a CUDA GPU only (job/bench_graphs.py): the training step above, eager vs captured
               once as a CUDA graph and replayed, and vs torch.compile's reduce-overhead mode: ms a
               step, the speedups, and each variant's largest weight difference from eager after the
               same 20 steps.

A 512^3 matmul probe runs first: where bf16 is emulated (an AVX2-only CPU: ~40x slower than
fp32), every bf16 figure is skipped (listed under bf16_skipped) rather than taking minutes. The
JSON also records the CPU's ATen capability and its avx2/avx512f/avx512_bf16/amx_bf16 flags.

    python -m job.bench                   # CPU: ~4 minutes on 2 idle cores
    python -m job.bench --quick           # smoke test, < 1 minute: fewer repeats, and 2 prefixes
                                      # instead of 8, so its sampling figures are not comparable
    python -m job.bench --device cuda     # GPU
    python -m job.bench --device cuda --sections graphs --n_layer 3 --n_head 3 --n_embd 96 \
        --energy_embd 96 --block_size 66 --batch_size 32 --data_dir data/addition   # addition's LM step

The sections that decode (sampling, distinct, beam, estimation, estimate) are in job/bench_decoding.py,
the timing tools every section shares in job/bench_tools.py.

Each figure is the median of --repeats timed runs after --warmup untimed ones (the matmul peak:
the fastest run); the runs of the variants being compared alternate, so that load from other
processes hits them alike. Prints a table, then one JSON object with every figure as the last
line of stdout; the same JSON is written (atomically) to --out.
"""

import json
import sys
import time
from argparse import ArgumentTypeError
from contextlib import nullcontext

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.bench")
import torch

from data import batch_offsets, get_batch, load_meta, load_split
from energy import Energy, score
from extensions.metrics import MetricEnergy, fit_mu
from job.bench_decoding import bench_beam, bench_distinct, bench_estimate, bench_estimation, bench_sampling
from job.bench_graphs import bench_graphs
from job.bench_tools import DTYPES, adamw, flops_per_token, forward_flops_per_token, lm_config, log, timeit
import model as model_py
from model import GPT, GPTConfig
from nce_train import nce_loss
from plumbing import (ArgumentParser, autocast, check_heads, check_writable, common_flags, pick_device,
                      run_main, write_json)


SECTIONS = ('train', 'sampling', 'beam', 'distinct', 'energy', 'estimation', 'estimate', 'metric_fit',
            'graphs')


def section_names(text):
    """'train,graphs' -> ['train', 'graphs'], each a section of SECTIONS."""
    names = [n.strip() for n in text.split(',') if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ArgumentTypeError(f"{', '.join(unknown) or 'none'}: not a section; pick from "
                                f"{', '.join(SECTIONS)}")
    return names


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    a = p.add_argument
    a('--sections', type=section_names, default=','.join(SECTIONS),
      help='the sections to run, comma-separated (the bf16 probe and the matmul peak always run)')
    a('--data_dir', default='data/shakespeare', help='prepared char corpus (data/shakespeare/prepare.py)')
    a('--out', default='out/bench.json', help='the JSON of all figures is written here')
    common_flags(p, 'device')
    a('--threads', type=int, default=0, at_least=0, at_most=4096,
      help='CPU threads (0: torch default); 1 is steadier when other processes share the cores')
    common_flags(p, 'seed', 'quiet',
                 help=dict(quiet='print only the JSON line (no progress on stderr, no table)'))
    a('--quick', action='store_true',
      help='smoke test: 1 warmup, 3 repeats, at most 2 sampling prefixes and 8 samples per log Z prefix')
    a('--warmup', type=int, default=2, at_least=0, at_most=1000, help='untimed runs before each measurement')
    a('--repeats', type=int, default=5, at_least=1, at_most=1000,
      help='timed runs per measurement (the median is reported)')
    a('--naive_repeats', type=int, default=1, at_least=1, at_most=1000,
      help='timed runs of the (slow) naive sampler')
    a('--matmul_size', type=int, default=0, at_least=0, at_most=2**16,
      help='side of the square matmuls (0: 2048 on CPU, 8192 on GPU)')
    # the char GPT of train_lm.py's defaults
    a('--n_layer', type=int, default=4, at_least=1, at_most='tokens', help="the LM's blocks")
    a('--n_head', type=int, default=4, at_least=1, at_most='tokens', help="the LM's heads")
    a('--n_embd', type=int, default=256, at_least=1, at_most='tokens', help="the LM's width")
    a('--block_size', type=int, default=256, at_least=1, at_most='tokens',
      help="the LM's context in tokens")
    a('--batch_size', type=int, default=16, at_least=1, at_most='count', help='sequences per training step')
    # sampling workload
    a('--num_prefixes', type=int, default=8, at_least=1, at_most='count', help='prefixes per sampling run')
    a('--prefix_len', type=int, default=128, at_least=1, at_most='tokens', help='tokens per prefix')
    a('--num_samples', type=int, default=16, at_least=1, at_most='samples',
      help='continuations per prefix (K)')
    a('--gen_len', type=int, default=64, at_least=1, at_most='tokens', help='tokens per continuation')
    a('--beam', type=int, default=8, at_least=1, at_most='beam', help="beams per prefix of the beam search")
    # log Z estimation workload (estimate_ppl.py's defaults; prefix_len + gen_len tokens)
    a('--chunk', type=int, default=16, at_least=1, at_most='count',
      help="prefixes per batch of the log Z workload (estimate_ppl.py's --chunk)")
    a('--logz_samples', type=int, default=64, at_least=1, at_most='samples',
      help="LM samples per prefix of the log Z workload (estimate_ppl.py's --num_samples)")
    a('--energy_embd', type=int, default=128, at_least=1, at_most='tokens',
      help='width of the BIT energy (n_layer, n_head: the LM\'s)')
    a('--max_rows', type=int, default=256, at_least=1, at_most='count',
      help="sequences per forward (estimate_ppl.py's --max_rows)")
    args = p.parse_args(argv)
    check_heads(args.n_embd, args.n_head)
    if args.energy_embd % args.n_head:
        raise ValueError(f"--energy_embd {args.energy_embd} is not a multiple of --n_head {args.n_head} (the "
                         f"energy takes the LM's heads): pick a multiple, e.g. {args.n_head * 32}")
    if args.prefix_len + args.gen_len > args.block_size:
        raise ValueError(f"--prefix_len {args.prefix_len} + --gen_len {args.gen_len} "
                         f"exceeds --block_size {args.block_size}")
    check_writable(args.out, '--out', folder=False)
    if args.quick:
        args.warmup, args.repeats, args.num_prefixes = 1, 3, min(args.num_prefixes, 2)
        args.logz_samples = min(args.logz_samples, 8)
    return args


# -----------------------------------------------------------------------------


def cpu_flags():
    """What decides CPU speed per precision: ATen's vector ISA, and whether bf16 has hardware
    matmuls (avx512_bf16, amx_bf16) or is emulated (~40x slower than fp32 on AVX2 alone)."""
    res = dict(cpu_capability=torch.backends.cpu.get_cpu_capability())
    try:
        with open('/proc/cpuinfo') as f:
            flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), [])
    except OSError:
        return res
    return dict(res, **{f'cpu_{flag}': flag in flags
                        for flag in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16')})


def bench_bf16_probe(args, device, min_ratio=0.25):
    """A 512^3 matmul in fp32 and bf16 (a second even where bf16 is emulated): bf16 figures
    are measured only where bf16 runs at least min_ratio of fp32's speed."""
    n = 512
    fns = {}
    for name, dtype in DTYPES.items():
        a, b, c = (torch.randn(n, n, device=device).to(dtype) for _ in range(3))
        fns[name] = lambda a=a, b=b, c=c: torch.mm(a, b, out=c)
    dt = timeit(fns, device, 1, 3, stat=min)
    gflops = {name: 2 * n ** 3 / dt[name] / 1e9 for name in DTYPES}
    return dict(bf16_probe_gflops_fp32=gflops['fp32'], bf16_probe_gflops_bf16=gflops['bf16'],
                bf16_slow=gflops['bf16'] < min_ratio * gflops['fp32'])


def bench_matmul_peak(args, device, dtypes):
    n = args.matmul_size or (8192 if device.startswith('cuda') else 2048)
    fns = {}
    for name in dtypes:
        a, b, c = (torch.randn(n, n, device=device).to(DTYPES[name]) for _ in range(3))
        fns[name] = lambda a=a, b=b, c=c: torch.mm(a, b, out=c)
    # a peak, so the fastest run: load from other processes can only slow a run down
    dt = timeit(fns, device, args.warmup, max(args.repeats, 5), stat=min)
    return dict(matmul_size=n, **{f'matmul_gflops_{name}': 2 * n ** 3 / dt[name] / 1e9 for name in dtypes})


def train_step_fn(args, device, meta, dtype, train_data):
    """One iteration of train_lm.py (grad_accum=1, no logging) on a fresh model, as a closure."""
    torch.manual_seed(args.seed)
    model = GPT(lm_config(args, meta)).to(device)
    optimizer = adamw(model, 2e-3, device)  # train_lm.py's defaults
    it = 0

    def step():
        nonlocal it
        offsets = batch_offsets(len(train_data), args.block_size, args.batch_size, args.seed, 'train', it)
        x, y = get_batch(train_data, offsets, args.block_size, device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        it += 1

    return model, step


def bench_train(args, device, meta, peak):
    """peak: {'fp32': GFLOP/s[, 'bf16': GFLOP/s]} from bench_matmul_peak, one per dtype measured."""
    train_data = load_split(args.data_dir, 'train', meta)
    models, steps = {}, {}
    for name in peak:
        models[name], steps[name] = train_step_fn(args, device, meta, DTYPES[name], train_data)
    dt = timeit(steps, device, args.warmup, args.repeats)
    model = models['fp32']
    # nanoGPT's MFU convention: N without the position embedding, which is no matmul
    flops = flops_per_token(model.config, model.num_params(non_embedding=True))
    res = dict(train_params=model.num_params(), train_flops_per_token=flops)
    for name in peak:
        tokens_per_s = args.batch_size * args.block_size / dt[name]
        res[f'train_tokens_per_s_{name}'] = tokens_per_s
        res[f'train_mfu_{name}'] = tokens_per_s * flops / (peak[name] * 1e9)
    if 'bf16' in peak:
        res['bf16_train_speedup'] = dt['fp32'] / dt['bf16']
    if 'bf16' in peak and device == 'cpu':  # model.attention in bf16: two matmuls vs SDPA's CPU kernel
        _, sdpa_step = train_step_fn(args, device, meta, torch.bfloat16, train_data)

        def step_sdpa():
            model_py.CPU_BF16_MATMUL_ATTENTION = False
            try:
                sdpa_step()
            finally:
                model_py.CPU_BF16_MATMUL_ATTENTION = True
        dt = timeit(dict(matmul=steps['bf16'], sdpa=step_sdpa), device, args.warmup, args.repeats)
        res['bf16_train_matmul_attention_speedup'] = dt['sdpa'] / dt['matmul']
    return res


def bench_energy(args, device, meta, peak_fp32):
    """Energy forward (sequences/s at prefix 128 + continuation 64) and NCE training tokens/s
    (one binary-NCE step of nce_train.py: positives and negatives in one forward)."""
    P, L, B = 128, 64, args.batch_size
    torch.manual_seed(args.seed)
    cfg = GPTConfig(block_size=P + L, vocab_size=meta['vocab_size'] + 1, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, causal=False)
    energy = Energy(cfg).to(device)
    x = torch.randint(meta['vocab_size'], (2 * B, P + L), device=device)
    optimizer = adamw(energy, 3e-4, device)  # nce_train.py's defaults

    def forward():
        with torch.no_grad():
            energy(x, P)

    def nce_step():
        e = energy(x, P)
        loss, _ = nce_loss(e[:B], e[B:, None])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dt = timeit(dict(forward=forward, nce_step=nce_step), device, args.warmup, args.repeats)
    # the matmul weights: the body's token embedding is a lookup here (no LM head runs)
    tokens = 2 * B * (P + L)
    emb = energy.body.transformer
    N = energy.num_params() - emb.wte.weight.numel() - emb.wpe.weight.numel()
    return dict(energy_forward_seqs_per_s=2 * B / dt['forward'],
                nce_train_tokens_per_s=tokens / dt['nce_step'],
                # MFU against the fp32 matmul peak (fp32 runs): bidirectional, attention over all P + L
                energy_forward_mfu=tokens * forward_flops_per_token(cfg, N, P + L) / dt['forward']
                / (peak_fp32 * 1e9),
                nce_train_mfu=tokens * flops_per_token(cfg, N) / dt['nce_step'] / (peak_fp32 * 1e9))


def bench_metric_fit(args, device, meta):
    """Newton (fit_mu) vs L-BFGS (torch.optim.LBFGS, strong Wolfe) on the dual of the metric
    energy, synthetic correlated metrics of 512 prefixes x 32 samples, both to moment gaps below
    1e-8; and the metrics rep-4, tr-32, div, coh, logp per second (64 sequences of 128 + 64 tokens,
    the LM above) against a forward of the BIT energy of bench_estimate's size."""
    g = torch.Generator().manual_seed(args.seed)
    B, n, K = 512, 32, 5
    f_pool = (torch.randn(B, n, K, generator=g, dtype=torch.float64)
              @ torch.randn(K, K, generator=g, dtype=torch.float64))
    f_data = f_pool[:, :4].mean(1)  # a target the pools reach: the mean of 4 of their own samples

    def lbfgs():
        mu = torch.zeros(K, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([mu], max_iter=1000, tolerance_grad=1e-8, tolerance_change=0,
                                line_search_fn='strong_wolfe')

        def closure():
            opt.zero_grad()
            D = torch.logsumexp(-f_pool @ mu, -1).mean() + mu @ f_data.mean(0)
            D.backward()
            return D
        opt.step(closure)
    res = {f'metric_fit_{k}_ms': 1e3 * v for k, v in
           timeit(dict(newton=lambda: fit_mu(f_data, f_pool, tol=1e-8), lbfgs=lbfgs), 'cpu', 1,
                  args.repeats).items()}
    res['metric_fit_newton_steps'] = fit_mu(f_data, f_pool, tol=1e-8)[1]
    torch.manual_seed(args.seed)
    lm = GPT(lm_config(args, meta)).to(device).eval()
    metric = MetricEnergy(['rep-4', 'tr-32', 'div', 'coh', 'logp'], lm)
    bit = Energy(GPTConfig(block_size=args.block_size, vocab_size=meta['vocab_size'] + 1,
                           n_layer=args.n_layer, n_head=args.n_head, n_embd=args.energy_embd,
                           causal=False)).to(device).eval()
    x = torch.randint(meta['vocab_size'], (64, args.prefix_len + args.gen_len), device=device)
    t = timeit(dict(metrics=lambda: score(metric, x, args.prefix_len, nullcontext()),
                    bit=lambda: score(bit, x, args.prefix_len, nullcontext())),
               device, args.warmup, args.repeats)
    res.update(metric_features_seqs_per_s=64 / t['metrics'], bit_energy_seqs_per_s=64 / t['bit'])
    return res


# -----------------------------------------------------------------------------

def main(argv=None):
    args = get_args(argv)
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    meta = load_meta(args.data_dir)
    for split in ('train', 'val'):
        n = len(load_split(args.data_dir, split, meta))
        if n <= args.block_size + 1:
            raise ValueError(f"the {split} split of {args.data_dir} has {n} tokens, "
                             f"not more than --block_size {args.block_size} + 1: "
                             "lower --block_size or use a larger corpus")
    results = dict(device=device, num_threads=torch.get_num_threads(), quick=args.quick, **cpu_flags())
    sections = []
    t_start = time.perf_counter()

    def run(name, fn, *a):
        log(args, f"{name}...")
        t0 = time.perf_counter()
        figures = fn(args, device, *a)
        log(args, f"  {time.perf_counter() - t0:.1f}s")
        sections.append((name, figures))
        results.update(figures)
        return figures

    probe = run('bf16_probe', bench_bf16_probe)
    dtypes = ['fp32'] if probe['bf16_slow'] else list(DTYPES)
    results['bf16_skipped'] = (['matmul_peak', 'train', 'sampling', 'estimate_energy'] if probe['bf16_slow']
                               else [])
    peak = run('matmul_peak', bench_matmul_peak, dtypes)
    sections_args = dict(train=(bench_train, meta, {k: peak[f'matmul_gflops_{k}'] for k in dtypes}),
                         sampling=(bench_sampling, meta, dtypes, peak['matmul_gflops_fp32']),
                         beam=(bench_beam, meta), distinct=(bench_distinct, dtypes),
                         energy=(bench_energy, meta, peak['matmul_gflops_fp32']),
                         estimation=(bench_estimation, meta), estimate=(bench_estimate, meta, dtypes),
                         metric_fit=(bench_metric_fit, meta), graphs=(bench_graphs, meta))
    for name in SECTIONS:
        if name in args.sections:
            run(name, *sections_args[name])
    results['bench_time_s'] = time.perf_counter() - t_start

    if not args.quiet:
        print(f"device {device}, {results['num_threads']} threads, torch {torch.__version__}"
              f"{', quick' if args.quick else ''}")
        for name, figures in sections:
            print(f"--- {name}")
            for k, v in figures.items():
                cell = (f"{v:>12,.4g}" if isinstance(v, float)
                        else f"{v:>12,}" if type(v) is int else f"{v!s:>12}")
                print(f"{k:<38} {cell}")
        if results['bf16_skipped']:
            print(f"bf16 is slow here (probe: {results['bf16_probe_gflops_bf16']:.3g} vs fp32 "
                  f"{results['bf16_probe_gflops_fp32']:.3g} GFLOP/s): skipped bf16 in "
                  f"{', '.join(results['bf16_skipped'])}")
        print(f"total {results['bench_time_s']:.0f}s")
    write_json(results, args.out)
    print(json.dumps(results))


if __name__ == '__main__':
    run_main(main)

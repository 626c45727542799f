"""job/bench.py's `graphs` section, for a CUDA GPU: the LMs' training step as train_lm.py runs it
(forward under autocast, backward, clipping at norm 1, AdamW), eager against the same step captured once
as a CUDA graph and replayed, and against torch.compile's reduce-overhead mode (its own CUDA graphs). On a
GPU these models' steps are bound by kernel launches and Python (addition's LM: about 8 ms a step at 32
sequences as at 128; docs/addition.md, On a GPU), which a replayed graph skips; the step without the
trainers' two host syncs a step says what those alone cost. A captured step must
train the same model: the section reports the largest weight difference between eager and each variant
after the same batches from the same weights. On a CPU it reports why it did not run."""

import copy
from contextlib import nullcontext

import torch

from data import batch_offsets, get_batch, load_split
from job import bench_tools
from job.bench_tools import lm_config, timeit
from model import GPT


def adamw(model, device, capturable=False):
    """The trainers' AdamW (bench_tools.adamw) at train_lm.py's lr 2e-3: fused on a GPU; capturable, to
    be captured in a graph (not fused: the flag is set on its groups before any state)."""
    optimizer = bench_tools.adamw(model, 2e-3, 'cpu' if capturable else device)
    for group in optimizer.param_groups:
        group['capturable'] = capturable
    return optimizer


def step_body(model, optimizer, x, y, device, dtype, synced=False):
    """One step (autocast's cast cache off, as capture needs); `synced`: the host reads the loss after
    the backward and the gradient norm before AdamW, each a sync, where train_lm.py reads them every
    step (nanoGPT reads them only at its log interval). Unsynced, it is capturable as it is."""
    amp = torch.autocast(device.split(':')[0], dtype=dtype, cache_enabled=False) if dtype != torch.float32 \
        else nullcontext()
    with amp:
        _, loss = model(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if synced:
        loss.item(), norm.item()
    optimizer.step()
    return loss


class Batches:
    """The training split's batches 0, 1, 2, ... in turn, as train_lm.py draws them; `taken` so far."""

    def __init__(self, data, args, device):
        self.data, self.args, self.device, self.taken = data, args, device, 0

    def __call__(self):
        a = self.args
        offsets = batch_offsets(len(self.data), a.block_size, a.batch_size, a.seed, 'train', self.taken)
        self.taken += 1
        return get_batch(self.data, offsets, a.block_size, self.device)


def eager_step(model, batches, device, dtype, synced=True):
    """The trainers' step: their AdamW, their two host syncs, the gradients set to None after each step."""
    optimizer = adamw(model, device)

    def step():
        step_body(model, optimizer, *batches(), device, dtype, synced)
        optimizer.zero_grad(set_to_none=True)
    return step


def unsynced_step(model, batches, device, dtype):
    """The trainers' step without its two host syncs: the GPU runs ahead of Python (the same arithmetic)."""
    return eager_step(model, batches, device, dtype, synced=False)


def graph_step(model, batches, device, dtype, warmup=3):
    """The step captured as one CUDA graph (whole-network capture, torch.cuda.graphs): each batch copied
    into static inputs, AdamW capturable; `warmup` eager steps on a side stream first, as capture needs
    (they train on the first batches; the replays go on from there)."""
    optimizer = adamw(model, device, capturable=True)
    static = [t.clone() for t in batches()]  # the inputs the graph reads: batch 0, then each one copied in

    def next_batch():
        for s, t in zip(static, batches(), strict=True):
            s.copy_(t)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            if i:
                next_batch()
            step_body(model, optimizer, *static, device, dtype)
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # grads are None here, so each replay writes them anew
        static_loss = step_body(model, optimizer, *static, device, dtype)

    def step():
        next_batch()
        graph.replay()
        static_loss.item()
    return step


def compiled_step(model, batches, device, dtype):
    """torch.compile(mode='reduce-overhead') of the model (its CUDA graphs), the optimizer eager."""
    compiled, optimizer = torch.compile(model, mode='reduce-overhead'), adamw(model, device)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        step_body(compiled, optimizer, *batches(), device, dtype, synced=True)
        optimizer.zero_grad(set_to_none=True)
    return step


VARIANTS = dict(unsynced=unsynced_step, graph=graph_step, compiled=compiled_step)


def bench_graphs(args, device, meta, steps=20, variants=None):
    """Eager against each variant (VARIANTS on a CUDA GPU; on a CPU none, but those a test passes): the
    median ms a step (their runs alternating, bench_tools.timeit), the speedups, and the largest weight
    difference from eager after the same `steps` batches from the same weights."""
    if variants is None and not device.startswith('cuda'):
        return dict(graphs_skipped=f'CUDA graphs need a CUDA GPU (device {device})')
    variants = VARIANTS if variants is None else variants
    data = load_split(args.data_dir, 'train', meta)
    cuda_bf16 = device.startswith('cuda') and torch.cuda.is_bf16_supported()
    dtype = torch.bfloat16 if cuda_bf16 else torch.float32  # fp16 would need a GradScaler
    torch.manual_seed(args.seed)
    init = GPT(lm_config(args, meta)).to(device)
    res = dict(graphs_dtype=str(dtype).replace('torch.', ''), graphs_batch_size=args.batch_size)
    fns = {'eager': eager_step(copy.deepcopy(init), Batches(data, args, device), device, dtype)}
    for name, make in variants.items():
        try:  # a variant that fails (a kernel capture refuses, no compiler) leaves the others' figures
            fns[name] = make(copy.deepcopy(init), Batches(data, args, device), device, dtype)
            fns[name]()
        except Exception as e:  # noqa: BLE001: recorded, and the section goes on
            res[f'graphs_{name}_error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
            fns.pop(name, None)
    per_run = 10  # steps a timed run: one step is a few ms on a GPU
    dt = timeit({name: lambda f=f: [f() for _ in range(per_run)] for name, f in fns.items()}, device,
                args.warmup, args.repeats)
    res.update({f'graphs_ms_per_step_{name}': 1e3 * t / per_run for name, t in dt.items()})
    res.update({f'graphs_speedup_{name}': dt['eager'] / dt[name] for name in dt if name != 'eager'})
    for name in [n for n in fns if n != 'eager']:
        diff = weight_diff(init, variants[name], data, args, device, dtype, steps)
        res[f'graphs_max_weight_diff_{name}'] = diff
    return res


def weight_diff(init, make, data, args, device, dtype, steps):
    """The largest difference between the weights eager and `make`'s step reach from init, each after
    the training split's first `steps` batches."""
    models, runs = [], []
    for maker in (eager_step, make):
        models.append(copy.deepcopy(init))
        batches = Batches(data, args, device)
        runs.append((maker(models[-1], batches, device, dtype), batches))
    for step, batches in runs:
        while batches.taken < steps:
            step()
    return max((a - b).abs().max().item()
               for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))

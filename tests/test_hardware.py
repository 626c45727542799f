"""The precision and threads this hardware runs: --dtype auto on faked hardware, the OpenMP wait
policy decided as a script starts (its re-execution), what importing the support package changes.
"""

import importlib
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import plumbing
from plumbing import budget, parser_of
from plumbing.checkpoints import load_checkpoint
from model import GPTConfig
from tests.common import (ROOT, SCRIPTS, TRAIN_FLAGS, run_scripts)


# =============================================================================
# ---- --dtype auto: the precision this hardware runs natively (faked hardware) ----

@pytest.mark.parametrize('capability,expected', [((7, 0), 'float16'), ((8, 0), 'bfloat16'),
                                                 ((9, 0), 'bfloat16')])
def test_auto_dtype_on_cuda_by_capability(monkeypatch, capability, expected):
    """A V100 (7.0) has no bf16 units, whatever torch.cuda.is_bf16_supported() says: fp16 + GradScaler."""
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device=None: capability)
    dtype, why = plumbing.choose_dtype('cuda', 'auto', 'train')
    assert dtype == expected and f'{capability[0]}.{capability[1]}' in why


@pytest.mark.parametrize('capability,flags,units', [
    ('AVX512', 'fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile', 'amx_bf16 and avx512_bf16'),
    ('AVX512', 'fpu avx2 avx512f avx512bw', ''),
    ('AVX2', 'fpu avx2 avx512f avx512_bf16', '')])  # ATEN_CPU_CAPABILITY=avx2: torch's kernels avoid them
def test_cpu_bf16_units_from_the_flags(monkeypatch, tmp_path, capability, flags, units):
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text(f'processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n')
    monkeypatch.setattr(torch.backends.cpu, 'get_cpu_capability', lambda: capability)
    assert plumbing.cpu_bf16_units(str(cpuinfo)) == units
    assert plumbing.cpu_bf16_units(str(tmp_path / 'none')) == ''  # not Linux: no flags to read


@pytest.mark.parametrize('units,expected', [('avx512_bf16', 'bfloat16'), ('', 'float32')])
def test_auto_dtype_on_cpu_from_the_hardware(monkeypatch, units, expected):
    """Training in bf16 where the CPU has bf16 units, else fp32; sampling and scoring in bf16 there
    only for models CPU_BF16_MIN_WIDTH wide or more; an explicit --dtype as asked. No timing enters:
    a busy machine decides as an idle one."""
    monkeypatch.setattr(plumbing.device, 'cpu_bf16_units', lambda: units)
    dtype, why = plumbing.choose_dtype('cpu', 'auto', 'train')
    assert dtype == expected and (units in why if units else 'no bf16 units' in why)
    wide, narrow = plumbing.CPU_BF16_MIN_WIDTH, plumbing.CPU_BF16_MIN_WIDTH - 32
    for work in ('sample', 'score'):
        assert plumbing.choose_dtype('cpu', 'auto', work, wide)[0] == expected
        assert plumbing.choose_dtype('cpu', 'auto', work, narrow)[0] == 'float32'
    assert plumbing.choose_dtype('cpu', 'float32', 'train') == ('float32', 'asked for')


def test_openmp_wait_policy_follows_the_load_at_start(monkeypatch):
    """Threads spin while they wait where each has a core, and sleep (PASSIVE) where other
    processes keep one busy at each of three readings 0.4 s apart (a burst that ends by the last
    one leaves them spinning); the user's OMP_WAIT_POLICY, or a single thread, left as they are."""
    monkeypatch.setattr(os, 'cpu_count', lambda: 4)
    pauses = []
    monkeypatch.setattr(time, 'sleep', pauses.append)

    def policy(environ, in_use):
        return plumbing.openmp_wait_policy(environ, lambda: in_use)[0]
    assert policy({}, 0.2) is None and policy({}, None) is None  # idle, or no /proc/stat
    assert policy({}, 1.0) == 'PASSIVE' and policy({'OMP_NUM_THREADS': '4'}, 0.7) == 'PASSIVE'
    assert policy({'OMP_NUM_THREADS': '2'}, 1.0) is None  # 2 threads, 3 free cores
    assert policy({'OMP_NUM_THREADS': '2'}, 2.6) == 'PASSIVE'
    assert policy({'OMP_NUM_THREADS': '1'}, 4.0) is None
    assert policy({'OMP_WAIT_POLICY': 'ACTIVE'}, 4.0) is None
    pauses.clear()
    assert policy({}, 1.0) == 'PASSIVE' and pauses == [0.4, 0.4]
    for burst in ([1.5, 0.2], [1.5, 1.5, 0.2]):  # busy at the first readings only
        looks = iter(burst)
        assert plumbing.openmp_wait_policy({}, lambda: next(looks))[0] is None


def fake_proc_stat(monkeypatch, tmp_path, busy, idle, iowait, own, cores):
    """A /proc/stat whose counters advance by `busy` user, `idle` and `iowait` ticks while
    cores_in_use sleeps, this process using `own` cores meanwhile: the clocks and the load are
    faked, so the answer is the same on a busy or an idle machine. Returns the file's path."""
    stat, ticks, clock = tmp_path / 'stat', [100, 0, 0, 1000, 0, 0, 0, 0, 0, 0], dict(wall=0.0, cpu=0.0)
    write = lambda: stat.write_text('cpu  ' + ' '.join(map(str, ticks)) + '\ncpu0 ...\n')

    def sleep(seconds):
        ticks[0], ticks[3], ticks[4] = ticks[0] + busy, ticks[3] + idle, ticks[4] + iowait
        write()
        clock.update(wall=clock['wall'] + seconds, cpu=clock['cpu'] + own * seconds)
    write()
    monkeypatch.setattr(os, 'cpu_count', lambda: cores)
    monkeypatch.setattr(time, 'sleep', sleep)
    monkeypatch.setattr(time, 'perf_counter', lambda: clock['wall'])
    monkeypatch.setattr(time, 'process_time', lambda: clock['cpu'])
    return str(stat)


@pytest.mark.parametrize('busy,idle,iowait,own,cores,in_use', [
    (0, 400, 0, 0.0, 4, 0.0), (100, 300, 0, 0.0, 4, 1.0), (400, 0, 0, 0.0, 4, 4.0),
    (100, 200, 100, 0.0, 4, 1.0), (100, 100, 0, 0.0, 2, 1.0), (100, 100, 0, 1.0, 2, 0.0),
    (0, 0, 0, 0.0, 2, None)], ids=['idle', 'one-busy-loop', 'full', 'iowait-is-idle', 'another-process',
                                   'this-process', 'no-tick'])
def test_cores_in_use_from_proc_stat(monkeypatch, tmp_path, busy, idle, iowait, own, cores, in_use):
    """Busy ticks of the whole machine (not idle, not waiting on a disk) times its cores, less what
    this process itself used meanwhile (numpy's threads spin just after it loads): a busy loop
    beside us is one core of 4, or of 2; none if the busy core was ours; None with no tick to read."""
    stat = fake_proc_stat(monkeypatch, tmp_path, busy, idle, iowait, own, cores)
    got = plumbing.cores_in_use(0.05, stat)
    assert got is None if in_use is None else got == pytest.approx(in_use)
    assert plumbing.cores_in_use(0.05, str(tmp_path / 'none')) is None  # not Linux
    policy = plumbing.openmp_wait_policy({}, lambda: plumbing.cores_in_use(0.05, stat))[0]
    assert policy == ('PASSIVE' if in_use and in_use >= 0.5 else None)  # threads sleep beside a busy core


@pytest.mark.skipif(not os.path.exists('/proc/stat'), reason='Linux only')
def test_cores_in_use_reads_this_machine():
    """The real /proc/stat parses: between 0 and every core in use, however busy the machine is."""
    assert 0.0 <= plumbing.cores_in_use(0.2) <= os.cpu_count()


def test_wait_policy_changes_no_number(tmp_path):
    """Two threads that spin or sleep while they wait compute the same gradients and samples."""
    out = {}
    for policy in ('ACTIVE', 'PASSIVE'):
        out[policy] = str(tmp_path / policy)
        env = dict(os.environ, OMP_NUM_THREADS='2', OMP_WAIT_POLICY=policy, PYTHONPATH=ROOT)
        res = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'wait_policy_run.py'), out[policy]],
                             cwd=ROOT, text=True, capture_output=True, env=env)
        assert res.returncode == 0, res.stderr
    a, p = (torch.load(out[k], weights_only=True) for k in ('ACTIVE', 'PASSIVE'))
    assert torch.equal(a['tokens'], p['tokens']) and torch.equal(a['logp'], p['logp'])
    assert all(map(torch.equal, a['grads'], p['grads']))


def test_importing_plumbing_changes_nothing():
    """Importing the support package, or any method file, sets no environment variable and reads
    none of the machine's /proc files (no 0.1 s sampling of the load of /proc/stat): the wait
    policy is decided, and malloc's thresholds set, by run_main alone."""
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_WAIT_POLICY', plumbing.device.DECIDED)}
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'import_changes_nothing.py')], cwd=ROOT,
                         capture_output=True, text=True, env=dict(env, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr


def test_wait_policy_reexecutes_a_busy_start_once(monkeypatch):
    """As a script starts, PASSIVE (other processes keep a core busy) re-executes it once with
    OMP_WAIT_POLICY set, since OpenMP read the policy as torch loaded; the re-executed process
    takes both variables out (its children decide for themselves) and decides nothing, however
    busy; an idle start, or the user's OMP_WAIT_POLICY, re-executes nothing."""
    device, execs = plumbing.device, []
    monkeypatch.setattr(os, 'cpu_count', lambda: 2)
    monkeypatch.setattr(time, 'sleep', lambda seconds: None)  # the readings' pauses

    def start(environ, in_use, fresh=True):  # one process starting, os.execv mocked
        if fresh:
            monkeypatch.setattr(device, 'THREADS_WHY', None)
        device.set_wait_policy(environ, lambda path, argv: execs.append((path, argv, dict(environ))),
                               lambda: in_use)
    environ = {}
    start(environ, 1.5)
    assert len(execs) == 1 and execs[0][0] == sys.executable and execs[0][1][0] == sys.executable
    assert execs[0][2]['OMP_WAIT_POLICY'] == 'PASSIVE'
    start(environ, 1.5)  # the re-executed process
    start(environ, 1.5, fresh=False)  # and a second run_main there
    assert len(execs) == 1 and environ == {} and device.THREADS_WHY.startswith('sleeping while they wait')
    start({}, 0.2)
    start({'OMP_WAIT_POLICY': 'ACTIVE'}, 2.0)
    start({'OMP_NUM_THREADS': '1'}, 2.0)
    assert len(execs) == 1


def test_keep_freed_memory_asks_glibc(monkeypatch):
    """keep_freed_memory turns malloc's own mappings off, its mmap threshold to 32 MB and its trim
    threshold to 1 GB, and says whether all took; a libc whose mallopt refuses one (0) or that has none
    (macOS) says it did not."""
    device = plumbing.device
    monkeypatch.setattr(device, 'FREED_MEMORY_KEPT', None)

    class Libc:
        def __init__(self, answers):
            self.calls, self.answers = [], list(answers)

        def mallopt(self, param, value):
            self.calls.append((param, value))
            return self.answers.pop(0)
    libc = Libc([1, 1, 1])
    assert device.keep_freed_memory(libc) is True and device.FREED_MEMORY_KEPT is True
    assert libc.calls == [(-4, 0), (-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_MAX, _THRESHOLD, M_TRIM_THRESHOLD
    assert device.keep_freed_memory(Libc([1, 0, 1])) is False and device.FREED_MEMORY_KEPT is False
    assert device.keep_freed_memory(object()) is False


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="glibc's malloc: Linux")
def test_keep_freed_memory_keeps_a_freed_block():
    """A script run by run_main still holds a freed 64 MB block (the next step reuses it without the
    kernel zero-filling its pages again); the same script called directly gives it back to the OS, as
    glibc does by default. The environment's MALLOC_* settings are dropped so that default is glibc's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(('MALLOC_', 'GLIBC_TUNABLES'))}
    def held(*flags):
        res = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'freed_memory.py'), *flags], cwd=ROOT,
                             text=True, capture_output=True, env=dict(env, PYTHONPATH=ROOT))
        assert res.returncode == 0, res.stderr
        mb, kept = res.stdout.split()
        return int(mb), kept
    (plain, not_set), (kept, took) = held('--plain'), held()
    assert (not_set, took) == ('None', 'True')
    assert plain < 16 and kept >= 60, (plain, kept)


def test_run_main_reexecutes_a_script_once():
    """run_main of a script started beside busy cores: the script runs again in the same process
    (same PID, its flags kept), once, and main sees the policy decided and the variable gone; a
    main imported from a module (a test's, a caller's) decides nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_WAIT_POLICY', plumbing.device.DECIDED)}
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'wait_policy_reexec.py'), '--x', '1'],
                         cwd=ROOT, text=True, capture_output=True,
                         env=dict(env, OMP_NUM_THREADS='2', PYTHONPATH=ROOT))
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == 3, res
    pid = lines[0].split()[1]
    assert lines[:2] == [f'start {pid}'] * 2, lines
    assert lines[2].startswith(f'main {pid} None sleeping while they wait') and "['--x', '1']" in lines[2]
    decided = []
    main = lambda argv: decided.append(plumbing.device.THREADS_WHY)
    old = plumbing.device.THREADS_WHY
    plumbing.run_main(main)  # this test's main: no policy decided, no re-execution
    assert decided == [old]


def test_check_memory_on_a_gpu(monkeypatch):
    """On CUDA the GPU's free memory is the limit (the rank's own GPU under torchrun), and
    training activations count at autocast's 2 bytes: only work that cannot fit is refused."""
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 8 * 2**30, 80 * 2**30
    monkeypatch.setattr(torch.cuda, 'mem_get_info', mem_get_info)
    monkeypatch.setenv('LOCAL_RANK', '3')
    budget.check_memory(6 * 2**30, 'x', 'fix', 'cuda')
    with pytest.raises(ValueError, match=r'~7.0 GiB of memory, more than the 6.4 GiB it may use '
                                         r'\(80% of the 8.0 GiB available on cuda:1\)'):
        budget.check_memory(7 * 2**30, 'x', 'fix', 'cuda:1')
    assert asked == [3, 'cuda:1']
    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    gpu, cpu = budget.training_memory(config, 12, 'cuda'), budget.training_memory(config, 12)
    assert 16 * config.n_layer * 12 * 768 * 2 < gpu < cpu < 2 * gpu  # GPT-2 small, nanoGPT's batch
    budget.check_memory(1e30, 'x', 'fix', 'mps')  # nothing to read there: not checked


# =============================================================================
# ---- --deterministic: PyTorch's deterministic kernels (plumbing.set_deterministic) ----

DETERMINISTIC_STATE = """
import os, sys, torch, plumbing
plumbing.setup('cpu', sys.argv[1] == 'on')
state = [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
         os.environ.get('CUBLAS_WORKSPACE_CONFIG')]
if sys.argv[1] == 'on':
    plumbing.set_deterministic('cuda')  # a GPU's attention kernels: their switches need no GPU
    b = torch.backends.cuda
    state += [b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
              b.math_sdp_enabled()]
print(state)
"""


def test_deterministic_sets_pytorchs_switches():
    """setup(device, deterministic=True): PyTorch's deterministic algorithms on, an op without one warning
    (warn_only), cuBLAS's fixed workspace; on a GPU, attention by its math kernel alone (flash and
    memory-efficient off). Without it, nothing set. Each in a fresh process: the switches are global."""
    env = {k: v for k, v in os.environ.items() if k != 'CUBLAS_WORKSPACE_CONFIG'}
    out = {}
    for mode in ('on', 'off'):
        res = subprocess.run([sys.executable, '-c', DETERMINISTIC_STATE, mode], cwd=ROOT, capture_output=True,
                             text=True, env=dict(env, PYTHONPATH=ROOT))
        assert res.returncode == 0, res.stderr
        out[mode] = res.stdout.strip()
    assert out['on'] == "[True, True, ':4096:8', False, False, False, True]"
    assert out['off'] == "[False, False, None]"


def with_and_without(corpus, tmp_path, flag, max_iters, eval_interval):
    """train_lm.py on `corpus` without `flag`, then with it (at once): their (results, best.pt's)."""
    argv = ['train_lm.py', '--data_dir', corpus, '--final_eval', '0', '--max_iters', str(max_iters),
            '--eval_interval', str(eval_interval), *TRAIN_FLAGS]
    runs = [str(tmp_path / 'without'), str(tmp_path / 'with')]
    res = run_scripts([argv + ['--out_dir', runs[0]], argv + ['--out_dir', runs[1], flag]])
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    return res, [load_checkpoint(os.path.join(run, 'best.pt')) for run in runs]


def test_deterministic_changes_no_number_on_a_cpu(lm_corpus, tmp_path):
    """train_lm.py --deterministic on a CPU (whose kernels repeat already) writes the weights the run
    without it writes, says so on stderr and records the flag; a run without it says nothing."""
    res, (a, b) = with_and_without(lm_corpus, tmp_path, '--deterministic', max_iters=4, eval_interval=2)
    assert ['deterministic: on' in r.stderr for r in res] == [False, True]
    assert [a['args']['deterministic'], b['args']['deterministic']] == [False, True]
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])


def test_every_stage_takes_deterministic_and_the_jobs_pass_it_on():
    """Every script that takes --device takes --deterministic (bench.py aside: it times kernels, trains
    nothing); job.reproduce passes it to every stage it gives --device, job.seeds to each seed's job."""
    from job import seeds
    from tests.common import job_commands
    from tests.test_flags import SCRIPTS
    for script, (module, build) in SCRIPTS.items():
        flags = parser_of(getattr(importlib.import_module(module), build), [])._option_string_actions
        if '--device' in flags and script != 'job/bench.py':
            assert '--deterministic' in flags, script
    given, plain = job_commands(['--deterministic']), job_commands()
    with_device = [name for name, cmd in given.items() if '--device' in cmd]
    assert len(with_device) >= 10 and not any('--deterministic' in cmd for cmd in plain.values())
    assert all(given[name].count('--deterministic') == 1 for name in with_device), with_device
    cmd = seeds.seed_command(seeds.get_args(['--seeds', '1,2', '--deterministic']), 1, 'r/seed1')
    assert '--deterministic' in cmd


def test_compile_on_a_cpu_needs_a_cpp_compiler(lm_corpus, tmp_path, monkeypatch):
    """--compile on a CPU (both trainers' check_training_flags) with no C++ compiler found, neither $CXX
    nor g++, c++, clang++ on the PATH: one line naming it and the fix, before --out_dir is made; any one
    of them found passes."""
    import train_lm
    from plumbing import device
    only = lambda found: (lambda name: name if name == found else None)  # shutil.which finding one name
    monkeypatch.setattr(device.shutil, 'which', only(None))
    out = tmp_path / 'run'
    refusal = r"--compile: on a CPU torch.compile builds C\+\+ kernels, and no C\+\+ compiler"
    with pytest.raises(ValueError, match=refusal + r" .* install one \(e.g. apt install g\+\+\), or drop"):
        train_lm.main(['--data_dir', lm_corpus, '--out_dir', str(out), '--max_iters', '2', '--eval_interval',
                       '2', '--compile', *TRAIN_FLAGS])
    assert not out.exists()
    with pytest.raises(ValueError, match=refusal):
        device.check_compiler('cpu', {'CXX': '/opt/cxx'})
    for found, environ in (('g++', {}), ('clang++', {}), ('/opt/cxx', {'CXX': '/opt/cxx'})):
        monkeypatch.setattr(device.shutil, 'which', only(found))
        device.check_compiler('cpu', environ)


def test_the_job_passes_compile_to_the_trainers_alone(tmp_path, monkeypatch):
    """job.reproduce --compile: every trainer stage (train_lm.py: LM, BALM, MLM, RALM, TaiLr; nce_train.py:
    BIT, UNIT) gets --compile once, no other stage gets it, and without the flag none does; on a CPU with
    no C++ compiler the job refuses it in one line before any stage runs."""
    from job import reproduce
    from plumbing import device
    from tests.common import job_commands
    for argv in ([], ['--data', 'addition']):
        listed = lambda cmds: {n: c for n, c in cmds.items() if not callable(c)}  # EXO's, made when it starts
        given, plain = listed(job_commands(argv + ['--compile'])), listed(job_commands(argv))
        trainers = [n for n, cmd in given.items() if cmd[0] in ('train_lm.py', 'nce_train.py')]
        assert {'lm', 'balm', 'mlm', 'ralm', 'tailr', 'bit', 'unit'} <= set(trainers), trainers
        assert all(given[n].count('--compile') == (n in trainers) for n in given), given
        assert len(given) > len(trainers) + 3 and not any('--compile' in cmd for cmd in plain.values())
    monkeypatch.setattr(device.shutil, 'which', lambda name: None)
    with pytest.raises(ValueError, match=r"--compile: on a CPU torch.compile builds C\+\+ kernels"):
        reproduce.main(['--quick', '--compile', '--device', 'cpu', '--out_dir', str(tmp_path / 'out')])
    assert not (tmp_path / 'out').exists()


@pytest.mark.skipif(not any(shutil.which(c) for c in ('g++', 'c++', 'clang++')), reason='no C++ compiler')
def test_compile_trains_what_eager_trains(lm_corpus, tmp_path):
    """train_lm.py --compile (torch.compile's C++ kernels on a CPU, about 25 s to build here): the same
    3 steps in float32 save the same weights under the same names (the model's, not the compiled
    wrapper's) to float rounding, and the same selection loss."""
    _, (a, b) = with_and_without(lm_corpus, tmp_path, '--compile', max_iters=3, eval_interval=3)
    assert list(a['model']) == list(b['model'])
    assert [a['args']['compile'], b['args']['compile']] == [False, True]
    assert max((a['model'][k] - b['model'][k]).abs().max().item() for k in a['model']) < 1e-4
    assert b['best']['loss'] == pytest.approx(a['best']['loss'], abs=1e-5)

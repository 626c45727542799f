# test_importing_plumbing_changes_nothing: importing plumbing and the method files sets no
# environment variable and reads none of the machine's /proc files (tests/test_hardware.py)
import builtins, io, os
import numpy, torch, tqdm  # what torch reads as it loads is torch's
opened, real_open = [], io.open


def spy(file, *args, **kwargs):
    opened.append(str(file))
    return real_open(file, *args, **kwargs)


builtins.open = io.open = spy
before = dict(os.environ)
import plumbing, model, energy, train_lm, nce_train, negatives, estimate_ppl, sample
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
assert not {'/proc/stat', '/proc/cpuinfo', '/proc/meminfo'} & set(opened), opened
assert plumbing.device.FREED_MEMORY_KEPT is None  # malloc's thresholds: run_main's to set

# test_keep_freed_memory_ends_the_page_faults (tests/test_hardware.py): the page faults of steps that
# free and allocate again what a training step's activations do (20 blocks of 512 KB), in a script
# run by run_main (keep_freed_memory) or, with --plain, called directly
import resource
import sys

import torch

import plumbing


def main(argv):
    step = lambda: sum(float(block[0]) for block in [torch.ones(1 << 17) for _ in range(20)])
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, plumbing.device.FREED_MEMORY_KEPT)


if '--plain' in sys.argv:
    main(sys.argv[1:])
else:
    plumbing.run_main(main)

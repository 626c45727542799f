# test_keep_freed_memory_keeps_a_freed_block (tests/test_hardware.py): how much of a freed 64 MB block
# (a large activation) the process still holds, in a script run by run_main (keep_freed_memory) or,
# with --plain, called directly. Resident memory, not page faults: the faults a loop of tensors takes
# by default hang on the heap's layout (CI once counted as few without it as with it). The block comes
# from malloc itself, so that it is the heap's top when freed, which the trim threshold is about.
import ctypes
import os
import sys

import plumbing


def resident():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def main(argv):
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    before, size = resident(), 64 << 20  # above glibc's largest mmap threshold: mapped on its own by default
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    print((resident() - before) >> 20, plumbing.device.FREED_MEMORY_KEPT)


if '--plain' in sys.argv:
    main(sys.argv[1:])
else:
    plumbing.run_main(main)

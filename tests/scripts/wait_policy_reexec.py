# test_run_main_reexecutes_a_script_once (tests/test_hardware.py): run_main of a script started
# beside busy cores
import os, sys
import plumbing
import torch
print('start', os.getpid(), flush=True)
plumbing.device.cores_in_use = lambda: float(os.cpu_count())  # every core busy


def main(argv):
    print('main', os.getpid(), os.environ.get('OMP_WAIT_POLICY'), plumbing.device.THREADS_WHY, argv)


plumbing.run_main(main)

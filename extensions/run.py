"""
Runs a method script with the extensions' energies plugged in: the method names no extension
(energy.py's interface), so a script that loads whatever energy it is given (estimate_ppl.py,
sample.py) loads the metric energy when this module has imported extensions.metrics, which
registers its loader. The flags are the script's own:

    python -m extensions.run estimate_ppl.py --lm out/lm/best.pt --energy METRICS=out/metrics/energy.pt
    python -m extensions.run sample.py --lm out/lm/best.pt --energy out/metrics/energy.pt --split test
"""

import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m extensions.run")
import estimate_ppl
import extensions.metrics  # noqa: F401  registers the metric energy's loader
import sample
from plumbing import run, run_main

SCRIPTS = {'estimate_ppl.py': estimate_ppl.main, 'sample.py': sample.main}


def main(argv):
    if argv[:1] in (['-h'], ['--help']):
        print(f"usage: python -m extensions.run {{{','.join(SCRIPTS)}}} FLAGS\n{__doc__}")
        return
    if not argv or argv[0] not in SCRIPTS:
        raise ValueError(f"{argv[0] if argv else 'no script'}: name the script to run first, one of "
                         f"{', '.join(SCRIPTS)} (python -m extensions.run estimate_ppl.py --lm ...)")
    run.PROG_SUFFIX[:] = argv[:1]  # its usage line: python -m extensions.run sample.py
    try:
        SCRIPTS[argv[0]](argv[1:])
    finally:
        run.PROG_SUFFIX.clear()


if __name__ == '__main__':
    run_main(main)

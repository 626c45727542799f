#!/usr/bin/env bash
# The main job on a fresh machine: install what it needs, then reproduce Table 1 and the figures on Shakespeare.
# Extra arguments go to job/reproduce.py (e.g. --quick, --out_dir).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q -r requirements.txt
python -m job.reproduce "$@"

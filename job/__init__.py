"""The main job and its reports, each a script run from the repo root:

    python job/reproduce.py       the paper's Table 1, claims and figures, end to end (run.sh)
    python job/claims.py          the paper's claims C1-C7 and the talk's T1-T3, measured
    python job/figures.py         Figs. 1-4 from the main job's JSON
    python job/human_eval.py      Table 2's protocol: blinded A/B items, binomial test
    python job/bench.py           building blocks timed against naive baselines
"""

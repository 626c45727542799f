"""Beyond the paper: the residual form extended by Ji et al.'s talk (the metric energy of
"Language Model Decoding as Direct Metrics Optimization", ICLR 2024). The method imports nothing
from here: an energy of this package plugs in through the interface energy.py's docstring states
(metrics.py registers its loader with energy.register_energy_loader when imported; a method script
loads it when run through extensions.run).

    metrics.py        the metrics f_k, MetricEnergy (E = mu . f), fit_mu (moment matching)
    enumeration.py    every continuation of a short answer scored exactly (exact_logz.py's study)
    carry.py          addition's carry chains: exact match grouped by them, and their figure
    python -m extensions.metric_ebm    fits mu on the selection split; the talk's decoding table
    python -m extensions.exo           EXO (Ji et al., ICML 2024): the joint model distilled into an LM
    python -m extensions.addition_eval accuracy with a known answer, every decoder (data/addition)
    python -m extensions.run SCRIPT    estimate_ppl.py or sample.py with the metric energy plugged in
"""

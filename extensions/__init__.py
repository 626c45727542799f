"""Beyond the paper: the residual form extended by Ji et al.'s talk (the metric energy of
"Language Model Decoding as Direct Metrics Optimization", ICLR 2024):

    metrics.py        the metrics f_k, MetricEnergy (E = mu . f), fit_mu (moment matching)
    python extensions/metric_ebm.py    fits mu on the selection split; the talk's decoding table
"""

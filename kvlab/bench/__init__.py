"""Benchmarks: kvlab's engine against its peers on one workload, in one process
(``kvlab.bench.peers``, torch), and the workloads they run (``kvlab.bench.workload``, no torch).
``scripts/bench.py`` and ``scripts/profile_step.py`` drive them; notebooks 05 and 06 show what they
measure. Importing this package imports no torch.
"""

from .workload import Workload, ideal_prefill_fraction, sys512

__all__ = ["Workload", "ideal_prefill_fraction", "sys512"]

"""The confirmation round: paired re-measurement of the best candidates against the baseline.

plan (what to re-measure, how many runs), rounds (running them, at the end of a sweep),
verdicts (the paired speedups, as stored), in_process (alternating windows of one process).
"""

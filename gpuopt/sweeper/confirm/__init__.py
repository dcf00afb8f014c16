"""The confirmation round: paired re-measurement of the best candidates against the baseline."""

"""The stored study format, torch-free: what the sweeper writes into an Optuna study and the report
reads back. Both import it; it imports neither (only gpuopt.core).

- keys: every attr key, one spelling (`ATTR_*` a trial's, `STUDY_*` the study's);
- rules: status, feasibility, the baseline / best / same-training picks;
- records: the typed confirmation record (stored by one function, read by one);
- answers: what the confirmation and the two answers say, in words (summary and report alike);
- configs: a trial's stored resolved config, flattened for comparisons;
- storage: opening a storage (the sweeper's, with heartbeats; the report's, never creating one),
  the default-storage rule, listing and loading studies;
- export: a trial's overrides as a Hydra experiment config;
- attrs: writing a trial's user attrs in one storage transaction.
"""

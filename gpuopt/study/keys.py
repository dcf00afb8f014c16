"""Every attribute key gpuopt writes into an Optuna study, in one place and one spelling.

`ATTR_*` keys are a trial's attributes, `STUDY_*` the study's. The strings are the stored format:
existing studies hold them, so never change one. A result's own attrs are named in core/result.py
(their writer, which imports nothing of the study) and re-exported here, so readers take every key
from this module; every metric is stored flat under its own name.
"""

from __future__ import annotations

from gpuopt.core.result import (  # noqa: F401 (re-exported: every key from here)
    ATTR_CONFIG,
    ATTR_ENV,
    ATTR_NUMERICS,
    ATTR_PHASES,
    ATTR_PROFILE,
    ATTR_RANKS,
    ATTR_REASON,
    ATTR_STATUS,
    ATTR_WARNINGS,
)

# ---- trial user attrs, written by the sweeper (besides the result's, above) ----------------------
ATTR_OVERRIDES = "overrides"  # list[str]: the Hydra overrides that produced this trial
ATTR_RUN_DIR = "run_dir"  # the trial job's output directory
ATTR_BASELINE = "baseline"  # True on the trial measuring the user's config as composed
ATTR_TRACEBACK = "traceback"  # head and tail of an error trial's traceback or log
ATTR_LOGS = "logs"  # paths of the trial job's full stdout and stderr logs (gpuopt's launchers)
# The CUDA_VISIBLE_DEVICES value the trial's process got (absent: not pinned; launchers/gpus.py)
ATTR_VISIBLE_DEVICES = "cuda_visible_devices"
# {"host", "trials": [numbers]}: other trials that ran on the same host meanwhile (sweeper/trials.py)
ATTR_INTERFERENCE = "interference"
ATTR_INTERRUPTED = "interrupted"  # True on a trial whose sweep died under it
ATTR_RERUN_OF = "rerun_of"  # on the re-enqueued trial: number of the interrupted one
# A raced trial (gpuopt/sweeper/race/): {"seconds"} of a whole trial; a pruned one also the screen's
# {"ratio" (its window over the baseline's), "rank", "of", "window_s", "window"}
ATTR_RACE = "race"
ATTR_VOID = "void"  # why a trial was asked but never run (surplus, duplicate baseline)
# A configuration measured again (the space had none left unmeasured, or it was enqueued on
# purpose): the number of the first trial that measured it; its reading is pooled with that one's
# (gpuopt/sweeper/repeats.py, gpuopt/study/noise.py)
ATTR_REPLICATE_OF = "replicate_of"
# On a trial whose sampler asked a measured configuration again, an unmeasured one run instead:
# {"asked": the repeat's params as text, "repeat_of": the first trial of that configuration}
ATTR_REPLACES = "replaces"
# On a baseline that could not run as composed (e.g. a key only custom_search_space adds): why.
# Such a trial also has ATTR_VOID: it never counts towards n_trials, the failure rate or best.
ATTR_BASELINE_SKIPPED = "baseline_skipped"
# {file name: artifact id}: the trial's files in Optuna's artifact store (result.json,
# trace.json.gz; gpuopt/sweeper/trial_artifacts.py); Optuna's own `artifacts:<id>` system attrs list them
# for optuna-dashboard and `optuna.artifacts.get_all_artifact_meta`.
ATTR_ARTIFACTS = "artifacts"

# ---- trial system attrs -------------------------------------------------------------------------
ATTR_OWNER = "gpuopt:owner"  # {"host", "pid", "start"} of the sweeping process running it
ATTR_HEARTBEAT = "gpuopt:heartbeat"  # journal storage: unix time of the trial's last beat
# Optuna's own, written when gpuopt enqueues a trial by hand (what study.enqueue_trial writes) and
# read by GridSampler: the params a WAITING trial starts with, its grid point and grid.
ATTR_FIXED_PARAMS = "fixed_params"
ATTR_GRID_ID = "grid_id"
ATTR_SEARCH_SPACE = "search_space"

# ---- study user attrs ---------------------------------------------------------------------------
STUDY_OBJECTIVES = "objectives"  # list[str] metric names, in Optuna's value order
STUDY_DIRECTIONS = "directions"  # list[str] minimize | maximize
STUDY_HARDWARE = "hardware"  # hardware fingerprint the study was measured on
# The end-of-sweep re-measurement, baseline vs top-k (gpuopt.study.records.Confirmation)
STUDY_CONFIRMATION = "confirmation"
# {"trial": n, "profile": {...}}: the best trial's profiled run (sweeper/profiling.py)
STUDY_BEST_PROFILE = "best_profile"
# The directory of the FileSystemArtifactStore holding the trials' files and the report page
# (`optuna-dashboard <storage> --artifact-dir <it>`; gpuopt/sweeper/trial_artifacts.py)
STUDY_ARTIFACT_STORE = "artifact_store"
STUDY_SEEDS = "seeds"  # the expert seeds enqueued after the baseline, once (sweeper/baseline.py)
# {"factors", "total", "baseline", "declared"}: which keys make the global batch, and the
# baseline's values of them (sweeper/global_batch.py): the seeds, the race and the summary read it
STUDY_BATCH_RULE = "global_batch_rule"

# ---- study system attrs -------------------------------------------------------------------------
STUDY_CONFIRM_CLAIM = "gpuopt:confirm_claim"  # {"owner", "after_trials"}: who runs the confirmation

"""The autotuner: the planner's best layouts for a cluster, each run as a real launch of the user's own script
for a few optimizer steps, measured, and the measured best written as a config `shardwise run` takes.

    candidates(...)     the planner's ranked configs for the script's model on this cluster (candidates.py)
    run_trial(...)      one launch through `shardwise run`, stopped after S steps, measured or its failure named
    tune(...)           the trials in the planner's order within a budget; the best, and how good the plan was

Modules: `candidates`, `trial` (launch and failure kinds), `measure` (what a trial's run directory holds),
`accuracy` (prediction errors, Spearman's rho, regret), `results` (files and the console table), `tuner`,
`nodes` (a tuning run across nodes: node 0 announces each trial, every node launches its share and reports),
`bound` (the planner's early stop), `calibrate` (the cluster's constants fitted to the trials), `report`.
"""

from .accuracy import Accuracy, planner_accuracy, spearman
from .candidates import Candidate, candidates
from .measure import Measurement, measure_run
from .trial import FAILURE_KINDS, TrialResult, run_trial
from .tuner import METRICS, TuneResult, TuneSettings, tune

__all__ = ["Accuracy", "Candidate", "FAILURE_KINDS", "METRICS", "Measurement", "TrialResult", "TuneResult",
           "TuneSettings", "candidates", "measure_run", "planner_accuracy", "run_trial", "spearman", "tune"]

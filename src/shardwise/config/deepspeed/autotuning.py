"""DeepSpeed's `autotuning` block, read by `shardwise tune --config` (docs/tune.md): each key that has a meaning in
shardwise's tuner becomes one of its settings, every other key is listed with why. `shardwise run` tunes nothing,
so there the mapped keys are noted as read by `shardwise tune`. Pure: no torch.

    {"autotuning": {"enabled": true, "metric": "latency", "start_profile_step": 2, "end_profile_step": 4,
                    "tuner_num_trials": 4, "tuner_early_stopping": 2, "results_dir": "tuned"}}
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import ConfigError
from .translation import Translation, check_keys, enabled

# Every key of DeepSpeed 0.19's autotuning config.
KEYS = ("enabled", "fast", "results_dir", "exps_dir", "overwrite", "metric", "metric_path", "start_profile_step",
        "end_profile_step", "tuner_type", "tuner_early_stopping", "tuner_num_trials", "arg_mappings", "model_info",
        "model_info_path", "mp_size", "max_train_batch_size", "min_train_batch_size",
        "max_train_micro_batch_size_per_gpu", "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes")
METRICS = ("throughput", "latency", "flops")
TUNER_TYPES = ("gridsearch", "random", "model_based")

# Mapped key → (`shardwise tune`'s setting, how it is read).
MAPPED = {
    "metric": ("metric", "--metric: throughput (samples/s) or latency (step time); flops is not built"),
    "start_profile_step": ("warmup", "measured from this optimizer step on (--warmup = it - 1)"),
    "end_profile_step": ("steps", "each trial stops after this optimizer step (--steps)"),
    "fast": ("fast", "true: each layout once, in the planner's best variant (what shardwise tune does); false is "
             "not built"),
    "tuner_type": ("order", "model_based and gridsearch: the planner's order (its cost model ranks the layouts); "
                   "random: the fitting layouts in a random order (seed 0)"),
    "tuner_early_stopping": ("early_stopping", "--early-stopping: stop after this many trials in a row that do not "
                             "beat the best"),
    "tuner_num_trials": ("trials", "--trials"),
    "results_dir": ("results", "--results: trials.jsonl, best_config.json, best_cmd.txt, summary.json"),
    "exps_dir": ("runs_dir", "--runs-dir: each trial's run directory"),
    "overwrite": ("overwrite", "--overwrite: true replaces earlier results in results_dir; false refuses them"),
    "num_tuning_micro_batch_sizes": ("micro_batch_sizes", "--micro-batch-sizes: at most this many micro batch sizes "
                                     "(microbatch counts at the planned global batch) per layout"),
    "arg_mappings": ("arg_mappings", "--arg-mapping: each trial passes its train_micro_batch_size_per_gpu, "
                     "gradient_accumulation_steps or train_batch_size to the script as the mapped argument"),
    "min_train_micro_batch_size_per_gpu": ("min_micro_batch", "--min-micro-batch: no trial runs fewer sequences "
                                           "per rank per microbatch"),
    "max_train_micro_batch_size_per_gpu": ("max_micro_batch", "--max-micro-batch: no trial runs more sequences "
                                           "per rank per microbatch"),
}
# The config values a trial can pass to the script through arg_mappings (tune/candidates.py Candidate.batch_values).
ARG_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
_BATCH = ("the global batch is the planned one (--global-batch): shardwise tune tries layouts (degrees, ZeRO stage, "
          "MiCS group, microbatches, offload), and micro batch sizes within that batch, not batch sizes")
NOT_BUILT = {
    "max_train_batch_size": _BATCH, "min_train_batch_size": _BATCH,
    "mp_size": "the planner searches tensor_parallel_degree itself",
    "model_info": "the planner reads the model from shardwise tune --model", "model_info_path": "the same",
    "metric_path": "each trial's metrics are in its run directory's metrics/ and in trials.jsonl",
}


def _check_values(t: Translation, section: Mapping[str, Any]) -> None:
    metric, kind = section.get("metric"), section.get("tuner_type")
    if metric is not None and metric not in METRICS:
        t.problem("autotuning.metric", metric, f"is not one DeepSpeed accepts: {', '.join(METRICS)}",
                  "use throughput or latency")
    elif metric == "flops":
        t.problem("autotuning.metric", metric, "is not built in shardwise tune (it compares measured samples/s "
                  "or step time)", "use throughput or latency")
    if kind is not None and kind not in TUNER_TYPES:
        t.problem("autotuning.tuner_type", kind, f"is not one DeepSpeed accepts: {', '.join(TUNER_TYPES)}",
                  "use model_based, gridsearch or random")
    mappings = section.get("arg_mappings")
    if mappings is not None:
        if not isinstance(mappings, Mapping) or not all(isinstance(v, str) and v.startswith("-")
                                                        for v in mappings.values()):
            t.problem("autotuning.arg_mappings", mappings, "must map config keys to the script's arguments",
                      'e.g. {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}')
        else:
            for key in mappings:
                if key not in ARG_KEYS:
                    t.problem(f"autotuning.arg_mappings.{key}", mappings[key], "is not a value a trial sets "
                              "(shardwise tune tries layouts and micro batch sizes)", f"map one of {', '.join(ARG_KEYS)}")
    for key in ("start_profile_step", "end_profile_step", "tuner_early_stopping", "tuner_num_trials",
                "num_tuning_micro_batch_sizes", "min_train_micro_batch_size_per_gpu",
                "max_train_micro_batch_size_per_gpu"):
        value = section.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            t.problem(f"autotuning.{key}", value, "must be a whole number of 1 or more", "e.g. 3")
    low, high = section.get("min_train_micro_batch_size_per_gpu"), section.get("max_train_micro_batch_size_per_gpu")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        t.problem("autotuning.min_train_micro_batch_size_per_gpu", low,
                  f"is above max_train_micro_batch_size_per_gpu {high}", "give a range whose minimum is the smaller")
    start, end = section.get("start_profile_step"), section.get("end_profile_step")
    if isinstance(start, int) and isinstance(end, int) and start > end:
        t.problem("autotuning.start_profile_step", start, f"is after end_profile_step {end}",
                  "profile from a step at or before end_profile_step")


def translate_autotuning(t: Translation, section: Mapping[str, Any]) -> None:
    """For `shardwise run`, which tunes nothing (nor does DeepSpeed without --autotuning): the mapped keys noted as
    read by `shardwise tune --config`, the rest listed; its values are checked by `tune_settings`."""
    if not enabled(section):
        return
    for key in section:
        if key in MAPPED:
            t.note(f"autotuning.{key}", f"read by shardwise tune --config as {MAPPED[key][1]}")
        elif key != "enabled":
            t.ignore(f"autotuning.{key}", NOT_BUILT.get(key, "DeepSpeed's autotuner reads no such key"))


def tune_settings(data: Mapping[str, Any]) -> dict[str, Any]:
    """The `shardwise tune` settings a DeepSpeed config's enabled `autotuning` block sets ({} without one); a
    ConfigError for a value DeepSpeed refuses or shardwise tune cannot honour (fast false, metric flops)."""
    section = data.get("autotuning")
    if not isinstance(section, Mapping) or not enabled(section):
        return {}
    t = Translation()
    if check_keys(t, "autotuning", section, KEYS):
        _check_values(t, section)
    if section.get("fast") is False:
        t.problem("autotuning.fast", False, "is not built: shardwise tune runs each layout once, in the planner's "
                  "best variant", "set fast to true or leave it out")
    if t.problems:
        raise ConfigError(t.problems)
    settings = {MAPPED[key][0]: value for key, value in section.items() if key in MAPPED and key != "fast"}
    if "warmup" in settings:
        settings["warmup"] -= 1
    return settings

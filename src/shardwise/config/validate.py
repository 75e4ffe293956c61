"""Turn a plain dict into a `ShardwiseConfig`, collecting every problem first.

These are the rules that need no cluster. `init`, `check-config` and `run` all
call `topology.layout.validate`, which adds the features this release lacks and
the layout on the cluster to these, so they can never disagree about what is valid.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pydantic import ValidationError

from .blocks import block_problems
from ..errors import ConfigError, Problem, did_you_mean
from .hpz import hpz_problems
from .pipeline import pipeline_problems
from .schema import ShardwiseConfig, field_names, unavailable_features
from .smp_forms import translate
from .sources import ConfigSource, load_dict

_FIXES = {
    "greater_than_equal": "use {limit} or more",
    "greater_than": "use a value above {limit}",
    "less_than_equal": "use {limit} or less",
    "bool_type": "use true or false",
    "int_type": "use a whole number",
    "float_type": "use a number",
    "literal_error": "use one of {expected}",
}


def _pydantic_problems(err: ValidationError, data: Mapping[str, Any]) -> list[Problem]:
    problems = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"])
        ctx = item.get("ctx", {})
        limit = next((ctx[bound] for bound in ("ge", "gt", "le") if bound in ctx), "")
        fix = _FIXES.get(item["type"], "see the config reference in the README")
        fix = fix.format(limit=limit, expected=ctx.get("expected", ""))
        rule = item["msg"][:1].lower() + item["msg"][1:]  # pydantic's sentence, inside ours
        problems.append(Problem(key, _given(data, item["loc"], item.get("input")), rule, fix))
    return problems


def _given(data: Mapping[str, Any], loc: tuple, fallback: Any) -> Any:
    """The value at `loc` as the config gave it (a nested key's own value, not its whole section)."""
    value: Any = data
    for part in loc:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and isinstance(part, int) and part < len(value):
            value = value[part]
        else:
            return fallback
    return value


def _rule_problems(c: ShardwiseConfig) -> Iterable[Problem]:
    tp = c.tensor_parallel_degree
    if tp & (tp - 1):
        lower = 1 << (tp.bit_length() - 1)
        yield Problem("tensor_parallel_degree", tp, "must be a power of two",
                      f"use {lower} or {lower * 2}")
    if c.sequence_parallel and tp == 1:
        yield Problem("sequence_parallel", True, "needs tensor_parallel_degree > 1 (it shards what tensor "
                      "parallelism leaves whole)", "set tensor_parallel_degree to 2 or more, or drop sequence_parallel")
    if c.sequence_parallel_regather and not c.sequence_parallel:
        yield Problem("sequence_parallel_regather", True, "needs sequence_parallel (it keeps the sequence shards "
                      "of the inputs sequence parallelism gathers)", "set sequence_parallel: true, or drop "
                      "sequence_parallel_regather")
    if c.sequence_parallel and c.pipeline_parallel_degree > 1 and c.fp16:
        yield Problem("sequence_parallel", True, "is not available with fp16 under a pipeline yet (it does not "
                      "train the same weights as one process there)", "use bf16, or drop sequence_parallel")
    if c.sequence_parallel and c.pipeline_parallel_degree > 1 and c.pipeline_cut == "graph":
        yield Problem("sequence_parallel", True, "is not available with pipeline_cut 'graph' yet",
                      "cut along the blocks (pipeline_cut: blocks), or drop sequence_parallel")
    if c.bf16 and c.fp16:
        yield Problem("fp16", True, "bf16 and fp16 cannot both be on", "set only one of them")
    if c.bf16_master_weights_and_grads and not c.bf16:
        yield Problem("bf16_master_weights_and_grads", True, "is pure bf16 and needs bf16: true"
                      + (" (fp16 always keeps fp32 masters)" if c.fp16 else ""),
                      "set bf16: true" + (" and fp16: false" if c.fp16 else "")
                      + ", or drop bf16_master_weights_and_grads")
    if c.pure_bf16 and c.offload_optimizer_state and c.effective_zero_stage == 1:
        yield Problem("offload_optimizer_state", True, "under ZeRO-1 offloads fp32 master weights, which pure bf16 "
                      "(bf16_master_weights_and_grads) does not keep",
                      "use ZeRO-2/3 to offload bf16 states, or drop one of the two")
    if c.accumulate_gradients_locally and not c.sharded_master_weights:
        yield Problem("accumulate_gradients_locally", True, "accumulates ZeRO-1's gradients for its fp32 master "
                      "weights, which this config does not keep (they need zero_stage 1 with bf16 or fp16, not pure "
                      "bf16)", "set zero_stage: 1 with bf16 or fp16, or drop accumulate_gradients_locally")
    pp = c.pipeline_parallel_degree
    if c.default_partition >= pp:
        yield Problem("default_partition", c.default_partition, f"must be a pipeline stage, below "
                      f"pipeline_parallel_degree ({pp})",
                      f"use 0 to {pp - 1}" if pp > 1 else "drop it, or set pipeline_parallel_degree above 1")
    stage = c.zero_stage
    if stage is not None:
        if c.shard_optimizer_state and stage != 1:
            yield Problem("zero_stage", stage, "conflicts with shard_optimizer_state (which is ZeRO-1)",
                          "set zero_stage to 1, or drop shard_optimizer_state")
        if stage < 2 and c.sharded_data_parallel_degree > 1:
            yield Problem("zero_stage", stage,
                          "sharded_data_parallel_degree > 1 shards parameters or gradients (stage 2 or 3)",
                          "set zero_stage to 2 or 3, or sharded_data_parallel_degree to 1")
    elif c.shard_optimizer_state and c.sharded_data_parallel_degree > 1:
        yield Problem("shard_optimizer_state", True,
                      "conflicts with sharded_data_parallel_degree > 1 (which already shards optimizer states)",
                      "drop shard_optimizer_state, or set sharded_data_parallel_degree to 1")
    yield from pipeline_problems(c)
    yield from hpz_problems(c)


def _indivisible(total: int, key: str, factor: int, dp: int) -> Problem:
    return Problem("train_batch_size", total, f"train_batch_size {total} is not divisible by {key} {factor} x "
                   f"data-parallel ranks {dp} = {factor * dp}", f"use a multiple of {factor * dp}, or change {key}")


def _worked_out(c: ShardwiseConfig, **values: int) -> ShardwiseConfig:
    """`c` with `values` worked out from its own keys, still counted as unset: the run directory records the
    user's keys, and each rank works them out again for its own data-parallel degree."""
    return ShardwiseConfig.model_construct(_fields_set=c.model_fields_set, **{**dict(c), **values})


def batch_triple(c: ShardwiseConfig, dp: int) -> tuple[ShardwiseConfig, list[Problem]]:
    """DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
    (microbatches) x data-parallel ranks, once `dp` is known: the config with the value left out worked out from
    the other two as DeepSpeed does (the micro batch from train_batch_size alone, with accumulation 1), or the
    problem when they do not agree."""
    total, micro, steps = c.train_batch_size, c.train_micro_batch_size_per_gpu, c.microbatches
    if total is None:
        return (c, []) if micro is None else (_worked_out(c, train_batch_size=micro * steps * dp), [])
    if micro is None:
        if total % (steps * dp):
            return c, [_indivisible(total, "gradient_accumulation_steps", steps, dp)]
        return _worked_out(c, train_micro_batch_size_per_gpu=total // (steps * dp)), []
    if "microbatches" not in c.model_fields_set:
        if total % (micro * dp):
            return c, [_indivisible(total, "train_micro_batch_size_per_gpu", micro, dp)]
        worked_out = _worked_out(c, microbatches=total // (micro * dp))
        return worked_out, list(pipeline_problems(worked_out))  # a pipeline runs them in rounds
    if total != micro * steps * dp:
        return c, [Problem("train_batch_size", total, f"train_batch_size {total} != micro {micro} x "
                           f"gradient_accumulation_steps {steps} x data-parallel ranks {dp} = {micro * steps * dp}",
                           f"set train_batch_size to {micro * steps * dp}, or change the micro batch or "
                           "gradient_accumulation_steps (microbatches) so the product is it")]
    return c, []


def config_problems(data: Mapping[str, Any]) -> tuple[ShardwiseConfig, list[Problem]]:
    """The config of the well-typed keys and every unknown-key, field and rule problem, so callers
    that add more rules (the layout on a cluster) can report everything in one pass."""
    known = field_names()
    data, problems = translate(data)
    for key in data:
        if key not in known:
            hint = did_you_mean(str(key), known)
            problems.append(Problem(str(key), data[key], "unknown key",
                                    hint or "remove it; valid keys are listed in the README's config reference"))
    clean = {k: v for k, v in data.items() if k in known}
    for key in ("optimizer", "scheduler"):  # checked here, so that a broken block is one problem per value
        found = block_problems(key, clean[key]) if clean.get(key) is not None else []
        if found:
            problems.extend(found)
            del clean[key]
    try:
        config = ShardwiseConfig(**clean)
    except ValidationError as err:
        problems.extend(_pydantic_problems(err, clean))
        broken = {item["loc"][0] for item in err.errors()}
        # Check the remaining rules on the well-typed keys, so one pass reports everything.
        config = ShardwiseConfig(**{k: v for k, v in clean.items() if k not in broken})
    problems.extend(_rule_problems(config))
    return config, problems


def parse_config(data: Mapping[str, Any]) -> ShardwiseConfig:
    """Validate a dict of SMP keys without a cluster (the planner's candidates); raise one ConfigError."""
    config, problems = config_problems(data)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(source: ConfigSource = None, overrides: Iterable[str] = ()) -> ShardwiseConfig:
    """Read, merge and validate without a cluster."""
    return parse_config(load_dict(source, overrides))


def unavailable_problems(config: ShardwiseConfig) -> list[Problem]:
    """Settings whose feature this release cannot run yet: refused rather than silently ignored."""
    return [Problem(key, value, "this feature is not available yet in this shardwise release",
                    "remove the key (or set it to its default) for now") for key, value in unavailable_features(config)]

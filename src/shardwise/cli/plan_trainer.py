"""`shardwise plan --training-args`: the layouts for a Hugging Face Trainer run, planned from its TrainingArguments.

The arguments fix what the script fixes: each replica's rows per micro-step (`per_device_train_batch_size`, so
the global batch is that times the devices), the precision and the activation checkpointing; with
`--deepspeed ds.json` among them the plan is that config's one layout, its "auto" values filled as the Trainer
fills them on the planned cluster. The plan is per micro-step: gradient accumulation repeats it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config.layout import validate
from ..config.sources import read_deepspeed
from ..planner import ClusterSpec, ModelSpec, Plan, PlanError, evaluate, plan


def _refuse_overlaps(args: argparse.Namespace) -> None:
    given = {"--config": args.config, "--precision": args.precision, "--global-batch": args.global_batch,
             "--checkpointing": args.checkpointing != "none"}
    for flag, value in given.items():
        if value:
            raise PlanError(f"{flag} does not go with --training-args: the TrainingArguments set it; drop {flag}")


def trainer_plan(args: argparse.Namespace, spec: ModelSpec, cluster: ClusterSpec) -> Plan:
    """The plan for the Trainer run `args.training_args` describes (a JSON file or the script's flags)."""
    _refuse_overlaps(args)
    from ..hf.plan import trainer_run  # transformers, only for a Trainer run

    run = trainer_run(args.training_args, cluster.world_size)
    if run.deepspeed is not None:
        config, layout = validate(read_deepspeed(run.deepspeed), cluster.topology)
        if not cluster.device.supports(config.dtype_name):
            raise PlanError(f"the TrainingArguments' precision {config.dtype_name} is not supported by "
                            f"{cluster.device.name}")
        batch = run.global_batch(layout.dp)
        e = evaluate(spec, cluster, read_deepspeed(run.deepspeed), global_batch=batch, seq=args.seq,
                     checkpointing=run.checkpointing)
        result = Plan(spec, cluster, batch, args.seq or spec.seq_len, config.dtype_name, [e])
    else:
        result = plan(spec, cluster, global_batch=run.global_batch(cluster.world_size), seq=args.seq,
                      precision=run.precision)
        # The script's checkpointing is the Trainer's (one region per block) or none; rejections made before any
        # checkpointing was chosen (the degrees) stay listed.
        kept = [e for e in result.considered if e.checkpointing == run.checkpointing or e.memory is None]
        result = dataclasses.replace(result, considered=kept)
    if result.best is not None:
        print(f"for the Trainer: per_device_train_batch_size {result.best.batch_size} (each of the "
              f"{result.best.layout.dp} replicas' rows per micro-step, {result.global_batch} in all), "
              f"gradient_accumulation_steps {run.accumulation}", file=sys.stderr)
    return result

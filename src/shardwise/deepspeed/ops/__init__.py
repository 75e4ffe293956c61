"""`deepspeed.ops`: the optimizers scripts construct themselves (`deepspeed.ops.adam.FusedAdam`, ...)."""

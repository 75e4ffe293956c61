"""ZeRO-1: each data-parallel replica keeps optimizer state for its share of the parameters only.

- `shares.py`: who owns which parameter and how gradients and broadcasts are
  bucketed (pure rules the planner runs too);
- `optimizer_state.py`: the user's optimizer keeps its share of the param groups;
- `master_weights.py` and `gradient_buckets.py`: in bf16/fp16 the replicas hold
  half-precision parameters, gradients travel to their owners during backward and
  each owner keeps fp32 master copies of its share;
- `parameter_broadcasts.py`: the owners' updated parameters reach every replica
  while the next forward runs;
- `update.py`: `Zero1`, chosen by the composition, and the optimizer step that ties them together.

No eager imports here: the planner reads `shares` without loading torch.
"""

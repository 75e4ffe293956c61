"""`deepspeed.moe.utils`: the optimizer-group helper dense DeepSpeed scripts call unconditionally."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: Any) -> bool:
    """DeepSpeed marks expert parameters `allreduce=False`; shardwise builds no expert layers."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]],
        max_group_size: int = 178956971) -> list[dict[str, Any]]:
    """DeepSpeed moves expert parameters into groups of their own; a model without experts keeps its groups as
    they are (as a list of dicts). Expert parameters (DeepSpeed's MoE layers) are refused: expert parallelism is
    not built yet."""
    groups = [dict(param_groups)] if isinstance(param_groups, Mapping) else [dict(group) for group in param_groups]
    if any(is_moe_param(p) for group in groups for p in group["params"]):
        raise ValueError("split_params_into_different_moe_groups_for_optimizer: the model has DeepSpeed MoE "
                         "(expert) parameters, and shardwise has no expert parallelism yet; train a dense model")
    return groups

"""DeepSpeed's process topologies: named axes over the ranks, row-major (the last axis is the innermost).

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)   # axes pipe, data, model
    topo.get_coord(5)            # ProcessCoord(pipe=1, data=0, model=1)
    topo.get_axis_comm_lists("pipe")   # [[0, 4], [1, 5], [2, 6], [3, 7]]

Pure Python, as DeepSpeed's: nothing here makes a process group. DeepSpeed's
topologies number the ranks pipe, data, model, outermost first: shardwise's
`placement_strategy: PDT` (its default, DPT, puts the replicas outermost), which a
PipelineModule asks for (`PipelineModule.shardwise_config`). `layout_problem`
refuses a topology numbering ranks in another order. (DeepSpeed's
`PipelineParallelGrid`, which builds the groups, has no counterpart: shardwise's
mesh builds them.)
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any


class ProcessTopology:
    """Maps coordinates on named axes (`axes`, each of length `dims[i]`) to ranks, row-major."""

    def __init__(self, axes: list[str], dims: list[int]):
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping = {self.ProcessCoord(*coord): rank
                        for rank, coord in enumerate(product(*(range(d) for d in dims)))}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the coordinate given on every axis, e.g. `get_rank(pipe=1, data=0)`."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Any = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """`rank`'s coordinate on the axes not omitted, e.g. 'model_01' (DeepSpeed names checkpoint files so)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in frozenset(omit_axes))

    def get_dim(self, axis: str) -> int:
        """The number of ranks along `axis`; 0 for an axis the topology does not have."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, index in self.mapping.items():
            if index == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology.")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Per coordinate on the other axes, the ranks along `axis` (a communicator's members); [] for no axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinate matches every given axis."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, key) == value for key, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        position = self.axes.index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[position] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline outermost, data parallel innermost: replicas' gradient reductions stay on near ranks."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism, model innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


LAYOUT_AXES = ("pipe", "data", "model")  # shardwise's placement PDT: pipeline, data, tensor parallel


def layout_problem(topology: ProcessTopology) -> str | None:
    """Why shardwise's layout cannot number the ranks as `topology` does, or None: its axes must be pipe, then
    data, then model (each but pipe optional), as placement_strategy PDT orders pp, dp and tp."""
    axes = list(topology.get_axis_names())
    if "pipe" not in axes or [a for a in LAYOUT_AXES if a in axes] != axes:
        return (f"the topology's axes {axes} are not pipe, data, model (outermost first), the order shardwise "
                "numbers ranks in")
    return None

"""Test parallel code on real multi-process worlds, as shardwise's own tests do.

`run_distributed(fn, world_size, ...)` runs a module-level function on every rank
of a fresh process group (gloo on CPU; the accelerator's backend with one device
per rank where there are enough devices) and returns the results by rank.

- Worker processes are pooled per world size and reused, because starting
  Python + torch costs seconds each; they are forked from one process that has
  imported torch.distributed, and whatever `preload(*modules)` names, once. A
  call that fails or times out replaces its pool, so no state from a broken call
  reaches the next one.
- Rendezvous goes through a FileStore in a fresh temp dir: no ports, no races.
- Every call has a hard timeout; hung ranks' stacks are put into the TimeoutError.
- Worker output is kept out of the way on success and shown in the error on failure.

    import torch, torch.distributed as dist
    from shardwise.testing import run_distributed

    def total(x):
        t = torch.tensor([x * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def test_total():
        assert run_distributed(total, 2, 1.0) == [3.0, 3.0]

Workers are started with "forkserver" (or "spawn"), so a script (not a test) that
calls `run_distributed` needs the usual `if __name__ == "__main__":` guard.
"""

from ._harness import DistributedTestError, distributed, run_distributed, shutdown_pools
from ._pool import preload

__all__ = ["DistributedTestError", "distributed", "preload", "run_distributed", "shutdown_pools"]

"""The SMP v1 front end: `smp.nn`, `smp.amp`, `smp.utils` and `smp.patches`.

Scripts reach them as SMP does, `import shardwise as smp; smp.nn.FusedLayerNorm`, or
by SMP's import paths with only the package changed (`from shardwise.nn import
FusedLayerNorm`); `shardwise/__init__.py` serves those paths from here. SMP's core
calls (`smp.init`, `smp.DistributedModel`, `smp.step`, ...) are the core's own.
"""

"""The private transformers and accelerate members shardwise.hf relies on (see `shardwise.hf.internals`).

Each still exists with the parameters assumed and is still called where the Trainer's loop calls it, so an
upgrade that moves one fails here, by name; and the list is the mixin's: every private Trainer method it
overrides is listed, and every listed one it overrides.
"""

from __future__ import annotations

import transformers

from shardwise.hf import ShardwiseTrainerMixin
from shardwise.hf.internals import TRAINER_HOOKS, TRAINER_OVERRIDES, problems


def test_every_private_member_relied_on_is_there_and_called():
    assert problems() == []


def test_the_list_is_what_the_mixin_overrides():
    own = {name for name in vars(ShardwiseTrainerMixin) if callable(getattr(ShardwiseTrainerMixin, name))}
    private = {name for name in own if name.startswith("_") and not name.startswith("__")
               and hasattr(transformers.Trainer, name)}
    assert private == set(TRAINER_OVERRIDES)
    assert set(TRAINER_HOOKS) <= own

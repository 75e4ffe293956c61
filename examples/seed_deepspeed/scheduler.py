"""Seed 003's DeepSpeed scheduler sample ("sheduler"), with only the imports changed (the sample itself
omits `import torch` and `import deepspeed`; they are added here).

    shardwise run --nproc-per-node 2 examples/seed_deepspeed/scheduler.py

Its config has an optimizer block and the script passes an optimizer too: the script's wins, as in
DeepSpeed. It then steps the scheduler itself after `model_engine.step()`, which steps it already: in
DeepSpeed too the schedule then advances twice per step.
"""
import torch
import shardwise.deepspeed as deepspeed
import torch.nn as nn
import torch.optim as optim

# Model definition
class SimpleModel(nn.Module):
    def __init__(self):
        super(SimpleModel, self).__init__()
        self.fc = nn.Linear(10, 1)

    def forward(self, x):
        return self.fc(x)

# Initialize model and optimizer
model = SimpleModel()
optimizer = optim.Adam(model.parameters(), lr=0.01)

# DeepSpeed configuration for optimizer and scheduler
ds_config = {
    "train_batch_size": 8,
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 0.01,
        }
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.001,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 100
        }
    }
}

# Initialize DeepSpeed with model and optimizer
model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config_params=ds_config)

# Sample input and forward pass
inputs = torch.randn(8, 10)
outputs = model_engine(inputs)
loss = outputs.mean()

# Backward pass and step
model_engine.backward(loss)
model_engine.step()
lr_scheduler.step()

"""A data-parallel DeepSpeed training script, written as DeepSpeed users write them, run by shardwise.

    shardwise run --nproc-per-node 2 examples/deepspeed/train_classifier.py --deepspeed --stage 3
    shardwise run --nproc-per-node 2 examples/deepspeed/train_classifier.py --deepspeed_config ds_config.json

Only the import says shardwise: `import deepspeed` runs it under DeepSpeed (bench/deepspeed_parity.py does).
The config is built here from --stage (as DeepSpeedExamples' CIFAR-10 script builds its own) unless
--deepspeed_config is given; the data is synthetic (a fixed random linear rule, so the loss falls).
With --save-dir it saves after optimizer step --save-at, with its epoch and micro-step as client state, and
trains on; started again with --resume it loads the latest checkpoint and skips the batches trained before
it, as DeepSpeed scripts do.
"""

import argparse

import torch
import torch.nn.functional as F

import shardwise.deepspeed as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="synthetic classification with DeepSpeed")
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage when the config is built here")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save-dir", default=None)
    parser.add_argument("--save-at", type=int, default=2, help="the optimizer step after which to save")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self, features=32, hidden=64, classes=10):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.GELU(),
                                        torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def dataset(samples, features=32, classes=10):
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(samples, features, generator=generator)
    rule = torch.randn(features, classes, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs @ rule).argmax(dim=1))


def config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accumulation,
        "steps_per_print": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-6,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
    }


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    model = Net()
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset(args.samples),
        config=None if args.deepspeed_config else config(args))
    start_epoch, skip = 0, 0
    if args.resume:
        _, client_state = engine.load_checkpoint(args.save_dir)
        if client_state is not None:
            start_epoch, skip = client_state["epoch"], client_state["micro_step"] + 1
    for epoch in range(start_epoch, args.epochs):
        for micro_step, (inputs, labels) in enumerate(loader):
            if epoch == start_epoch and micro_step < skip:
                continue  # trained before the checkpoint
            loss = F.cross_entropy(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            if (args.save_dir and not args.resume and engine.micro_steps % engine.gradient_accumulation_steps() == 0
                    and engine.global_steps == args.save_at):
                engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch, "micro_step": micro_step})
            if engine.global_rank == 0 and engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()

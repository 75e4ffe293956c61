"""A DeepSpeed pipeline script (PipelineModule, LayerSpec, TiedLayerSpec, RepeatingLoader, train_batch), run
by shardwise.

    shardwise run --nproc-per-node 2 examples/deepspeed/train_pipeline.py --stages 2 \\
        --deepspeed_config examples/deepspeed/pipeline_config.json

The shape of DeepSpeedExamples' pipeline_parallelism/train.py: layers as specs, the stages and partition
method given to PipelineModule, `deepspeed.initialize` on it, then `engine.train_batch()` per global batch. Here
a small language model whose token embedding is tied to its output projection (a TiedLayerSpec on the first
and last stage), on synthetic tokens. Only the import says shardwise.
"""

import argparse

import torch
import torch.nn.functional as F

import shardwise.deepspeed as deepspeed
from shardwise.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.deepspeed.utils import RepeatingLoader

VOCAB, HIDDEN, SEQ = 64, 32, 12


def parse_args():
    parser = argparse.ArgumentParser(description="a small pipelined language model")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--partition", default="parameters")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def embed(embedding, ids):
    return embedding(ids)


def unembed(embedding, hidden):
    return F.linear(hidden, embedding.weight)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tokens(samples=256):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return torch.utils.data.TensorDataset(ids, torch.roll(ids, -1, dims=1))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    deepspeed.runtime.utils.set_random_seed(1138)
    layers = [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=embed),
              *[LayerSpec(Block, HIDDEN) for _ in range(4)],
              LayerSpec(torch.nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=unembed)]
    net = PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=args.stages, partition_method=args.partition)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                training_data=tokens())
    batches = iter(RepeatingLoader(loader))
    for step in range(args.steps):
        loss = engine.train_batch(data_iter=batches)
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()

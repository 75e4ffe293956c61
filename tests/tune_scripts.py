"""The training script the tuner's launch tests run (written out as a module, so the planner builds its model from
`<module>:build`)."""

# Trains a 2-layer MLP with sw. Given --steps it trains that many and each rank writes the config it trained under
# (and --accum, which a tuner's arg_mappings may set) to trained<rank>.json; without, it runs far more steps than a
# trial, so only a trial's step limit ends it. With --inject-failures, under ZeRO-3 every rank crashes at once and
# under ZeRO-2 rank 1 runs out of memory under a cap on its address space. DeepSpeed's own flags are let through.
TRAIN_SCRIPT = '''
import argparse, json, os, resource
import torch
import shardwise as sw


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def example_inputs(batch, seq):
    return torch.randn(batch, 16)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--accum", type=int, default=0)
    p.add_argument("--inject-failures", action="store_true")
    args, _ = p.parse_known_args()  # --deepspeed and --deepspeed_config are DeepSpeed's
    sw.init()
    config = json.load(open(os.environ["SHARDWISE_CONFIG"]))
    if args.inject_failures and config.get("zero_stage") == 3:
        raise RuntimeError("injected crash under ZeRO-3")
    if args.inject_failures and config.get("zero_stage") == 2 and sw.rank() == 1:
        size = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        torch.ones(1 << 30, dtype=torch.uint8)
    model = sw.DistributedModel(build())
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @sw.step
    def train_step(model, x):
        loss = torch.nn.functional.mse_loss(model(x), x)
        model.backward(loss)
        return loss

    for _ in range(args.steps or 1000):
        optimizer.zero_grad()
        train_step(model, torch.randn(4, 16)).reduce_mean()
        optimizer.step()
    if args.steps is None:
        raise SystemExit("the step limit did not stop the run")
    with open(f"trained{sw.rank()}.json", "w") as f:
        json.dump({"config": config, "steps": args.steps, "accum": args.accum}, f)
'''

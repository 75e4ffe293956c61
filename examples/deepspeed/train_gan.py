"""Two DeepSpeed engines in one script, a GAN's discriminator and generator, run by shardwise.

    shardwise run --nproc-per-node 2 examples/deepspeed/train_gan.py --deepspeed_config examples/deepspeed/gan_config.json

The shape of DeepSpeedExamples' DCGAN: one config for both engines, each engine given the script's own
torch optimizer, the discriminator stepped on real and generated rows, the generator through the
discriminator module itself (DeepSpeed refuses a backward through another engine's forward). Small
fully connected players on synthetic 2-D data keep it quick on a CPU. Only the import says shardwise.
"""

import argparse

import torch
import torch.nn.functional as F

import shardwise.deepspeed as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="a small GAN with two DeepSpeed engines")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--noise", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def ring(samples, noise):
    """Points on a noisy ring (what the generator learns to draw), each with the noise the generator turns into
    a fake one beside it."""
    generator = torch.Generator().manual_seed(3)
    angle = torch.rand(samples, generator=generator) * 6.2832
    points = torch.stack([angle.cos(), angle.sin()], dim=1) + 0.05 * torch.randn(samples, 2, generator=generator)
    return torch.utils.data.TensorDataset(points, torch.randn(samples, noise, generator=generator))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    netG = torch.nn.Sequential(torch.nn.Linear(args.noise, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    netD = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    engineD, optimizerD, loader, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                          optimizer=optimizerD, training_data=ring(512, args.noise))
    engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                     optimizer=optimizerG)
    for step, (real, noise) in enumerate(loader):
        if step == args.steps:
            break
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        fake = engineG(noise)
        errD_real = F.binary_cross_entropy_with_logits(engineD(real), ones)
        engineD.backward(errD_real)
        errD_fake = F.binary_cross_entropy_with_logits(engineD(fake.detach()), zeros)
        engineD.backward(errD_fake)
        engineD.step()
        errG = F.binary_cross_entropy_with_logits(netD(fake), ones)  # the module itself: D only passes G's gradient
        engineG.backward(errG)
        engineG.step()
        engineD.zero_grad()  # the generator's backward passed through the discriminator
        if engineD.global_rank == 0:
            print(f"step {step} loss_D {(errD_real + errD_fake).item():.6f} loss_G {errG.item():.6f}", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Train the tiny AutoencoderKL of the diffusion examples on the tiny_shapes images, and ship its weights.

The examples' VAE is frozen during diffusion training, so a randomly initialised one would turn every sample
into noise; this script trains it briefly (reconstruction + a small KL term, seeded, a few minutes on a CPU) and
writes ``diffusion_pytorch_model.safetensors`` (float16, ~100 KB) beside each example pipeline's ``vae/config.json``,
with ``scaling_factor`` (and, for the SD3-style pipeline, ``shift_factor``) set so that the latents are
standardised.

Usage::

    python automodel-diffusion/scripts/make_tiny_shapes.py
    python automodel-diffusion/scripts/train_tiny_vae.py [--steps 2500]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ASSETS = Path(__file__).resolve().parent.parent / "src/automodel_diffusion/examples/assets"
VAE_DIRS = ("tiny_flow/vae", "tiny_unet/vae")


def load_images(data: Path) -> torch.Tensor:
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines() if line.strip()]
    arrays = [np.asarray(Image.open(data / r["image"]).convert("RGB"), dtype=np.float32) / 127.5 - 1 for r in rows]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", type=Path, default=ASSETS)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kl", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    config_path = args.assets / VAE_DIRS[0] / "config.json"
    config = json.loads(config_path.read_text())
    vae = AutoencoderKL.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    images = load_images(args.assets / "tiny_shapes")
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps, eta_min=args.lr / 20)
    for step in range(1, args.steps + 1):
        batch = images[torch.randint(0, len(images), (args.batch_size,))]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample()).sample
        rec = (recon - batch).abs().mean() + (recon - batch).pow(2).mean()
        kl = posterior.kl().mean() / batch[0].numel()
        loss = rec + args.kl * kl
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == 1:
            print(f"step {step}: reconstruction {rec.item():.4f} kl {kl.item():.3f}")
    vae.eval()
    with torch.no_grad():
        latents = vae.encode(images).latent_dist.mode()
        recon = vae.decode(latents).sample
    error = (recon.clamp(-1, 1) - images).abs().mean().item()
    scale = float(1.0 / latents.std())
    shift = float(latents.mean())
    print(f"mean |reconstruction error| {error:.4f} (of 2); latent std {latents.std():.3f} mean {shift:.3f}")
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in vae.state_dict().items()}
    for rel in VAE_DIRS:
        target = args.assets / rel
        data = json.loads((target / "config.json").read_text())
        data["scaling_factor"] = round(scale, 5)
        if "flow" in rel:  # SD3-style pipelines undo a shift when decoding; Stable Diffusion ones do not
            data["shift_factor"] = round(shift, 5)
        (target / "config.json").write_text(json.dumps(data, indent=2) + "\n")
        save_file(state, str(target / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        (target / "diffusion_pytorch_model.safetensors").chmod(0o644)
    print("written to " + ", ".join(str(args.assets / rel) for rel in VAE_DIRS))


if __name__ == "__main__":
    main()

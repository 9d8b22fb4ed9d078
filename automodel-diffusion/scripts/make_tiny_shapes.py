#!/usr/bin/env python
"""Generate the tiny_shapes example data set: small PNGs of coloured shapes, with captions (seeded).

Each image is one shape (circle, square or triangle) of one colour, at a random position and size, on a
background of another colour; its caption says exactly that: ``a red circle on an orange background``.

Layout (what ``automodel_diffusion.datasets.ImageCaptionDataset`` reads)::

    tiny_shapes/images/train_0000.png ...     32x32 RGB PNGs
    tiny_shapes/train.jsonl                   {"image": "images/train_0000.png", "caption": "..."} per line
    tiny_shapes/validation.jsonl

Usage::

    python automodel-diffusion/scripts/make_tiny_shapes.py            # writes into the package's assets
    python automodel-diffusion/scripts/make_tiny_shapes.py --out DIR --train 320 --validation 32
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

DEFAULT_OUT = (Path(__file__).resolve().parent.parent /
               "src/automodel_diffusion/examples/assets/tiny_shapes")

COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (240, 220, 40),
    "purple": (150, 60, 190), "orange": (250, 140, 30), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")


def draw_shape(size: int, shape: str, colour: str, background: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (size, size), COLOURS[background])
    draw = ImageDraw.Draw(image)
    extent = rng.randint(size // 3, (size * 3) // 4)
    x0 = rng.randint(1, size - extent - 1)
    y0 = rng.randint(1, size - extent - 1)
    box = (x0, y0, x0 + extent, y0 + extent)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + extent / 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=fill)
    return image


def sample(rng: random.Random) -> tuple[str, str, str]:
    colour, background = rng.sample(sorted(COLOURS), 2)
    return rng.choice(SHAPES), colour, background


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(shape: str, colour: str, background: str) -> str:
    return f"{_article(colour)} {colour} {shape} on {_article(background)} {background} background"


def all_captions() -> list[str]:
    """Every caption the generator can write (the tokenizer script trains on them)."""
    return [caption(s, c, b) for s in SHAPES for c in COLOURS for b in COLOURS if c != b]


def generate(out: Path, train: int, validation: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    images = out / "images"
    if images.exists():
        shutil.rmtree(images)
    images.mkdir(parents=True)
    for split, count in (("train", train), ("validation", validation)):
        rows = []
        for i in range(count):
            shape, colour, background = sample(rng)
            name = f"images/{split}_{i:04d}.png"
            draw_shape(size, shape, colour, background, rng).save(out / name, optimize=True)
            rows.append({"image": name, "caption": caption(shape, colour, background)})
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {train} + {validation} images of {size}x{size} to {out} ({total / 1024:.0f} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=320)
    parser.add_argument("--validation", type=int, default=32)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generate(args.out, args.train, args.validation, args.size, args.seed)


if __name__ == "__main__":
    main()

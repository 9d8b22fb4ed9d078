#!/usr/bin/env python
"""Generate the tiny shapes image-question data set of the ``vlm/tiny_llava`` example.

Each image is a 32x32 PNG drawn with Pillow: one filled shape (circle, square or triangle) in one of six colours,
at a random size and position, on a light grey background of a random shade. Each row asks one question whose
one-word answer can only be read off the image::

    {"image": "images/train_0007.png",
     "messages": [{"role": "user", "content": [{"type": "image"},
                                               {"type": "text", "text": "What colour is the shape?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}

Half the rows ask for the colour, half for the shape. The output is deterministic for a given ``--seed``.

Usage::

    python automodel-vlm/scripts/make_tiny_shapes.py                 # writes the shipped example data
    python automodel-vlm/scripts/make_tiny_shapes.py --out DIR --train 320 --validation 64
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src/automodel_vlm/examples/assets/tiny_shapes"

SIZE = 32
COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
    "yellow": (235, 210, 20), "purple": (140, 40, 170), "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}


def draw(shape: str, colour: tuple[int, int, int], rng: random.Random):
    from PIL import Image, ImageDraw

    shade = rng.randint(215, 245)
    image = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
    pen = ImageDraw.Draw(image)
    extent = rng.randint(14, 24)
    x0, y0 = rng.randint(1, SIZE - extent - 1), rng.randint(1, SIZE - extent - 1)
    box = (x0, y0, x0 + extent, y0 + extent)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(x0 + extent // 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=colour)
    return image


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def make_split(out: Path, split: str, count: int, rng: random.Random) -> None:
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        name = f"images/{split}_{i:04d}.png"
        draw(shape, COLOURS[colour], rng).save(out / name, optimize=True)
        kind = "colour" if i % 2 == 0 else "shape"
        rows.append({"image": name, "messages": conversation(QUESTIONS[kind], colour if kind == "colour" else shape)})
    with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=320)
    parser.add_argument("--validation", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    for stale in (args.out / "images").glob("*.png") if (args.out / "images").is_dir() else ():
        stale.unlink()
    make_split(args.out, "train", args.train, rng)
    make_split(args.out, "validation", args.validation, rng)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.train} + {args.validation} rows to {args.out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()

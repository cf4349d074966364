"""Letterbox the course's lecture figures onto 1920x1080 slides.

What it is: a script for teachers. It reads `docs/course/lectures.md`, takes every
backquoted `docs/img/*.png` path under each "## Week N" heading, and writes each figure,
scaled to fit (up or down, aspect kept, never cropped) and centred on a white 1920x1080
canvas, to OUT_DIR as `weekNN_<name>.png`. `--extra PATH` adds any other picture (a
demo's `--plot` output) as `extra_<name>.png`. Pillow only (matplotlib's dependency).

What it is not: a slide deck, or a figure generator: the figures come from the commands in
docs/benchmarks.md and the demos' `--plot`. Its output is not committed.

    python docs/course/make_slides.py ~/slides
    python docs/course/make_slides.py ~/slides --extra /tmp/ladder/level6_streams.png
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
LECTURES = REPO / "docs" / "course" / "lectures.md"
SIZE = (1920, 1080)  # 16:9, full HD
WEEK = re.compile(r"^## Week (\d+)\b")
FIGURE = re.compile(r"`(docs/img/[\w.-]+\.png)`")


def figures_by_week(text: str) -> list[tuple[int, str]]:
    """(week, repository-relative path) for each figure named under a week's heading, in order."""
    out, week = [], None
    for line in text.splitlines():
        if m := WEEK.match(line):
            week = int(m.group(1))
        elif line.startswith("## "):
            week = None  # a heading that is not a week ends the week's section
        elif week is not None:
            out += [(week, path) for path in FIGURE.findall(line)]
    return out


def letterbox(src: Path, size: tuple[int, int] = SIZE, margin: int = 0) -> Image.Image:
    """The picture scaled to fit inside `size` less `margin` on each side, centred on white."""
    img = Image.open(src)
    if img.mode in ("RGBA", "LA", "P"):  # transparent parts become white, not black
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, "white")
        img = Image.alpha_composite(white, img)
    img = img.convert("RGB")
    box_w, box_h = size[0] - 2 * margin, size[1] - 2 * margin
    scale = min(box_w / img.width, box_h / img.height)
    new = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    if new != img.size:
        img = img.resize(new, Image.LANCZOS)
    canvas = Image.new("RGB", size, "white")
    canvas.paste(img, ((size[0] - new[0]) // 2, (size[1] - new[1]) // 2))
    return canvas


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="where the slides go (created if missing)")
    p.add_argument("--extra", type=Path, nargs="*", default=[], help="more pictures, e.g. a demo's --plot output")
    p.add_argument("--margin", type=int, default=0, help="pixels kept white on each side (default 0)")
    args = p.parse_args(argv)

    jobs = [(REPO / path, f"week{week:02d}_{Path(path).name}") for week, path in figures_by_week(LECTURES.read_text())]
    jobs += [(path, f"extra_{path.name}") for path in args.extra]
    missing = [str(src) for src, _ in jobs if not src.is_file()]
    if missing:
        print("missing figures (run the command that makes them first):\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for src, name in jobs:
        letterbox(src, margin=args.margin).save(args.out_dir / name)
    already = sum(Image.open(src).size[0] * 9 == Image.open(src).size[1] * 16 for src, _ in jobs)
    print(f"{len(jobs)} slides in {args.out_dir} ({already} of the figures were 16:9 already)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Publish a `lightning-amp bench` run in the docs: its table into README.md and docs/benchmarks.md, its chart
as docs/img/bench.png.

    python benchmarks/publish_bench.py bench-out

The table (bench-out/bench.md: the run's date, commit, device, versions, steps and command, then the
Markdown table) replaces what lies between the markers ``<!-- bench:start -->`` and ``<!-- bench:end -->``
in each page; text outside the markers (the reading of the figures) is left for a person to update.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def replace_between_markers(text: str, body: str, where: str) -> str:
    """``text`` with everything between START and END replaced by ``body``; ValueError without one pair."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"{where}: expected one {START} ... {END} pair")
    return pattern.sub(lambda _: f"{START}\n{body.strip()}\n{END}", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder `lightning-amp bench --out` wrote (bench.md, bench.png)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    table = (out / "bench.md").read_text()
    for page in PAGES:
        page.write_text(replace_between_markers(page.read_text(), table, str(page.relative_to(ROOT))))
    shutil.copyfile(out / "bench.png", ROOT / "docs" / "img" / "bench.png")
    print(f"updated {', '.join(str(p.relative_to(ROOT)) for p in PAGES)} and docs/img/bench.png from {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

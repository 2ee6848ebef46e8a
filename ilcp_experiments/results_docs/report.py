"""Every generated text file of the repository and the command that writes or checks them:
``python -m ilcp_experiments report [--check]``. Besides docs/results, the generated blocks of the
README (the results at a glance) and of the pages of docs/ (docs/long-contexts.md: BABILong;
docs/serving.md: the served receivers under load) are written between their markers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ilcp.io import atomic_write_text

from .babilong import babilong_block, draw_babilong
from .blocks import datasets_block, draw_at_a_glance, glance_table, served_block
from .general import draw_general, general_block
from .folders import (BABILONG_DOC, GENERAL_DOC, GENERATED, INDEX, RESULTS_DIR, companion_files, experiment_folders, folder_readme,
                      index, replace_block)

# The generated blocks a hand-written page may hold between <!-- NAME:begin --> and <!-- NAME:end -->,
# by name: each renders from docs/results and the links' prefix from that page to docs/results.
BLOCKS = {
    "results": glance_table,  # the README's results at a glance
    "babilong": lambda results_dir, prefix: babilong_block(results_dir, prefix, full=False),  # docs/long-contexts.md
    "served": served_block,  # docs/serving.md
    "datasets": datasets_block,
    "general": general_block,
}
# The pages that hold blocks: the README (it must hold the results block) and the pages of docs/.
README = "README.md"
PAGES_DIR = "docs"


def fill_blocks(text: str, results_dir: Path, link_prefix: str, *, required: tuple[str, ...] = ()) -> str:
    """``text`` with every block of `BLOCKS` whose markers it holds regenerated; a missing block of
    ``required`` raises ValueError (`replace_block`)."""
    for name, render in BLOCKS.items():
        if name in required or f"<!-- {name}:begin -->" in text:
            text = replace_block(text, name, render(results_dir, link_prefix))
    return text


def _link_prefix(page: Path, results_dir: Path) -> str:
    return Path(os.path.relpath(results_dir, page.parent)).as_posix() + "/"


def generated(root: Path) -> dict[Path, str]:
    """Every generated text file under ``root`` (the repository) and its content."""
    results_dir = root / RESULTS_DIR
    out: dict[Path, str] = {}
    for folder in experiment_folders(results_dir):
        out[folder / "README.md"] = folder_readme(folder)
        out.update(companion_files(folder))
    out[results_dir / INDEX] = index(results_dir)
    out[results_dir / BABILONG_DOC] = ("# Long contexts (BABILong): every current measurement\n\n"
                                       + GENERATED.replace("of this folder", "of the folders linked below")
                                       + "\n\n" + babilong_block(results_dir) + "\n")
    out[results_dir / GENERAL_DOC] = ("# The question-blind handoff (configs/general.yaml) beside the others, on its "
                                      "questions\n\n" + GENERATED.replace("of this folder", "of the folders linked below")
                                      + "\n\n" + general_block(results_dir) + "\n")
    readme = root / README
    pages = [readme] if readme.is_file() else []
    pages += sorted((root / PAGES_DIR).glob("*.md"))
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if page == readme or any(f"<!-- {name}:begin -->" in text for name in BLOCKS):
            out[page] = fill_blocks(text, results_dir, _link_prefix(page, results_dir),
                                    required=("results",) if page == readme else ())
    return out


def stale(root: Path) -> list[Path]:
    """The generated text files under ``root`` whose content differs from `generated` (or are missing)."""
    return [p for p, text in generated(root).items()
            if not p.is_file() or p.read_text(encoding="utf-8") != text]


def write(root: Path, *, figure: bool = True) -> list[Path]:
    """Write every generated file that changed; returns them. With ``figure``, draw the README's
    figure too."""
    changed = stale(root)
    texts = generated(root)
    for path in changed:
        atomic_write_text(path, texts[path])
    if figure:
        draw_at_a_glance(root / RESULTS_DIR)
        draw_babilong(root / RESULTS_DIR)
        draw_general(root / RESULTS_DIR)
    return changed


def main(argv: Iterable[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ilcp_experiments report",
        description="Regenerate docs/results/*/README.md (and results.md, sweep.md), docs/results/README.md, "
                    "the generated blocks of README.md and docs/*.md and the figures from the JSON files under "
                    "docs/results.")
    parser.add_argument("--root", default=".", help="the repository (default: the current folder)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; list the generated files that differ and exit 1 if any does")
    args = parser.parse_args(None if argv is None else list(argv))
    root = Path(args.root)
    if not (root / RESULTS_DIR).is_dir():
        parser.error(f"{root / RESULTS_DIR} is not a folder: run from the repository or pass --root")
    if args.check:
        paths = stale(root)
        for p in paths:
            print(f"out of date: {p.relative_to(root)}")
        if paths:
            print("run `python -m ilcp_experiments report` to regenerate them")
        return 1 if paths else 0
    for p in write(root):
        print(f"wrote {p.relative_to(root)}")
    return 0

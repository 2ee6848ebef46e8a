"""This repository's experiment drivers, kept out of the runtime package ``ilcp``: nothing under
``ilcp/`` imports them, and the wheel does not ship them.

- `ilcp_experiments.sweep`: train and evaluate ILCP at several payload sizes, one plot of accuracy
  against wire bytes (``python -m ilcp_experiments sweep --sweep configs/sweep/facts.yaml``);
- `ilcp_experiments.results_docs`: the docs generated from docs/results/ (the folders' READMEs, the
  generated blocks of README.md and docs/*.md, the figures): ``python -m ilcp_experiments report
  [--check]``.

Run from the repository root (the folder that holds this package).
"""

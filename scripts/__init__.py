"""Command-line tools beside the product: GPU benchmarks and checks, the tuning data's collection and the tuner's
training, the load tests, the multi-host launcher.

Run from the repository root, as `python -m scripts.X` or `PYTHONPATH=$PWD python scripts/X.py` (either puts the
root on sys.path; nothing here patches it). A script imports the product and `scripts.common` (the code the scripts
share, always spelled `from scripts.common import ...`), never another script; the product imports nothing of
scripts/, and tests import both.
"""

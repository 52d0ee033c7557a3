"""Benchmarks that print ratios measured side by side in one run (`make bench`)."""

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # energon's buffer-filling progress bars

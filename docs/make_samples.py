"""Write ``docs/samples.csv``: the sample-lengths file the README's and docs/usage.md's token-mode
examples name (``--lengths docs/samples.csv``).

    .venv/bin/python docs/make_samples.py           # rewrite docs/samples.csv
    .venv/bin/python docs/make_samples.py --check   # exit 1 if the file differs from what this writes

400 samples, columns ``tokens`` and ``images``: text tokens long-tailed (lognormal, mean 256, CV 1.0,
rounded up and clipped to [8, 2048], so ``--packing greedy --pack-tokens 2048`` fits every sample) and
images per sample Poisson with mean 1 (read only by a multimodal run; ignored without an encoder). An
illustration, not a measured dataset: docs/scenarios.md holds the sourced ones.

Draws come from ``random.Random(SEED).random()`` only (a sequence Python keeps the same across versions,
unlike numpy's distribution methods), mapped through inverse CDFs, so the file does not move with a
library upgrade; tests/test_readme.py holds it to this script.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from statistics import NormalDist

OUT = Path(__file__).resolve().parent / "samples.csv"
ROWS, SEED = 400, 26
MEAN_TOKENS, CV, MIN_TOKENS, MAX_TOKENS = 256, 1.0, 8, 2048
MEAN_IMAGES = 1.0


def _tokens(u: float) -> int:
    """The lognormal law of mean MEAN_TOKENS and coefficient of variation CV at quantile ``u``."""
    sigma2 = math.log(1.0 + CV * CV)
    mu = math.log(MEAN_TOKENS) - sigma2 / 2
    value = math.exp(mu + math.sqrt(sigma2) * NormalDist().inv_cdf(u))
    return min(MAX_TOKENS, max(MIN_TOKENS, math.ceil(value)))


def _images(u: float) -> int:
    """Poisson(MEAN_IMAGES) at quantile ``u``: the smallest k whose CDF reaches u."""
    k, p = 0, math.exp(-MEAN_IMAGES)
    cdf = p
    while cdf < u:
        k += 1
        p *= MEAN_IMAGES / k
        cdf += p
    return k


def samples_csv() -> str:
    """The file's text: a header, then one ``tokens,images`` row per sample."""
    rng = random.Random(SEED)
    rows = ["tokens,images"]
    for _ in range(ROWS):
        u_tokens = min(max(rng.random(), 1e-12), 1 - 1e-12)  # inv_cdf needs 0 < u < 1
        rows.append(f"{_tokens(u_tokens)},{_images(rng.random())}")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    text = samples_csv()
    if argv == ["--check"]:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.name}: {'up to date' if same else 'differs from docs/make_samples.py; rerun it'}")
        return 0 if same else 1
    if argv:
        print("usage: make_samples.py [--check]", file=sys.stderr)
        return 2
    OUT.write_text(text)
    print(f"wrote {OUT} ({ROWS} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

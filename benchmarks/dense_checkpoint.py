"""Write a dense copy of the default model (tests/worker/dense_checkpoint.py says how).

Its projections plus Gaussian noise of ``--relative-noise`` x each one's mean
|w|, so no block codes apply: what issue 13's general-checkpoint figures are
measured on.

    .venv/bin/python benchmarks/dense_checkpoint.py --out /tmp/smollm2-dense
    .venv/bin/python benchmarks/vllm_compare.py --model /tmp/smollm2-dense
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.services.runtime.model_prep import default_model_path
from tests.worker.dense_checkpoint import make_dense


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--relative-noise", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    perturbed = make_dense(args.model, args.out, args.relative_noise, args.seed)
    print(f"{args.out}: {perturbed} projections perturbed, none holds block codes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

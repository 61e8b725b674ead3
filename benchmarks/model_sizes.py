"""Parameter counts of the DeepSeek-V3 flavors, total and activated per token, from the model's own formulas
(models/deepseek_v3/model.py: `num_params`, `active_params`; tests/models/test_deepseek_v3.py holds them to the
built model and to the published figures).

    python -m benchmarks.model_sizes [--save]

Counts only, no time: the same on any machine, in well under a second. `--save` writes the table to
benchmarks/results/model_sizes.json for docs/moe.md.
"""

from __future__ import annotations

import argparse

from benchmarks import results
from models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS
from models.deepseek_v3.model import active_params, num_params


def _count(n: int) -> str:
    """`4.94 M`, `2.66 B`: the size at a glance."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/model_sizes.json")
    args = parser.parse_args()
    rows, data = [], {}
    for flavor, model_args in DEEPSEEK_V3_FLAVORS.items():
        total, active = num_params(model_args), active_params(model_args)
        embedding = model_args.vocab_size * model_args.dim  # a lookup, not a matmul: published counts leave it out
        data[flavor] = {"parameters": total, "activated": active, "embedding": embedding}
        rows.append([f"`{flavor}`", f"{total:,} ({_count(total)})", _count(active), _count(active - embedding)])
    table = results.markdown_table(["flavor", "parameters", "activated", "activated without the embedding"], rows)
    results.show("model_sizes", {"deepseek_v3": table}, data, save_it=args.save)


if __name__ == "__main__":
    main()

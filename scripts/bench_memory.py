"""Per-device memory tables for docs/BENCHMARKS.md: a 50.9M-parameter GPT measured from real
XLA shardings on 8 XLA:CPU devices under "spawn", "spmd" and "fsdp", and Llama-style 1B and 7B
models from the same sharding rules on paper, on a v5e-8.

    python scripts/bench_memory.py            # about 1-4 minutes (three fresh processes)
    python scripts/bench_memory.py --paper    # the paper rows only (seconds)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import torch  # noqa: E402

from xla_utils.diagnostics.memory import llama_shapes, measure_memory, paper_memory  # noqa: E402

V5E_USABLE = 16 * 2**30 * 0.9  # check()'s share of one v5e chip's HBM


def gpt50m():
    from tiny_gpt import GPT

    return GPT(block=16, d=1024, layers=4, heads=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paper", action="store_true", help="only the 1B/7B rows on paper")
    ap.add_argument("--rows", type=int, default=1, help="sequences per device (16 tokens each)")
    args = ap.parse_args()
    if not args.paper:
        from tiny_gpt import lm_step

        g = torch.Generator().manual_seed(0)
        batch = (torch.randint(0, 256, (args.rows, 16), generator=g),
                 torch.randint(0, 256, (args.rows, 16), generator=g))
        r = measure_memory(gpt50m, batch, train_step=lm_step, fsdp_wrap=["Block"])
        print(f"GPT {r.n_params / 1e6:.1f}M, per-device batch {args.rows} x 16 tokens, "
              f"8 XLA:CPU devices, measured:\n{r.table()}\n")
        for s, d in r.details.items():
            print(f"  {s}: {d['activation_tensors']} saved tensors, shardings {d['shardings']}")
        print()
    for size in ("1b", "7b"):
        p = paper_memory(llama_shapes(size), 8, strategies=["spawn", "fsdp"])
        fits = {row.strategy: row.states <= V5E_USABLE for row in p.rows}
        print(f"Llama-style {size.upper()} ({p.n_params / 1e9:.2f}B), fp32 + AdamW, on paper "
              f"(states fit a v5e core's 14.4 GiB usable: {fits}):\n{p.table()}\n")


if __name__ == "__main__":
    main()

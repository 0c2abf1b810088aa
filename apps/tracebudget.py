"""`hotloop trace budget`: a latency budget (stage, time, share of the loop) from trace files
(`measure.traces`). Owns the command only: what it prints.
"""

from __future__ import annotations

from measure.traces import budget, read_spans


def main(args) -> int:
    result = budget(read_spans(args.paths), args.root or "grpo.step")
    print(f"{result['root']}: {result['iterations']} iterations, median {result['median_s']:.2f} s")
    print(f"{'stage':<14}{'median s':>10}{'share':>8}")
    for name, v in result["stages"].items():
        print(f"{name:<14}{v['median_s']:>10.3f}{v['share']:>8.1%}")
    print(f"{'(other)':<14}{'':>10}{result['unattributed_share']:>8.1%}")
    return 0

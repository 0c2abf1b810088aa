"""The run report: `report.json`, `report.md` and PNG plots under the run directory.

Owns presentation only; every number comes from the summary the recipe returned.
"""

from __future__ import annotations

import json
from pathlib import Path

from .grpo import STAGES
from .stats import verdict


def _plots(summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers or CI
    import matplotlib.pyplot as plt

    made = []
    steps = list(range(1, len(summary["reward_curve"]) + 1))
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, summary["reward_curve"], marker="o", label="mean reward")
    ax[0].plot(steps, summary["pass_rate_curve"], marker=".", label="train pass rate")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("reward"); ax[0].set_title("training reward")
    ax[0].grid(alpha=0.3); ax[0].legend()
    curve = summary["heldout"]["curve"]
    if curve:
        xs = [e["step"] for e in curve]
        ys = [e["pass_at_1"] for e in curve]
        err = [e["ci95"] for e in curve]
        ax[1].errorbar(xs, ys, yerr=err, marker="o", capsize=4)
        ax[1].set_ylim(0, max(0.1, min(1.0, max(y + e for y, e in zip(ys, err)) * 1.2)))
    ax[1].set_xlabel("step"); ax[1].set_ylabel("pass@1")
    ax[1].set_title(f"held-out pass@1 ({summary['heldout']['tasks']} tasks, 95% CI)")
    ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=110)
    plt.close(fig)
    made.append("learning.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    secs = summary["stage_seconds"]
    left = 0.0
    for s in STAGES:
        ax.barh([0], [secs[s]], left=left, label=f"{s} {secs[s]:.1f}s ({summary['stage_share'][s]:.0%})")
        left += secs[s]
    ax.set_yticks([]); ax.set_xlabel("seconds per step (mean)")
    ax.set_title("where a GRPO step's time goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "stages.png", dpi=110)
    plt.close(fig)
    made.append("stages.png")
    return made


def write(summary: dict, run_dir: Path, config_text: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(summary, indent=2))
    plots = _plots(summary, run_dir)
    h = summary["heldout"]
    lines = [
        f"# hotloop GRPO run `{run_dir.name}`",
        "",
        f"- steps: {summary['steps']}, samples: {summary['samples']}, "
        f"throughput: {summary['samples_per_s']:.2f} samples/s (all stages)",
    ]
    if h["pass_at_1_base"] is not None:
        delta = h["pass_at_1_final"] - h["pass_at_1_base"]
        lines.append(
            f"- held-out pass@1: base {h['pass_at_1_base']:.3f} ± {h['ci95_base']:.3f} -> final "
            f"{h['pass_at_1_final']:.3f} ± {h['ci95_final']:.3f} ({delta * 100:+.1f} points; "
            f"{h['tasks']} tasks x {h['samples_per_task']} samples, 95% CI over tasks)"
        )
    for name, p in h.get("paired", {}).items():
        what = (f"held-out {name} pass@1, paired over {h['tasks']} tasks "
                f"({p['samples_per_task']} sample(s) per task)")
        lines.append(f"- {verdict(p, what)}; base {p['base']:.3f} -> final {p['final']:.3f}; "
                     f"{p['tasks_improved']} tasks better, {p['tasks_worse']} worse")
    lines += ["", "| stage | seconds per step | share |", "|---|---|---|"]
    for s in STAGES:
        lines.append(f"| {s} | {summary['stage_seconds'][s]:.2f} | {summary['stage_share'][s]:.1%} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    if summary["skipped_steps"]:
        lines += ["", f"Skipped updates (non-finite loss or gradient): steps {summary['skipped_steps']}"]
    if summary.get("config"):
        # The effective configuration (after overrides and automatic choices), not the file.
        lines += ["", "## Configuration that ran", "", "```json",
                  json.dumps(summary["config"], indent=2), "```"]
    elif config_text:
        lines += ["", "## Configuration file", "", "```toml", config_text.strip(), "```"]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

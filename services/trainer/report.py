"""The run report: `report.json`, `report.md` and PNG plots under the run directory.

Owns presentation only (GRPO: `write`, PPO: `write_ppo`); every number comes from the summary
the recipe returned.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .recipes.grpo import STAGES
from .learner.stats import verdict


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
        ax[1].errorbar(xs, ys, yerr=err, marker="o", capsize=4, label="greedy")
        top = max(y + e for y, e in zip(ys, err))
        if all(e.get("sampled") for e in curve):
            s_ys = [e["sampled"]["pass_at_1"] for e in curve]
            s_err = [e["sampled"]["ci95"] for e in curve]
            n = curve[0]["sampled"]["samples_per_task"]
            ax[1].errorbar(xs, s_ys, yerr=s_err, marker="^", capsize=4, linestyle=":",
                           label=f"sampled ({n} per task)")
            top = max(top, max(y + e for y, e in zip(s_ys, s_err)))
            ax[1].legend()
        ax[1].set_ylim(0, max(0.1, min(1.0, top * 1.2)))
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
        how = (f"at T={p['temperature']:g}, {p['samples_per_task']} samples per task" if name == "sampled"
               else f"{p['samples_per_task']} sample(s) per task")
        what = f"held-out {name} pass@1 ({how}), paired over {h['tasks']} tasks"
        lines.append(f"- {verdict(p, what)}; base {p['base']:.3f} -> final {p['final']:.3f}; "
                     f"{p['tasks_improved']} tasks better, {p['tasks_worse']} worse")
    if (aim := aim_line(h.get("paired", {}))) is not None:
        lines.append(f"- {aim}")
    lines += ["", "| stage | seconds per step | share |", "|---|---|---|"]
    for s in STAGES:
        lines.append(f"| {s} | {summary['stage_seconds'][s]:.2f} | {summary['stage_share'][s]:.1%} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    if summary["skipped_steps"]:
        lines += ["", f"Skipped updates (non-finite loss or gradient): steps {summary['skipped_steps']}"]
    if summary.get("examples"):
        lines += _examples_header()
        for ex in summary["examples"]:
            notes = [f"greedy pass@1 {ex[k + '_greedy']:.2f}" for k in ("base", "final")]
            if ex["shown"] == "sampled":
                notes = [f"sampled pass@1 {ex[k + '_sampled']:.2f}, {n}; the first sample shown"
                         for k, n in zip(("base", "final"), notes)]
            lines += _example(ex["prompt"], ex["base"], ex["final"], *notes)
    return _finish(lines, summary, run_dir, config_text)


def aim_line(paired: dict, min_gain: float = 0.10) -> str | None:
    """Whether a run met the demo's aim (issue 8): sampled pass@1 up by at least `min_gain`
    with its paired CI above zero, and greedy pass@1 not significantly worse."""
    if "sampled" not in paired or "greedy" not in paired:
        return None
    s, g = paired["sampled"], paired["greedy"]
    sampled_ok = s["diff"] >= min_gain and s["ci95"][0] > 0
    greedy_ok = g["ci95"][1] >= 0
    return (f"demo aim (sampled pass@1 +{min_gain * 100:.0f} points or more with the CI above zero, "
            f"greedy not significantly worse): {'met' if sampled_ok and greedy_ok else 'not met'} "
            f"(sampled {s['diff'] * 100:+.1f} points, CI low end {s['ci95'][0] * 100:+.1f}; greedy CI "
            f"high end {g['ci95'][1] * 100:+.1f})")


def _examples_header() -> list[str]:
    return ["", "## What changed: held-out completions before and after", ""]


def _example(prompt: str, base: str, final: str, base_note: str, final_note: str) -> list[str]:
    """One held-out prompt with the base and the final policy's completions (GRPO and PPO)."""
    return [f"**Prompt:** {prompt.strip()[:300]}", "",
            f"*Base* ({base_note}):", "", *_fenced(base.strip()),
            f"*Final* ({final_note}):", "", *_fenced(final.strip()), ""]


def _fenced(text: str) -> list[str]:
    """`text` verbatim in a code block whose fence is longer than any backtick run inside it:
    completions hold ``` fences of their own, which would otherwise close the block."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence]


def _replicas(summary: dict) -> list[str]:
    """What each replica did, for the services the job spread over several (runner.py)."""
    spread = {name: reps for name, reps in summary.get("replicas", {}).items() if len(reps) > 1}
    if not spread:
        return []
    lines = ["", "## Replicas", "", "| service | replica | results kept | calls lost with it | items re-sent |",
             "|---|---|---|---|---|"]
    for name, reps in spread.items():
        lines += [f"| {name} | {a} | {s['answered']} | {s['failed_calls']} | {s['resent']} |"
                  for a, s in reps.items()]
    return lines


def _finish(lines: list[str], summary: dict, run_dir: Path, config_text: str) -> Path:
    """Append the replicas' shares and the configuration, and write report.md."""
    lines += _replicas(summary)
    if summary.get("config"):
        # The effective configuration (after overrides and automatic choices), not the file.
        lines += ["", "## Configuration that ran", "", "```json",
                  json.dumps(summary["config"], indent=2), "```"]
    elif config_text:
        lines += ["", "## Configuration file", "", "```toml", config_text.strip(), "```"]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- PPO ------------------------------------------------------------------------------------

def _ppo_plots(summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(summary["reward_curve"]) + 1))
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    ax[0].plot(steps, summary["reward_curve"], marker="o", label="score (before KL)")
    curve = summary["heldout"]["curve"]
    if curve:
        ax[0].plot([e["step"] for e in curve], [e["reward_mean"] for e in curve], marker="s",
                   linestyle="--", label="held-out greedy")
        sampled = [e.get("sampled_reward_mean") for e in curve]
        if all(x is not None and x == x for x in sampled):
            ax[0].plot([e["step"] for e in curve], sampled, marker="^", linestyle=":",
                       label="held-out sampled")
    ax[0].set_title("reward"); ax[0].legend(); ax[0].grid(alpha=0.3)
    ax[1].plot(steps, summary["value_loss_curve"], marker="o", color="tab:red")
    ax[1].set_title("value loss"); ax[1].grid(alpha=0.3)
    ax[2].plot(steps, summary["explained_variance_curve"], marker="o", color="tab:green",
               label="explained variance")
    ax[2].plot(steps, summary["kl_curve"], marker=".", color="tab:purple", label="KL per token")
    ax[2].axhline(0, color="grey", lw=0.8)
    ax[2].set_title("critic and KL"); ax[2].legend(); ax[2].grid(alpha=0.3)
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "ppo.png", dpi=110)
    plt.close(fig)
    return ["ppo.png"]


def write_ppo(summary: dict, run_dir: Path, config_text: str = "") -> Path:
    """report.json, report.md and ppo.png of a PPO run."""
    from .recipes.ppo import STAGES as PPO_STAGES

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(summary, indent=2))
    plots = _ppo_plots(summary, run_dir) if summary["steps"] else []
    h = summary["heldout"]
    ev = [x for x in summary["explained_variance_curve"] if x == x]  # drop NaN
    lines = [
        f"# hotloop PPO run `{run_dir.name}`",
        "",
        f"- steps: {summary['steps']}, samples: {summary['samples']}, "
        f"throughput: {summary['samples_per_s']:.2f} samples/s (all stages); critic "
        f"`{summary['critic']}`, users first: `{summary['users_first']}`",
        f"- training score: first step {_first(summary['reward_curve'])}, last "
        f"{_last(summary['reward_curve'])}; value loss {_first(summary['value_loss_curve'])} -> "
        f"{_last(summary['value_loss_curve'])}; explained variance {_first(ev)} -> {_last(ev)}",
    ]
    for name, p in h.get("paired", {}).items():
        how = ("greedy" if name == "greedy_reward" else
               f"sampled ({p['samples_per_task']} per prompt, T={p['temperature']:g})")
        what = f"held-out {how} reward ({h['scorer']}), paired over {h['tasks']} prompts"
        lines.append(f"- {verdict(p, what)}; base {p['base']:.3f} -> final {p['final']:.3f}; "
                     f"{p['tasks_improved']} prompts better, {p['tasks_worse']} worse")
    lines += ["", "| stage | seconds per step | share |", "|---|---|---|"]
    for s in PPO_STAGES:
        lines.append(f"| {s} | {summary['stage_seconds'][s]:.2f} | {summary['stage_share'][s]:.1%} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    if summary["skipped_steps"]:
        lines += ["", "Skipped updates:"] + [f"- step {s['step']}: {s['reason']}"
                                             for s in summary["skipped_steps"]]
    if summary.get("examples"):
        lines += _examples_header()
        for ex in summary["examples"]:
            lines += _example(ex["prompt"], ex["base"], ex["final"], f"reward {ex['base_reward']:.2f}",
                              f"reward {ex['final_reward']:.2f}")
    return _finish(lines, summary, run_dir, config_text)


def _first(xs: list) -> str:
    return f"{xs[0]:.3f}" if xs else "n/a"


def _last(xs: list) -> str:
    return f"{xs[-1]:.3f}" if xs else "n/a"

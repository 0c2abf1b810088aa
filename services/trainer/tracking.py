"""A training job's experiment trackers (`[report]`, hotloop.tracking): what the trainer sends
them beside the records the recipes' runner mirrors from metrics.jsonl.

Owns: `open_job_tracker` (a job's trackers, opened with its effective configuration as their
parameters), `throughput` (a step's wall seconds and samples per second, which no record
holds), the tag prefix of a tenant's lane in a trainer of several (`lane_prefix`,
`lane_tracker`) and `online_params` (an online job's configuration, as the batch jobs'
`effective_config`).

What reaches a tracker, as `<kind>/<field>[/<subfield>]` scalars at the record's step:
- `step/...`: each step's record (reward, KL, loss and grad norm under `step/train/`, stage
  seconds under `step/stage_seconds/`, the online loop's counters under `step/counters/`);
- `eval/...`: each held-out evaluation;
- `published/...`: the online loop's feedback-to-served latency of each published version;
- `throughput/step_seconds`, `throughput/samples_per_s`: per step, measured by the runner;
- `summary/...`: the run's summary, at its last step.
A lane of a trainer of several tenants writes the same under `<tenant>/` (`_default` for the
default tenant). Records without a step (a settled feedback) are not sent: their counts are
in the next step's `step/counters/`.

Does not own: the trackers (hotloop.tracking) or the records (the recipes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hotloop.tracking import ReportConfig, Scoped, Tracker, Trackers, open_tracker


def open_job_tracker(report: ReportConfig | None, run_dir: Path, run_id: str,
                     params: dict[str, Any]) -> Trackers:
    """The job's trackers (none when `report` is None or names none), their run named
    `run_id` unless `[report] run_name` says otherwise, with `params` logged. Close it when
    the job ends; a missing package or a tracker that cannot start raises here (see
    hotloop.tracking)."""
    trackers = open_tracker(report or ReportConfig(), run_dir, run_id)
    trackers.log_params(params)
    return trackers


def samples(record: dict[str, Any]) -> int | None:
    """The samples a step's record trained on: PPO's `samples`, GRPO's scored samples (its
    `statuses` count each one), the online loop's `feedback`; None when it says none."""
    if isinstance(record.get("samples"), int):
        return record["samples"]
    if record.get("statuses"):
        return sum(record["statuses"].values())
    if isinstance(record.get("feedback"), int):
        return record["feedback"]
    return None


def throughput(record: dict[str, Any], seconds: float) -> dict[str, float]:
    """`step_seconds` (the step's wall time, from the end of the one before: waits, sampling
    ahead and checkpoints included) and `samples_per_s` over it."""
    out = {"step_seconds": seconds}
    n = samples(record)
    if n is not None and seconds > 0:
        out["samples_per_s"] = n / seconds
    return out


def lane_prefix(tenant: str) -> str:
    """A tenant's tag prefix in a trainer of several: its name; `_default` for the default
    tenant "" (a tenant's name starts with a letter or a digit, so none is called that)."""
    return tenant or "_default"


def lane_tracker(tracker: Tracker | None, tenant: str) -> Tracker | None:
    """The view of `tracker` a tenant's lane writes through (its `lane_prefix`)."""
    return None if tracker is None else Scoped(tracker, lane_prefix(tenant))


def online_params(mesh_cfg, job, trainer_cfg) -> dict[str, Any]:
    """An online job's configuration for its trackers: the shared sections (secrets and
    endpoints left out, as in the batch jobs' report), `[online]` and `[trainer]`."""
    return {**mesh_cfg.model_dump(mode="json", exclude={"security", "endpoints"}),
            "online": job.model_dump(mode="json"), "trainer": trainer_cfg.model_dump(mode="json")}

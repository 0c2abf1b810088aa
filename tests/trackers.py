"""What the experiment trackers wrote, read back with each one's own reader: TensorBoard's
EventAccumulator, MLflow's client on the store, and W&B's record schema over an offline run's
`.wandb` file (W&B ships no Python reader of it; its framing is the LevelDB log format)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, every event file of the directory (all kept, not sampled)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_text(log_dir: Path, tag: str) -> str:
    """The first text summary of `tag`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def mlflow_runs(uri: str, experiment: str) -> list[dict]:
    """Each run of the experiment: name, status, params, and metric -> {step: value}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    out = []
    for run in client.search_runs([exp.experiment_id]):
        history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                   for key in run.data.metrics}
        out.append({"name": run.info.run_name, "status": run.info.status,
                    "params": dict(run.data.params), "metrics": history})
    return out


_BLOCK, _HEADER = 32768, 7  # the LevelDB log's block and record-header sizes
_FULL, _LAST = 1, 4


def wandb_offline_run(wandb_dir: Path) -> dict:
    """The one offline run under `<wandb_dir>/wandb/`: its name, project, config (key ->
    value) and history rows (key -> value), from the records of its `.wandb` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(wandb_dir, "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, records = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if length == 0 and kind == 0:  # zero padding
            pos += left - _HEADER
            continue
        buf += data[pos:pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    run: dict = {"config": {}, "history": []}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["name"], run["project"] = rec.run.display_name, rec.run.project
            for item in rec.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in rec.history.item})
    return run

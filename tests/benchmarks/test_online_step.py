"""`hotloop bench online-step`: a tiny run of `main` end to end on the shipped online config
(the figures' arithmetic, the JSON and table), a random-weight shape, the colocated reference
and clear errors for bad input."""

from __future__ import annotations

import json
import statistics
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.online_step import main
from hotloop.models import MODEL_SHAPES


def bench_args(out: Path, model: Path | None, *extra: str) -> Namespace:
    """The CLI's parse of a one-thread run on the shipped configs/online.toml with the tiny
    model (4 layers: LoRA on the top 2), `extra` appended."""
    from apps.cli import build_parser

    sets = ["--set", f"model.name={model}"] if model else []
    return build_parser().parse_args([
        "bench", "online-step", "--config", "configs/online.toml", *sets,
        "--set", "trainer.lora.top_layers=2", "--set", "model.dtype=float32",
        "--devices", "cpu", "--cpu-threads", "1", "--prompt-tokens", "5",
        "--completion-tokens", "7", "--json", str(out), *extra])


def test_each_batch_size_reports_its_update_and_its_cost_per_rating(
        tiny_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "online-step.json"
    assert main(bench_args(out, tiny_model, "--batches", "1,3", "--updates", "2")) == 0
    r = json.loads(out.read_text())
    assert r["model"] == str(tiny_model) and not r["random_weights"]
    assert r["lora"] == {"r": 16, "top_layers": 2} and r["kl_beta"] == 0.0
    assert [row["batch"] for row in r["runs"]] == [1, 3]
    for row in r["runs"]:
        assert row["device"] == "cpu" and row["dtype"] == "float32" and row["threads"] == 1
        assert len(row["update_ms_all"]) == 2  # the warm-up is not among them
        assert row["update_ms"] == pytest.approx(statistics.median(row["update_ms_all"]), abs=0.01)
        assert row["train_ms"] > 0 and row["pack_ms"] > 0
        assert row["rating_ms"] == pytest.approx(row["update_ms"] / row["batch"])
        assert row["ratings_per_s"] == pytest.approx(row["batch"] * 1e3 / row["update_ms"])
    assert r["speedup"] == {} and r["cuda_device"] is None  # one device: nothing to compare
    assert out.with_suffix(".md").read_text().count("| cpu | float32 | 1 |") == 2
    assert "| cpu | float32 | 1 | 3 |" in capsys.readouterr().out


def test_a_named_shape_trains_random_weights_with_the_colocated_reference(
        tmp_path: Path, monkeypatch) -> None:
    """No model on the host: `--shape` builds one. kl_beta > 0: each update also scores the
    base (the online recipe's colocated reference), and still lands."""
    monkeypatch.setitem(MODEL_SHAPES, "tiny-test", (16, 4, 32, 96, 2, 1))
    out = tmp_path / "online-step.json"
    args = bench_args(out, None, "--shape", "tiny-test", "--batches", "2", "--updates", "1",
                      "--set", "trainer.loss.kl_beta=0.05")
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "tiny-test" and r["random_weights"] and r["kl_beta"] == 0.05
    assert [row["batch"] for row in r["runs"]] == [2] and r["runs"][0]["update_ms"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--shape", "gpt-7"], "unknown shape 'gpt-7'"),
    (["--devices", "tpu"], "unknown devices ['tpu']"),
    (["--batches", "0"], "at least 1"),
    (["--batches", ","], "at least 1"),
    (["--batches", "two"], "invalid literal"),
    (["--updates", "0"], "at least 1"),
])
def test_bad_arguments_are_refused_with_a_clear_error(tiny_model: Path, tmp_path: Path, capsys,
                                                      extra, message) -> None:
    out = tmp_path / "online-step.json"
    assert main(bench_args(out, tiny_model, *extra)) == 2
    assert message in capsys.readouterr().out and not out.exists()


def test_cuda_on_a_host_without_it_is_refused(tiny_model: Path, tmp_path: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert main(bench_args(tmp_path / "o.json", tiny_model, "--devices", "cpu,cuda")) == 2
    assert "no CUDA device" in capsys.readouterr().out

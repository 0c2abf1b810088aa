"""The dtype choice: one resolver, stubbed at its edge (CPU flags, the device, the caps)."""

from __future__ import annotations

import typing

import pytest

from hotloop.hardware import DTYPES, Dtype, cpu_capability, cpu_flags, resolve_dtype, torch_dtype

SAPPHIRE = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
COOPER = {"avx2", "avx512f", "avx512_bf16"}
ZEN3 = {"avx2", "fma", "sse4_2"}
SKYLAKE = {"avx2", "avx512f"}


@pytest.mark.parametrize(
    ("flags", "device", "want"),
    [
        (SAPPHIRE, "cpu", "bfloat16"),  # AMX-BF16
        (COOPER, "cpu", "float32"),  # AVX512-BF16 without AMX: measured slower than fp32
        (ZEN3, "cpu", "float32"),  # AVX2 only: bf16 is emulated, ~100x slower matmuls
        (SKYLAKE, "cpu", "float32"),  # AVX-512 without bf16 units
        (ZEN3, "cuda", "bfloat16"),  # CUDA decides, whatever the host CPU
        (ZEN3, "cuda:1", "bfloat16"),
        (set(), "cpu", "float32"),  # no /proc/cpuinfo (macOS, some containers)
    ],
)
def test_auto_is_bf16_only_where_it_measured_faster(flags, device, want) -> None:
    import torch

    cpu = cpu_capability(flags, environ={})
    assert resolve_dtype("auto", device=device, cpu=cpu) == want
    assert torch_dtype("auto", device=device, cpu=cpu) == getattr(torch, want)


def test_explicit_dtypes_pass_through_and_unknown_ones_fail() -> None:
    cpu = cpu_capability(ZEN3, environ={})
    assert resolve_dtype("bfloat16", device="cpu", cpu=cpu) == "bfloat16"  # warned, not changed
    assert resolve_dtype("float32", device="cpu", cpu=cpu) == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float16", device="cpu", cpu=cpu)


@pytest.mark.parametrize(
    "environ",
    [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"},
     {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
     {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}],
)
def test_caps_make_an_avx512_host_choose_like_an_avx2_one(environ) -> None:
    cpu = cpu_capability(SAPPHIRE, environ=environ)
    assert cpu.native_bf16 == () and cpu.capped_by
    assert cpu.isa == "avx2"
    assert resolve_dtype("auto", device="cpu", cpu=cpu) == "float32"
    assert "capped by" in str(cpu)


def test_torch_dtype_maps_each_name_a_config_may_give() -> None:
    import torch

    assert DTYPES == ("bfloat16", "float32") and typing.get_args(Dtype) == ("auto", *DTYPES)
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float32") is torch.float32
    # a name is not resolved again: on a CPU without bf16 units it is still what was asked
    assert torch_dtype("bfloat16", device="cpu", cpu=cpu_capability(ZEN3, environ={})) is torch.bfloat16


@pytest.mark.parametrize("bad", ["float16", "fp32", "bf16", "", "Float32", "torch.float32"])
def test_a_name_no_config_may_give_is_a_clear_error(bad) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype .*; choose auto, bfloat16, float32"):
        torch_dtype(bad, device="cpu")


def test_auto_on_this_host_follows_its_cpu_class() -> None:
    import torch

    cpu = cpu_capability()
    want = torch.bfloat16 if "amx_bf16" in cpu.native_bf16 else torch.float32
    assert torch_dtype("auto", device="cpu") is want
    assert resolve_dtype("auto", device="cpu") == str(want).removeprefix("torch.")


def test_capability_string_names_the_bf16_units() -> None:
    assert str(cpu_capability(SAPPHIRE, environ={})) == "avx512 amx_bf16 avx512_bf16"
    assert str(cpu_capability(ZEN3, environ={})) == "avx2"


def test_cpu_flags_reads_the_flags_line() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16\nbugs\t: none\n"
    assert cpu_flags(text) == {"fpu", "avx2", "avx512f", "amx_bf16"}
    assert cpu_flags("processor: 0\n") == frozenset()


def test_shipped_configs_default_to_auto() -> None:
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "configs").glob("*.toml")):
        tree = tomllib.loads(path.read_text())
        for section in ("model", "trainer", "reference"):
            got = tree.get(section, {}).get("dtype", "auto")
            assert got == "auto", f"{path.name} [{section}] dtype = {got!r}"


def test_device_follows_cuda_and_refuses_a_missing_gpu():
    from hotloop.hardware import resolve_device

    assert resolve_device("auto", cuda=True) == "cuda"
    assert resolve_device("auto", cuda=False) == "cpu"
    assert resolve_device("cpu", cuda=True) == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda", cuda=False)

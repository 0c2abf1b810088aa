"""What the host computes natively, and the one place that turns `dtype = "auto"` into a dtype.

Owns: reading the CPU's capability (from /proc/cpuinfo flags, with the caps torch and oneDNN
honour applied on top), the dtypes a config may name (`Dtype`, declared once), and the one
resolver from such a name to what code computes in: `resolve_dtype` gives the concrete name
("auto" resolved; what Status, the logs and vLLM take), `torch_dtype` the torch dtype. Every
copy of the base model (rollout, reference, trainer) and every reward model resolves through
them. Does not own: thread counts or OpenMP settings (`hotloop.threads`).

Why: bf16 is fast only where the hardware computes it fast. On an AVX2-only CPU (AMD Zen 2/3,
many laptops and CI runners) torch emulates bf16 matmuls: 0.9 GFLOP/s against 87.6 in fp32
(97x), and vLLM-CPU generates 4x slower in bf16 (docs/results.md). AVX512-BF16 without AMX is not
enough either (measured with `hotloop bench threads --dtype ...`, SmolLM2-135M, 2 cores: LoRA
step 5.41 s in bf16 vs 3.16 s in fp32, vLLM 218 vs 250 tok/s). With AMX tiles bf16 wins (2.0 s
vs 2.6-2.9 s per step, vLLM ~3x, docs/results.md). So `auto` means bf16 on CUDA or on a CPU with
AMX-BF16, and fp32 everywhere else.

The caps: `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` make torch and oneDNN run
their AVX2 kernels on an AVX-512 machine; fp32 GEMMs go through MKL, which only
`MKL_ENABLE_INSTRUCTIONS=AVX2` caps (without it a "capped" trainer still runs AVX-512
matmuls: `hotloop bench train-step` measured 346 tokens/s either way, 217 with the MKL cap).
A capped process is treated as the CPU class it emulates, so the AVX2 path can be tried (and
benchmarked) on an AVX-512 host; the capability string names every cap in force.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Dtype = Literal["auto", "bfloat16", "float32"]
"""A dtype as a config names it (`[model] dtype`, a reward model's `dtype`): "auto", or the
name of the torch dtype itself."""
DTYPES: tuple[str, ...] = tuple(d for d in get_args(Dtype) if d != "auto")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Units for which bf16 measured faster than fp32 end to end (training and vLLM generation).
FAST_BF16_FLAGS = ("amx_bf16",)
# oneDNN ISA caps below which its bf16 kernels are emulated (no AVX512-BF16 / AMX).
_ONEDNN_NO_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                   "AVX512_CORE_VNNI")
# MKL_ENABLE_INSTRUCTIONS values below AVX-512 (MKL runs torch's fp32 GEMMs on x86).
_MKL_NO_AVX512 = ("AVX2", "AVX", "SSE4_2")
_ATEN_NO_BF16 = ("default", "avx2", "avx512")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@dataclass(frozen=True)
class CpuCapability:
    isa: str
    """Widest vector ISA the process may use: "avx512", "avx2" or "other"."""
    native_bf16: tuple[str, ...]
    """Native bf16 units the process may use (subset of amx_bf16, avx512_bf16)."""
    capped_by: str = ""
    """The environment cap that narrowed the hardware, if any."""

    def __str__(self) -> str:
        s = " ".join([self.isa, *self.native_bf16])
        return f"{s} (capped by {self.capped_by})" if self.capped_by else s


def cpu_capability(flags: Iterable[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> CpuCapability:
    """The CPU's capability as this process will use it: hardware flags, then the caps."""
    flags = frozenset(cpu_flags() if flags is None else flags)
    env = os.environ if environ is None else environ
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    bf16 = tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
    caps = []
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in _ATEN_NO_BF16:
        caps.append(f"ATEN_CPU_CAPABILITY={aten}")
        if aten in ("avx2", "default"):
            isa = "avx2" if aten == "avx2" and isa != "other" else "other"
    onednn = env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    if onednn in _ONEDNN_NO_BF16:
        caps.append(f"ONEDNN_MAX_CPU_ISA={onednn}")
        if not onednn.startswith("AVX512") and isa == "avx512":
            isa = "avx2"
    mkl = env.get("MKL_ENABLE_INSTRUCTIONS", "").strip().upper()
    if mkl in _MKL_NO_AVX512:
        caps.append(f"MKL_ENABLE_INSTRUCTIONS={mkl}")
        if isa == "avx512":
            isa = "avx2" if mkl == "AVX2" else "other"
    if caps:
        bf16 = ()
    return CpuCapability(isa, bf16, ", ".join(caps))


def _cuda_available() -> bool:
    import torch  # deferred: config parsing and `hotloop --help` must not import torch

    return torch.cuda.is_available()


def resolve_device(requested: str, *, cuda: bool | None = None) -> str:
    """`auto` -> "cuda" where torch sees a GPU, else "cpu"; "cuda" without one is an error
    (a config that asks for a GPU must not silently train on the CPU)."""
    cuda = _cuda_available() if cuda is None else cuda
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    if requested == "cuda" and not cuda:
        raise ValueError("device = 'cuda' but torch sees no CUDA device on this host")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {requested!r}; choose auto, cpu or cuda")
    return requested


def resolve_dtype(requested: str, *, device: str | None = None,
                  cpu: CpuCapability | None = None) -> str:
    """`auto` -> "bfloat16" where bf16 measured faster than fp32 (CUDA, or a CPU with AMX-BF16),
    else "float32". An explicit dtype is returned unchanged (with a warning when it will be
    emulated); any other name is a ValueError that lists the ones there are.

    `device`: where the model computes, "cuda" (or "cuda:N"), "cpu", or None / "auto" for
    where torch would put it (CUDA when it sees a GPU). `cpu`: the CPU class (this host's)."""
    cuda = _cuda_available() if device in (None, "auto") else str(device).startswith("cuda")
    cpu = cpu_capability() if cpu is None else cpu
    native = cuda or bool(cpu.native_bf16)
    if requested == "auto":
        fast = cuda or any(f in cpu.native_bf16 for f in FAST_BF16_FLAGS)
        return "bfloat16" if fast else "float32"
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; choose auto, {', '.join(DTYPES)}")
    if requested == "bfloat16" and not native:
        log.warning("dtype bfloat16 on a CPU without native bf16 (%s): expect 10-100x slower "
                    "compute; dtype = \"auto\" would pick float32", cpu)
    return requested


def torch_dtype(requested: str, *, device: str | None = None,
                cpu: CpuCapability | None = None) -> torch.dtype:
    """The torch dtype of a config's dtype: a name as it is, "auto" resolved for `device` and
    `cpu` as `resolve_dtype` does. The one map from the names to torch (imported here, not
    before: parsing a config must not import torch)."""
    import torch

    name = requested if requested in DTYPES else resolve_dtype(requested, device=device, cpu=cpu)
    return getattr(torch, name)  # DTYPES are torch's own names


@lru_cache(maxsize=1)
def runtime_info(dtype: str) -> dict[str, str]:
    """What a service reports in its Status: resolved dtype, CPU capability, device."""
    cuda = _cuda_available()
    return {"dtype": dtype, "cpu": str(cpu_capability()), "device": "cuda" if cuda else "cpu"}


def describe(service: str, requested: str, resolved: str) -> str:
    """The start-up log line every service prints about its dtype choice."""
    return (f"{service}: dtype {resolved} (configured {requested!r}; cpu {cpu_capability()}; "
            f"cuda {'yes' if _cuda_available() else 'no'})")

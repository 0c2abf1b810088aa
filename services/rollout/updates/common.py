"""Shared by every update path: which vLLM linear layers an adapter may touch (fused qkv /
gate_up), the base weights, reading and validating a peft adapter, and the merge math.
Pure functions of tensors and files; no engine state."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Prefix that peft puts in front of module names when it saves an adapter.
_PEFT_PREFIX = "base_model.model."
# Embedding / output-head module names: their LoRA would change the (tied) embedding matrix,
# which vLLM serves through a different layer type; refused explicitly.
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "word_embeddings")
# Config flags that change the LoRA math beyond base + scale * B @ A.
_UNSUPPORTED_FLAGS = ("use_dora", "lora_bias", "use_qalora")


@dataclass(frozen=True)
class LinearSpec:
    """One vLLM linear layer an adapter may touch.

    ``hf_names[i]`` (a checkpoint / peft module name) fills output rows
    ``[offsets[i], offsets[i] + shard_sizes[i])`` of the fused weight, shape (N, K).
    """

    vllm_name: str  # e.g. "model.layers.0.self_attn.qkv_proj"
    hf_names: tuple[str, ...]  # e.g. ("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj")
    shard_sizes: tuple[int, ...]  # rows per shard; q != k == v under GQA
    in_features: int  # K

    @property
    def out_features(self) -> int:  # N
        return sum(self.shard_sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.shard_sizes:
            out.append(acc)
            acc += n
        return tuple(out)


@dataclass
class LoraFactor:
    """LoRA factors of one checkpoint module: delta W = scale * B @ A, A (r, K), B (n, r)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class _Packed:
    """What commit applies to one live layer.

    CPU: the ``cpu_linear`` closure (owns the packed handle; or, factored, wraps the load-time
    handle) and the ``weight`` Parameter that dispatch left behind (empty when the handle owns
    the data; the full weight on fallback paths, whose closure reads the weight passed at call
    time). Other platforms: ``shards`` (factors
    already on the device) that commit merges with the base straight into ``layer.weight``, or
    nothing (``shards is None``: copy the base back).
    """

    cpu_linear: Callable[..., torch.Tensor] | None
    weight: torch.Tensor | None
    shards: list[LoraFactor | None] | None = None


def discover_linear_specs(
    model: torch.nn.Module,
) -> tuple[dict[str, LinearSpec], dict[str, torch.nn.Module]]:
    """Map every unquantized linear layer of a vLLM model to checkpoint module names.

    Fused layers are expanded with the model's ``packed_modules_mapping`` (e.g. ``qkv_proj`` ->
    q, k, v) and the layer's ``output_sizes`` (per-shard rows, so GQA's smaller k/v are right).
    Layers wrapped for LoRA slots are unwrapped to their ``base_layer``, whose handle is the one
    the forward pass calls.
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    packed_map: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    specs: dict[str, LinearSpec] = {}
    layers: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        if not isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            continue  # quantized layers: merging into them is not supported
        if getattr(module, "tp_size", 1) != 1:
            raise NotImplementedError("hotloop merged updates support tensor parallel size 1 only")
        vname = name.removesuffix(".base_layer")
        parent, _, leaf = vname.rpartition(".")
        n_out = int(module.output_size_per_partition)
        k_in = int(module.input_size_per_partition)
        if leaf in packed_map:
            subs = packed_map[leaf]
            sizes = tuple(int(s) for s in getattr(module, "output_sizes", []))
            if len(sizes) != len(subs) or sum(sizes) != n_out:
                raise NotImplementedError(
                    f"{vname}: cannot split fused outputs {sizes} over {subs} (N={n_out})"
                )
            hf = tuple(f"{parent}.{s}" if parent else s for s in subs)
        else:
            sizes, hf = (n_out,), (vname,)
        specs[vname] = LinearSpec(vname, hf, sizes, k_in)
        layers[vname] = module
    if not specs:
        raise NotImplementedError("no unquantized linear layers found in the served model")
    return specs, layers


def build_hf_index(specs: dict[str, LinearSpec]) -> dict[str, tuple[str, int]]:
    """Checkpoint module name -> (vLLM layer name, shard index)."""
    return {hf: (s.vllm_name, i) for s in specs.values() for i, hf in enumerate(s.hf_names)}


def load_base_weights(
    model_dir: str | Path, specs: dict[str, LinearSpec], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read the base weight of every spec from the model's safetensors, fused like vLLM: (N, K).

    Handles single-file and sharded (``model.safetensors.index.json``) checkpoints.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors")
        weight_map = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                weight_map.update({k: f.name for k in fh.keys()})
    needed = {hf + ".weight" for s in specs.values() for hf in s.hf_names}
    missing = sorted(needed - weight_map.keys())
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} linear weights the engine serves "
            f"(first: {missing[:3]}); is it the model the engine was started with?"
        )
    by_file: dict[str, list[str]] = {}
    for key in needed:
        by_file.setdefault(weight_map[key], []).append(key)
    raw: dict[str, torch.Tensor] = {}
    for fname, keys in by_file.items():
        with safe_open(str(model_dir / fname), framework="pt") as fh:
            for key in keys:
                raw[key] = fh.get_tensor(key)
    base: dict[str, torch.Tensor] = {}
    for s in specs.values():
        out = torch.empty(s.out_features, s.in_features, dtype=dtype)
        for hf, off, n in zip(s.hf_names, s.offsets, s.shard_sizes):
            w = raw.pop(hf + ".weight")
            if tuple(w.shape) != (n, s.in_features):
                raise ValueError(
                    f"{hf}.weight has shape {tuple(w.shape)}, "
                    f"the engine expects {(n, s.in_features)}"
                )
            out[off : off + n].copy_(w)  # casts fp32 checkpoints to the engine dtype
        base[s.vllm_name] = out
    return base


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    # Same matching as peft.utils.other.get_pattern_key: a key matches a module-name suffix.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_files(source: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft adapter's config and tensors, from its directory or from an archive made by
    `hotloop.adapters.pack` (what the rollout service stores). The file is read once into
    memory and the tensors view that buffer (no per-tensor copies). Raises ValueError."""
    from hotloop import adapters
    from hotloop.errors import InvalidArgument

    source = Path(source)
    try:
        if source.is_file():
            files = adapters.read_archive(source)
        else:
            cfg_path = source / "adapter_config.json"
            weights_path = source / "adapter_model.safetensors"
            if not cfg_path.exists() or not weights_path.exists():
                raise ValueError(f"{source} is not a peft adapter dir (needs adapter_config.json "
                                 "and adapter_model.safetensors) nor an adapter archive")
            files = {"adapter_config.json": memoryview(cfg_path.read_bytes()),
                     "adapter_model.safetensors": memoryview(adapters.read_file(weights_path))}
        cfg = adapters.read_config(files["adapter_config.json"])
        entries, body = adapters.safetensors_header(files["adapter_model.safetensors"])
        bad = adapters.nonfinite(entries, body)
        if bad is not None:
            raise ValueError(f"{source}: {bad}: non-finite values in lora_A / lora_B")
        return cfg, adapters.tensor_views(entries, body)
    except InvalidArgument as e:
        raise ValueError(f"{source}: {e}") from None


def read_peft_adapter(adapter_dir: str | Path, max_rank: int) -> dict[str, LoraFactor]:
    """Read a peft LoRA (directory or archive) -> {checkpoint module name: LoraFactor};
    validates everything. The factors view the read buffer: never write to them.

    Raises ValueError for anything this merge path cannot represent exactly.
    """
    cfg, tensors = read_adapter_files(adapter_dir)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    bad = [f for f in _UNSUPPORTED_FLAGS if cfg.get(f)]
    if bad:
        raise ValueError(f"{adapter_dir}: {bad} not supported by merged updates")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{adapter_dir}: bias={cfg['bias']!r} not supported (needs 'none')")
    if cfg.get("modules_to_save") or cfg.get("trainable_token_indices"):
        raise ValueError(f"{adapter_dir}: modules_to_save / trainable_token_indices not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{adapter_dir}: fan_in_fan_out (Conv1D models) not supported")
    r_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", r_default))
    rank_pattern: dict[str, int] = cfg.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            if "lora_embedding" in key or any(f".{e}." in f".{key}" for e in _EMBEDDING_NAMES):
                raise ValueError(
                    f"{adapter_dir}: {key!r}: adapters on embeddings / lm_head are not supported "
                    "by merged updates (the output head is tied to the embeddings); train with "
                    "target_modules limited to the linear layers"
                )
            raise ValueError(f"{adapter_dir}: unexpected tensor {key!r} (only lora_A/lora_B)")
        module = m.group(1).removeprefix(_PEFT_PREFIX)
        parts.setdefault(module, {})[m.group(2)] = t

    out: dict[str, LoraFactor] = {}
    for module, ab in sorted(parts.items()):
        if module.rpartition(".")[2] in _EMBEDDING_NAMES:
            raise ValueError(
                f"{adapter_dir}: LoRA on {module!r}: adapters on embeddings / lm_head are not "
                "supported by merged updates (the output head is tied to the embeddings)"
            )
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{adapter_dir}: {module} has {sorted(ab)}, needs lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{adapter_dir}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                "are not (r, in) / (out, r)"
            )
        r = int(a.shape[0])
        r_cfg = int(_pattern_value(rank_pattern, module, r_default))
        if r != r_cfg:
            raise ValueError(f"{adapter_dir}: {module}: rank {r} in weights, config says {r_cfg}")
        if r > max_rank:
            raise ValueError(f"{adapter_dir}: {module}: rank {r} exceeds the limit {max_rank}")
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not math.isfinite(scale):
            raise ValueError(f"{adapter_dir}: {module}: non-finite scaling {scale}")
        out[module] = LoraFactor(a, b, scale)
    if not out:
        raise ValueError(f"{adapter_dir}: no LoRA tensors found")
    return out


def plan_merge(
    factors: dict[str, LoraFactor],
    specs: dict[str, LinearSpec],
    hf_index: dict[str, tuple[str, int]],
) -> dict[str, list[LoraFactor | None]]:
    """Group adapter factors by vLLM layer (per shard, None = shard untouched); check shapes."""
    plan: dict[str, list[LoraFactor | None]] = {}
    unknown = sorted(m for m in factors if m not in hf_index)
    if unknown:
        raise ValueError(
            f"adapter targets {len(unknown)} modules the engine does not serve as linear layers "
            f"(first: {unknown[:3]}); was it trained on this base model?"
        )
    for module, f in factors.items():
        vname, shard = hf_index[module]
        spec = specs[vname]
        n = spec.shard_sizes[shard]
        if tuple(f.a.shape)[1] != spec.in_features or tuple(f.b.shape)[0] != n:
            raise ValueError(
                f"{module}: lora_A {tuple(f.a.shape)} / lora_B {tuple(f.b.shape)} do not fit the "
                f"base weight ({n}, {spec.in_features}); was it trained on this base model?"
            )
        plan.setdefault(vname, [None] * len(spec.shard_sizes))[shard] = f
    return plan


def merge_layer(
    base: torch.Tensor,
    spec: LinearSpec,
    shards: list[LoraFactor | None],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """base (N, K) + per-shard scale * B (n, r) @ A (r, K), in base's dtype and device.

    One ``addmm`` per shard writes straight into the output rows (fp32 accumulation inside the
    GEMM, one rounding to the engine dtype); untouched shards are copied from base.
    """
    merged = torch.empty_like(base) if out is None else out
    for f, off, n in zip(shards, spec.offsets, spec.shard_sizes):
        rows = slice(off, off + n)
        if f is None:
            merged[rows].copy_(base[rows])
        else:
            a = f.a.to(device=base.device, dtype=base.dtype)
            b = f.b.to(device=base.device, dtype=base.dtype)
            torch.addmm(base[rows], b, a, alpha=f.scale, out=merged[rows])
    return merged

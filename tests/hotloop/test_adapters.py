"""Adapter archives (hotloop/adapters.py): receiving one in chunks, reading it in place, and
the checks that refuse a bad push before anything reaches an engine."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from safetensors.torch import save, save_file

from hotloop import adapters
from hotloop.errors import FailedPrecondition, InvalidArgument

# The tiny model's linears (tests/conftest.py tiny_model): hidden 256, 4 heads of 64, 2 KV
# heads, intermediate 512, 4 layers.
SHAPES = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
          "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}


def peft_tensors(r: int = 4, layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        for m, (fan_in, fan_out) in SHAPES.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            out[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g)
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g)
    return out


def adapter_dir(tmp_path, tensors=None, r: int = 4, name: str = "a"):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8}))
    save_file(tensors if tensors is not None else peft_tensors(r), str(d / "adapter_model.safetensors"))
    return d


def receive(tmp_path, data: bytes, info: adapters.Version, chunk: int = 1000):
    inc = adapters.Incoming(info, tmp_path / "incoming.tar")
    try:
        for i in range(0, len(data), chunk):
            inc.add(data[i : i + chunk])
        return inc, inc.finish()
    except BaseException:
        inc.discard()
        raise


def test_incoming_keeps_the_bytes_and_writes_the_file_as_they_arrive(tmp_path):
    data = adapters.pack(adapter_dir(tmp_path))
    info = adapters.Version(1, adapters.sha256(data), len(data))
    inc, files = receive(tmp_path, data, info)
    assert inc.path.read_bytes() == data
    assert set(files) == set(adapters.FILES)
    assert bytes(files["adapter_config.json"]) == (tmp_path / "a" / "adapter_config.json").read_bytes()
    assert bytes(files["adapter_model.safetensors"]) == \
        (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    inc.discard()
    assert not inc.path.exists()


@pytest.mark.parametrize("declared,sha,needle", [
    (-1, None, "larger than its declared"),
    (+1, None, "truncated"),
    (0, "0" * 64, "sha256 mismatch"),
])
def test_incoming_refuses_size_and_digest(tmp_path, declared, sha, needle):
    data = adapters.pack(adapter_dir(tmp_path))
    info = adapters.Version(1, sha or adapters.sha256(data), len(data) + declared)
    with pytest.raises(InvalidArgument, match=needle):
        receive(tmp_path, data, info)
    assert not (tmp_path / "incoming.tar").exists()


def _tar(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_members_refuses_anything_but_the_two_files(tmp_path):
    good = adapters.members(adapters.pack(adapter_dir(tmp_path)))
    assert set(good) == set(adapters.FILES)
    with pytest.raises(InvalidArgument, match="not a valid tar"):
        adapters.members(b"x" * 1024)
    with pytest.raises(InvalidArgument, match="exactly"):
        adapters.members(_tar({"adapter_config.json": b"{}"}))
    with pytest.raises(InvalidArgument, match="exactly"):
        adapters.members(_tar({"adapter_config.json": b"{}", "adapter_model.safetensors": b"",
                               "../evil": b"x"}))


def test_unpack_writes_the_files_from_bytes_or_a_path(tmp_path):
    src = adapter_dir(tmp_path)
    data = adapters.pack(src)
    (tmp_path / "x.tar").write_bytes(data)
    for n, arg in enumerate((data, tmp_path / "x.tar")):
        out = adapters.unpack(arg, tmp_path / f"out{n}")
        for name in adapters.FILES:
            assert (out / name).read_bytes() == (src / name).read_bytes()


def test_tensor_views_read_the_buffer_in_place():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.randn(2, 2).half()}
    buf = bytearray(save(tensors))
    entries, body = adapters.safetensors_header(buf)
    views = adapters.tensor_views(entries, body)
    for k, t in tensors.items():
        assert torch.equal(views[k], t), k
    # no copy: a view's storage lies inside the buffer
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert all(base <= v.data_ptr() < base + len(buf) for v in views.values())


@pytest.mark.parametrize("where", [0, 1, 2047, -1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_names_the_tensor_wherever_the_value_is(where, bad, dtype):
    tensors = {k: v.to(dtype) for k, v in peft_tensors(r=4, layers=1).items()}
    victim = sorted(tensors)[3]
    tensors[victim].view(-1)[where] = bad
    entries, body = adapters.safetensors_header(bytearray(save(tensors)))
    assert adapters.nonfinite(entries, body) == victim


def test_nonfinite_passes_finite_tensors_of_mixed_dtypes():
    tensors = {"a": torch.randn(64, 8), "b": torch.randn(8, 64).bfloat16(), "c": torch.full((4,), 3e38)}
    entries, body = adapters.safetensors_header(bytearray(save(tensors)))
    assert adapters.nonfinite(entries, body) is None


def test_safetensors_header_refuses_bad_files():
    good = bytearray(save({"a": torch.randn(4)}))
    with pytest.raises(InvalidArgument, match="shorter"):
        adapters.safetensors_header(b"abc")
    with pytest.raises(InvalidArgument, match="longer than the file"):
        adapters.safetensors_header((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(InvalidArgument, match="bad header"):
        adapters.safetensors_header((4).to_bytes(8, "little") + b"{{{{")
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    for change, needle in (({"data_offsets": [0, 64]}, "outside its data"),
                           ({"shape": [5]}, "outside its data"),
                           ({"dtype": "I64"}, "not a float type")):
        h = json.dumps({"a": {**header["a"], **change}}).encode()
        with pytest.raises(InvalidArgument, match=needle):
            adapters.safetensors_header(len(h).to_bytes(8, "little") + h + good[8 + n :])


def test_validate_checks_the_base_model(tmp_path, tiny_model):
    files = adapters.members(adapters.pack(adapter_dir(tmp_path, r=4)))
    assert adapters.validate(files, tiny_model, max_rank=8)["r"] == 4
    with pytest.raises(FailedPrecondition, match="outside this replica's limit"):
        adapters.validate(files, tiny_model, max_rank=2)
    wrong = {k: (v[:, :100].contiguous() if "lora_A" in k else v) for k, v in peft_tensors(r=4).items()}
    files = adapters.members(adapters.pack(adapter_dir(tmp_path, wrong, name="wrong")))
    with pytest.raises(FailedPrecondition, match="another base model"):
        adapters.validate(files, tiny_model, max_rank=8)
    deep = peft_tensors(r=4, layers=5)  # the tiny model has 4 layers
    files = adapters.members(adapters.pack(adapter_dir(tmp_path, deep, name="deep")))
    with pytest.raises(FailedPrecondition, match="has 4 layers"):
        adapters.validate(files, tiny_model, max_rank=8)
    nan = peft_tensors(r=4)
    nan[sorted(nan)[-1]][0, 0] = float("nan")
    files = adapters.members(adapters.pack(adapter_dir(tmp_path, nan, name="nan")))
    with pytest.raises(InvalidArgument, match="NaN or inf"):
        adapters.validate(files, tiny_model, max_rank=8)

"""The checked-in stubs must equal what protoc generates from protos/ now."""

from pathlib import Path

from hotloop import protogen


def test_stubs_are_fresh(tmp_path):
    protogen.generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "hotloop/proto").rglob("*.py*")}
    root = Path(protogen.ROOT)
    checked = {p.relative_to(root): p.read_bytes() for p in (root / "hotloop/proto").rglob("*.py*")}
    stale = sorted(str(k) for k in fresh if checked.get(k) != fresh[k])
    assert not stale, f"stale stubs (run `make protos`): {stale}"

"""The trainer refuses to start when the reference computes in another dtype (a real
reference server on port 0)."""

from __future__ import annotations

import pytest

from hotloop.clients import ReferenceClient
from services.reference.config import ReferenceConfig
from services.reference.core import ReferenceCore
from services.reference.server import serve
from services.trainer.config import TrainerConfig
from services.trainer.runner import check_dtype


@pytest.fixture
async def reference(tiny_model):
    core = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32"))
    server, port, _ = await serve(core, "127.0.0.1:0")
    client = ReferenceClient(f"127.0.0.1:{port}")
    yield client
    await client.close()
    await server.stop(0)


async def test_reference_status_reports_its_resolved_dtype(reference, tiny_model):
    st = await reference.status()
    assert st.runtime.dtype == "float32" and st.runtime.cpu and st.runtime.device == "cpu"
    assert st.model == str(tiny_model)


async def test_a_dtype_mismatch_with_the_reference_stops_the_trainer(reference, tiny_model):
    cfg = TrainerConfig(model=str(tiny_model), dtype="bfloat16", loss={"kl_beta": 0.04})
    with pytest.raises(SystemExit, match="reference service computes in float32 but the trainer in bfloat16"):
        await check_dtype(cfg, reference)
    same = TrainerConfig(model=str(tiny_model), dtype="float32", loss={"kl_beta": 0.04})
    assert await check_dtype(same, reference) == "float32"
    # without a KL term the reference is never asked, so no mismatch can matter
    no_kl = TrainerConfig(model=str(tiny_model), dtype="bfloat16")
    assert await check_dtype(no_kl, reference) == "bfloat16"


async def test_every_reference_replica_is_checked(reference, tiny_model):
    from hotloop.replicas import References

    core = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="bfloat16"))
    server, port, _ = await serve(core, "127.0.0.1:0")
    other = ReferenceClient(f"127.0.0.1:{port}")
    cfg = TrainerConfig(model=str(tiny_model), dtype="float32", loss={"kl_beta": 0.04})
    try:
        with pytest.raises(SystemExit, match=f"reference service at 127.0.0.1:{port} computes in bfloat16 "
                                             "but the trainer in float32"):
            await check_dtype(cfg, References([reference, other]))
    finally:
        await other.close()
        await server.stop(0)

import pytest

from hotloop import models


def test_tiny_model_manifest_and_verify(tiny_model):
    models.verify(tiny_model, full=True)
    assert models.resolve(str(tiny_model)) == tiny_model.resolve()
    (tiny_model / "extra").write_text("x")  # unrelated files do not break verification
    weights = tiny_model / "model.safetensors"
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[:-1])
        with pytest.raises(models.ModelError, match="wrong size"):
            models.verify(tiny_model)
    finally:
        weights.write_bytes(data)
        (tiny_model / "extra").unlink()


def test_unknown_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTLOOP_CACHE", str(tmp_path))
    with pytest.raises(models.ModelError, match="hotloop models pull"):
        models.resolve("no-such-model")
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(models.ModelError, match="config.json"):
        models.resolve(str(tmp_path / "notamodel"))


@pytest.mark.real_model
def test_default_model_is_a_normal_hf_directory():
    from transformers import AutoConfig, AutoTokenizer

    path = models.pull(models.DEFAULT_MODEL, progress=False)  # idempotent: verifies, no work
    models.verify(path, full=True)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template, "the chat template did not survive conversion"
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert (path / "model.safetensors").stat().st_size > 400e6

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


def test_a_shaped_model_has_the_named_shape_and_random_weights(tmp_path, monkeypatch):
    import json

    from safetensors import safe_open

    monkeypatch.setitem(models.MODEL_SHAPES, "tiny-test", (16, 3, 40, 96, 4, 2))
    path = models.build_shaped_model(tmp_path, "tiny-test", dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert path == tmp_path / "tiny-test"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
            cfg["vocab_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == \
        (16, 3, 40, 96, 4, 2)
    with safe_open(path / "model.safetensors", "pt") as f:
        w = f.get_tensor("model.layers.2.mlp.down_proj.weight")
    assert tuple(w.shape) == (16, 40) and str(w.dtype) == "torch.bfloat16" and w.std() > 0
    with pytest.raises(ValueError, match="unknown shape 'gpt-7'; known: smollm2-135m"):
        models.build_shaped_model(tmp_path, "gpt-7")


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

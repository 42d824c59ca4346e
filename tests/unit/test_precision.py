"""KV precision: which dtype a model is served in, and that it decides the cache fingerprint."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.models.precision import HALF, apply_kv_dtype, resolve_kv_dtype
from tests.unit.test_cache_models import tiny_llama


def test_resolve():
    assert resolve_kv_dtype("auto", metal=False) is None  # the Linux CPU keeps float32
    assert resolve_kv_dtype("auto", metal=True) == HALF
    assert resolve_kv_dtype("native", metal=True) is None
    assert resolve_kv_dtype("bfloat16", metal=False) == "bfloat16"
    with pytest.raises(ValueError):
        resolve_kv_dtype("float8", metal=True)


def test_auto_halves_a_float32_model_and_its_kv():
    model = tiny_llama(False)  # float32 parameters, so float32 KV
    assert PromptStates(model, None).kv_dtype == mx.float32
    assert apply_kv_dtype(model, HALF, only_if_float32=True)
    assert PromptStates(model, None).kv_dtype == getattr(mx, HALF)
    assert not apply_kv_dtype(model, HALF, only_if_float32=True)  # already done


def test_auto_leaves_a_half_precision_model_alone():
    model = tiny_llama(False)
    model.set_dtype(mx.bfloat16)
    assert not apply_kv_dtype(model, HALF, only_if_float32=True)
    assert PromptStates(model, None).kv_dtype == mx.bfloat16
    assert apply_kv_dtype(model, HALF, only_if_float32=False)  # an explicit --kv-dtype
    assert PromptStates(model, None).kv_dtype == getattr(mx, HALF)


def test_kv_dtype_is_part_of_the_fingerprint(tmp_path):
    from mlx_kvserve.models.identity import fingerprint_model

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("{}")
    native = fingerprint_model(tmp_path, "m")
    assert fingerprint_model(tmp_path, "m", None) == native
    assert fingerprint_model(tmp_path, "m", "float16") != native
    assert fingerprint_model(tmp_path, "m", "float16") != fingerprint_model(
        tmp_path, "m", "bfloat16"
    )


def test_a_snapshot_is_never_restored_into_another_dtype(tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvserve.cache import CacheRestoreError, PromptCache

    model = tiny_llama(True)  # rotating + full attention: the snapshot path
    prompt = list(range(1, 21))
    cache = PromptCache(tmp_path, "tiny-dtype", disk_budget=1 << 26, ram_budget=1 << 26)
    live = make_prompt_cache(model)
    model(mx.array([prompt[:12]]), cache=live)
    assert cache.checkpoint(prompt[:12], live, "message") is not None
    match = cache.lookup(prompt)
    assert match.kind == "snapshot" and match.usable == 12
    with pytest.raises(CacheRestoreError, match="float32"):
        cache.restore(match, make_prompt_cache(model), tokens=prompt, dtype=mx.float16)
    cache.restore(match, make_prompt_cache(model), tokens=prompt, dtype=mx.float32)
    cache.close()


def _tiny(tmp_path, model_type: str, dtype: str):
    from mlx_lm import load

    from tests.support.tiny_models import make_model_dir

    model, _ = load(str(make_model_dir(tmp_path / model_type, model_type, dtype=dtype)))
    return model


def _dtypes(model) -> dict[str, mx.Dtype]:
    from mlx.utils import tree_flatten

    return {k: v.dtype for k, v in tree_flatten(model.parameters())}


def test_auto_leaves_a_bf16_model_with_deliberate_float32_tensors_alone(tmp_path):
    """Qwen3.5 keeps `A_log` in float32 on purpose; the model still computes in bfloat16, so
    "auto" changes nothing (it once recast the whole model to float16)."""
    model = _tiny(tmp_path, "qwen3_5", "bfloat16")
    before = _dtypes(model)
    kept = [k for k, d in before.items() if d == mx.float32]
    assert kept and all(k.endswith("A_log") for k in kept)
    assert not apply_kv_dtype(model, HALF, only_if_float32=True)
    assert _dtypes(model) == before
    assert PromptStates(model, None).kv_dtype == mx.bfloat16


def test_a_cast_keeps_the_tensors_mlx_lm_keeps_in_float32(tmp_path):
    """A float32 model is halved by "auto", but not the tensors its `cast_predicate` keeps."""
    model = _tiny(tmp_path, "qwen3_5", "float32")
    assert apply_kv_dtype(model, HALF, only_if_float32=True)
    after = _dtypes(model)
    assert {d for k, d in after.items() if k.endswith("A_log")} == {mx.float32}
    assert {d for k, d in after.items() if not k.endswith("A_log")} == {getattr(mx, HALF)}
    assert PromptStates(model, None).kv_dtype == getattr(mx, HALF)


def test_the_fingerprint_names_the_dtype_actually_served():
    """`--kv-dtype auto` on Metal resolves to float16 but leaves a bf16 model alone: the cache
    it uses is then the one of the model's own dtype, not float16's."""
    from mlx_kvserve.models.precision import served_dtype

    assert served_dtype("auto", "float16", cast=True) == "float16"  # a float32 model, cast
    assert served_dtype("auto", "float16", cast=False) is None  # a bf16 model, left alone
    assert served_dtype("auto", None, cast=False) is None  # auto on the CPU
    assert served_dtype("float16", "float16", cast=False) == "float16"  # already float16
    assert served_dtype("native", None, cast=False) is None

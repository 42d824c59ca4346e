"""The cache with tiny random-weight mlx-lm models: restored state gives identical logits.

Both runs feed the same chunks (cold: [0, u) then [u, n); cached: restore u, then [u, n)), so a
correct restore must reproduce the logits bit for bit. Architectures: plain attention (delta
path), sliding-window + full attention (snapshot path, mixed caches), Mamba2 (SSM snapshot).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama, mamba2
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserve.cache import PromptCache

MiB = 1 << 20


def tiny_llama(sliding: bool, vocab: int = 97, tied: bool = True):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=8 if sliding else None,
        tie_word_embeddings=tied,
    )
    return llama.Model(args)


def tiny_mamba2():
    args = mamba2.ModelArgs(
        model_type="mamba2",
        num_heads=4,
        head_dim=8,
        vocab_size=97,
        hidden_size=32,
        intermediate_size=32,
        state_size=8,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank="auto",
    )
    return mamba2.Model(args)


MODELS = {
    "llama": (lambda: tiny_llama(False), "delta"),
    "llama-sliding": (lambda: tiny_llama(True), "snapshot"),
    "mamba2": (tiny_mamba2, "snapshot"),
}


def prefill(model, cache, tokens, chunk=5):
    out = None
    for i in range(0, len(tokens), chunk):
        out = model(mx.array([tokens[i : i + chunk]]), cache=cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("restart", [False, True], ids=["ram", "disk"])
def test_restored_state_reproduces_logits(tmp_path, name, restart):
    mx.random.seed(0)
    build, kind = MODELS[name]
    model = build()
    mx.eval(model.parameters())
    prompt = [(7 * i + 3) % 97 for i in range(23)]
    u = 15  # beyond the sliding window: the rotating cache has wrapped

    cold = make_prompt_cache(model)
    prefill(model, cold, prompt[:u])
    want = prefill(model, cold, prompt[u:])

    pc = PromptCache(tmp_path, f"tiny-{name}", disk_budget=64 * MiB, ram_budget=64 * MiB)
    live = make_prompt_cache(model)
    prefill(model, live, prompt[:u])
    key = pc.checkpoint(prompt[:u], live, "message", probe=None)
    assert key is not None
    assert {e.kind for e in pc.entries()} == {kind}
    if restart:
        pc.close()
        pc = PromptCache(tmp_path, f"tiny-{name}", disk_budget=64 * MiB, ram_budget=64 * MiB)

    m = pc.lookup(prompt)
    assert m.usable == u and m.kind == kind
    cache = pc.restore(m, make_prompt_cache(model), tokens=prompt)
    got = prefill(model, cache, prompt[u:])
    assert mx.array_equal(got, want).item()
    # Greedy decoding continues identically.
    a, b = cold, cache
    for _ in range(5):
        ta = int(mx.argmax(want[0, -1]).item())
        tb = int(mx.argmax(got[0, -1]).item())
        assert ta == tb
        want = model(mx.array([[ta]]), cache=a)
        got = model(mx.array([[tb]]), cache=b)
        assert mx.array_equal(got, want).item()
    pc.close()


def test_snapshot_model_never_trims(tmp_path):
    model = tiny_mamba2()
    mx.eval(model.parameters())
    prompt = list(range(1, 21))
    pc = PromptCache(tmp_path, "tiny-mamba2", disk_budget=64 * MiB, ram_budget=64 * MiB)
    live = make_prompt_cache(model)
    prefill(model, live, prompt)
    pc.checkpoint(prompt, live, "message")
    assert pc.lookup(prompt[:12]).usable == 0  # an SSM state cannot be rewound
    assert pc.lookup(prompt[:10] + [50] * 15).usable == 0
    assert pc.lookup(prompt + [5]).usable == 20
    pc.close()

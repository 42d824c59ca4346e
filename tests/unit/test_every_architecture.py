"""Every architecture mlx-lm ships, through the prompt cache: a checkpoint of a prefilled state,
restored into fresh caches, gives the same next-token logits as the state itself.

In process (no server: the end-to-end matrix is tests/server/test_architectures.py), on tiny generic
instances (tests/support/every_architecture.py). An architecture the generic dimensions cannot
build is skipped with the reason; one whose cache state cannot be set back must be said so by
the layer description (the server then stores no checkpoint of it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.kinds import describe_model
from tests.support.every_architecture import VOCAB, architectures, build

pytestmark = pytest.mark.slow
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB - 1, 61)]


def forward(model, caches, tokens):
    out = model(mx.array(tokens)[None], cache=caches)
    mx.eval(out)
    return out


@pytest.mark.parametrize("model_type", architectures())
def test_a_restored_checkpoint_continues_like_the_state_it_saved(model_type, tmp_path):
    model = build(model_type)
    if isinstance(model, str):
        pytest.skip(f"no generic tiny {model_type}: {model[:160]}")
    try:
        live = make_prompt_cache(model)
        if not live:
            pytest.skip(f"generic tiny {model_type} has no layers")
        forward(model, live, PROMPT[:60])
    except Exception as exc:  # the generic dimensions break the model's own forward pass
        pytest.skip(f"generic tiny {model_type} does not run: {exc!r}"[:200])
    layout = describe_model(model)  # must describe any architecture without raising
    if layout.unrestorable:
        return  # the server turns its prompt cache off (test_architectures.py shows it)
    with PromptCache(tmp_path, "fp", disk_budget=1 << 30, ram_budget=0) as pc:
        assert pc.checkpoint(PROMPT[:60], live, "message") is not None
        pc.flush()
        match = pc.lookup(PROMPT)
        assert match.hit and match.usable == 60 and match.source == "disk"
        fresh = make_prompt_cache(model)
        pc.restore(match, fresh, tokens=PROMPT)
    expected = forward(model, live, PROMPT[60:])
    got = forward(model, fresh, PROMPT[60:])
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), atol=1e-4).item(), (
        layout.summary()
    )

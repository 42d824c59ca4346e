"""Speculative decoding's parts, each usable and tested on its own (issue 31, first slice).

- `drafts`: where a row's next tokens are guessed from (`DraftSource`), and prompt lookup, the
  first source: the tokens that followed the longest earlier match of the row's last n tokens.
- `continuations`: the second source, the prompt cache's continuations: what finished requests'
  tokens (per model and cache namespace, bounded) went on with after the row's last n tokens.
- `mtp`: the third, a checkpoint's own MTP heads (models/mtp_heads.py), fed the target's hidden
  states of every pass.
- `verify`: exact acceptance of a batch of drafts from one forward pass (greedy, and sampled
  rows through their own sampler and seed), pure functions over mx arrays.
- `depth`: how many tokens each row drafts, from measured acceptance and measured verify cost
  (0 when nothing pays).
- `holes`: per-row rollback of a merged KV batch without moving KV.
- `snapshot`: a lone row's rollback of windows and recurrent states (snapshot, then replay).
- `plan`: what a row feeds a verify pass (its grammar's forced tokens too) and where it samples.
- `job`: across the ranks of a job, every rank weighs drafts with rank 0's timings.
- `step`: the speculative decode step the decode batch tries first (imported by
  engine/batch.py, not re-exported here).

How they fit into the decode step, and how each cache kind rolls back per row, is in
docs/speculation.md.
"""

from mlx_kvserve.engine.speculation.depth import DepthController, VerifyCost, plan_width
from mlx_kvserve.engine.speculation.drafts import Draft, Drafter, DraftSource, PromptLookup
from mlx_kvserve.engine.speculation.verify import Verified, accepted_lengths, draw, verify

__all__ = [
    "DepthController",
    "Draft",
    "DraftSource",
    "Drafter",
    "PromptLookup",
    "Verified",
    "VerifyCost",
    "accepted_lengths",
    "draw",
    "plan_width",
    "verify",
]

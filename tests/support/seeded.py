"""Seeded sampled requests that a test compares token for token with one another.

Under `--speculation auto` (the default) a request's tokens are computed by verify passes of
a width the depth controller picks from measured time, and a wider pass rounds float32 sums
otherwise than a one-token pass (logits differing by about 1e-6). Greedy answers do not notice;
a seeded draw at temperature 1 from a random model's nearly uniform distribution over 49k ids
can: MLX's draw behaves as an inverse CDF, with a boundary between adjacent ids every ~2e-5
of probability, and a measured flip (17795 vs 17796, candidates within 9.5e-7) had its
uniform ~7e-8 from one.
That is the same answer up to float rounding (docs/speculation.md), not a bug, but it is not
what a test of streaming or a thinking budget compares: such requests opt out (`speculative:
false`, the per-request opt-out), so both sides decode plainly. Speculation's own exactness is
tested in tests/unit/test_speculation_*.py and tests/server/test_speculation_server.py.
"""

PLAIN = {"speculative": False}  # a request body's (or the SDK's `extra_body`) opt-out

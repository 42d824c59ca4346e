"""The model's reasoning section: its markers and template controls (thinking), the thinking
budget during decoding (reasoning_gate), the turns kept as the tokens the model sampled
(sampled_turns), and the seal that lets a client hand past reasoning back (reasoning_seal)."""

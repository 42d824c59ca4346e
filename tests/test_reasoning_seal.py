"""The reasoning seal: exact text back for our own seals, None for anything else."""

from __future__ import annotations

import os
import stat

from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.chat.reasoning_seal import ReasoningSeal

SEAL = ReasoningSeal(b"k" * 32)


@given(st.text())
def test_round_trip_is_exact(text: str) -> None:
    assert SEAL.open(SEAL.seal(text)) == text


@given(st.text(), st.integers(min_value=0), st.characters())
def test_any_change_is_refused(text: str, where: int, char: str) -> None:
    sealed = SEAL.seal(text)
    i = where % len(sealed)
    tampered = sealed[:i] + char + sealed[i + 1 :]
    if tampered != sealed:
        assert SEAL.open(tampered) in (None, text)  # base64 padding bits may be ignored
        assert SEAL.open(sealed[:i]) is None


@given(st.one_of(st.none(), st.integers(), st.text(), st.binary()))
def test_foreign_values_are_refused(value: object) -> None:
    assert SEAL.open(value) is None


def test_another_key_does_not_open() -> None:
    assert ReasoningSeal(b"x" * 32).open(SEAL.seal("thought")) is None
    # Anthropic's own signatures are base64 blobs: never ours.
    assert SEAL.open("EqQBCkgIARABGAIiQL2Y...") is None


def test_install_key_is_private_and_stable(tmp_path) -> None:
    first = ReasoningSeal.for_install(tmp_path)
    second = ReasoningSeal.for_install(tmp_path)
    assert second.open(first.seal("same key after a restart")) == "same key after a restart"
    key = tmp_path / "reasoning-seal.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

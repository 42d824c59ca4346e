"""The reasoning seal: exact text back for our own seals, None for anything else."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.api.app import create_app
from mlx_kvserve.api.seal import make_reasoning_seal
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.models.pool import ModelPool

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


def _write_key(path, data: bytes, mode: int = 0o600) -> None:
    path.write_bytes(data)
    os.chmod(path, mode)


BAD_KEYS = {
    "empty": (b"", 0o600, "empty"),
    "short": (b"k" * 15, 0o600, "15 bytes, not 32"),
    "long": (b"k" * 64, 0o600, "64 bytes, not 32"),
    "shared": (b"k" * 32, 0o644, "mode 0644: other users may read it"),
}


@pytest.mark.parametrize("kind", BAD_KEYS)
def test_a_key_file_this_install_would_not_write_is_replaced(tmp_path, caplog, kind) -> None:
    """Empty after a power cut, short, another size, readable by others: a new key, a warning,
    and the server starts; reasoning sealed with the old key falls back to its visible text."""
    data, mode, why = BAD_KEYS[kind]
    key = tmp_path / "reasoning-seal.key"
    _write_key(key, data, mode)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.chat"):
        seal = ReasoningSeal.for_install(tmp_path)
    assert f"replacing the reasoning-seal key {key} ({why})" in caplog.text
    assert len(key.read_bytes()) == 32 and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert seal.open(seal.seal("kept")) == "kept"
    assert ReasoningSeal.for_install(tmp_path).open(seal.seal("after a restart")) == (
        "after a restart"
    )
    if len(data) >= 16:
        assert seal.open(ReasoningSeal(data).seal("old")) is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_link_in_place_of_the_key_is_replaced_not_followed(tmp_path, caplog) -> None:
    elsewhere = tmp_path / "elsewhere"
    _write_key(elsewhere, b"e" * 32)
    key = tmp_path / "reasoning-seal.key"
    key.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.chat"):
        ReasoningSeal.for_install(tmp_path)
    assert "(a symbolic link)" in caplog.text
    assert not key.is_symlink() and len(key.read_bytes()) == 32
    assert elsewhere.read_bytes() == b"e" * 32  # what the link pointed at is left alone


def test_an_unusable_key_path_leaves_a_key_for_this_process(tmp_path, monkeypatch, caplog):
    """A directory where the key file should be cannot be replaced: seals last until exit."""
    monkeypatch.setenv("MLX_KVSERVE_DATA_DIR", str(tmp_path))
    (tmp_path / "reasoning-seal.key").mkdir()
    with caplog.at_level(logging.WARNING):
        seal = make_reasoning_seal()
    assert "reasoning seals last until exit" in caplog.text
    assert seal.open(seal.seal("this process")) == "this process"


def test_the_app_starts_with_a_short_key_file(tmp_path, monkeypatch) -> None:
    """It used to raise ValueError from create_app: the server could not start until the file
    was deleted by hand."""
    monkeypatch.setenv("MLX_KVSERVE_DATA_DIR", str(tmp_path))
    _write_key(tmp_path / "reasoning-seal.key", b"short")

    def no_model():
        raise FileNotFoundError("not loaded in this test")

    app = create_app(Settings(), ModelPool.single(Engine(no_model), "m"))
    seal = app.state.reasoning_seal
    assert seal.open(seal.seal("ok")) == "ok"
    assert len((tmp_path / "reasoning-seal.key").read_bytes()) == 32

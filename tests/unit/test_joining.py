"""What the ranks of a job compare before they serve together (distributed/join.py): their
versions, and their model by content (models/manifest.py), so that a copy of the same model made
with `cp -r` or `scp -r` under another name joins and a changed file does not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mlx_kvserve.distributed.join import JoinError, check_same_versions, versions
from mlx_kvserve.models.identity import fingerprint_model
from mlx_kvserve.models.manifest import (
    SAMPLE_BLOCKS,
    SAMPLE_BYTES,
    model_fingerprint_source,
    sample_offsets,
)
from tests.support.tiny_models import make_model_dir


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    """A model directory as a user has it: no manifest, weights larger than the sample."""
    model = make_model_dir(tmp_path_factory.mktemp("identity") / "llama", "llama")
    assert (model / "model.safetensors").stat().st_size > SAMPLE_BLOCKS * SAMPLE_BYTES
    return model


def copied(model: Path, dest: Path) -> Path:
    """A copy as `scp -r` makes it: the same bytes, new mtimes."""
    shutil.copytree(model, dest, copy_function=shutil.copyfile)
    for path in dest.iterdir():
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    return dest


def test_a_copy_with_new_mtimes_and_another_name_is_the_same_model(user_model, tmp_path):
    copy = copied(user_model, tmp_path / "Llama-copied-elsewhere")
    assert (copy / "model.safetensors").stat().st_mtime_ns != (
        user_model / "model.safetensors"
    ).stat().st_mtime_ns
    assert model_fingerprint_source(copy)["weights"]["scheme"] == "size-sampled-sha256"
    # what join compares (the content), and what names the prompt cache (stable for the model)
    assert fingerprint_model(copy, "") == fingerprint_model(user_model, "")
    assert fingerprint_model(user_model, "llama") == fingerprint_model(user_model, "llama")
    os.utime(user_model / "model.safetensors")  # touched, not changed: the same cache
    assert fingerprint_model(copy, "llama") == fingerprint_model(user_model, "llama")


@pytest.mark.parametrize("block", [0, SAMPLE_BLOCKS // 2, SAMPLE_BLOCKS - 1])
def test_a_file_with_one_changed_sampled_block_is_another_model(user_model, tmp_path, block):
    copy = copied(user_model, tmp_path / "changed")
    weights = copy / "model.safetensors"
    offset = sample_offsets(weights.stat().st_size)[block] + SAMPLE_BYTES // 2
    with weights.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert fingerprint_model(copy, "") != fingerprint_model(user_model, "")


def test_sample_offsets_cover_the_file_from_its_first_block_to_its_last():
    size = 10 * SAMPLE_BLOCKS * SAMPLE_BYTES + 12345
    offsets = sample_offsets(size)
    assert len(offsets) == SAMPLE_BLOCKS and offsets == sorted(set(offsets))
    assert offsets[0] == 0 and offsets[-1] + SAMPLE_BYTES == size
    small = 3 * SAMPLE_BYTES + 1  # a small file is read whole
    assert sample_offsets(small) == [0, SAMPLE_BYTES, 2 * SAMPLE_BYTES, 3 * SAMPLE_BYTES]


def rank(host: str, **versions: str) -> dict:
    found = {"mlx-kvserve": "0.1.0", "mlx": "0.32.4", "mlx-lm": "0.32.2", **versions}
    return {"host": host, "versions": found, "fingerprint": "f"}


def test_ranks_that_run_other_versions_are_named_with_them():
    check_same_versions([rank("a"), rank("b"), rank("c")])
    with pytest.raises(JoinError) as refused:
        check_same_versions([rank("a"), rank("b"), rank("c", mlx="0.31.0", **{"mlx-lm": "0.3"})])
    message = str(refused.value)
    assert message.startswith("rank 2 (c) runs mlx 0.31.0 against 0.32.4, mlx-lm 0.3 against ")
    assert "rank 1" not in message and "on rank 0 (a)" in message
    assert "install the same mlx-kvserve, mlx and mlx-lm on every host" in message


def test_a_rank_from_before_the_version_check_is_refused():
    old = {"host": "b", "fingerprint": "f"}  # what a rank of an older version gathers
    with pytest.raises(JoinError, match=r"rank 1 \(b\) runs mlx-kvserve unknown against 0.1.0"):
        check_same_versions([rank("a"), old])


def test_this_rank_reports_what_it_runs():
    from importlib.metadata import version

    import mlx_kvserve

    found = versions()
    assert found == {
        "mlx-kvserve": mlx_kvserve.__version__,
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
    }

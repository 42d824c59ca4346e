"""`mlx-kvserve cluster join` across real ranks: `mlx.launch` with the ring backend on loopback.

Every rank fingerprints its model, loads its shard (tensor parallel for llama, a pipeline for
qwen3_next) and decodes a greedy probe together with the others; the probe must equal what one
process decodes from the whole model. Refusals (different model files on one rank, heads that
the world size does not divide) come with the same message on every rank and exit status 2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm import load

from mlx_kvserve.distributed.join import greedy_probe, versions
from tests.support.launch import on_rank, run_job
from tests.support.tiny_models import make_model_dir

pytestmark = pytest.mark.slow


def join(
    dirs: list[Path], ranks: int, *options: str, wrap: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`wrap`: each rank's command under a wrapper (`launch.on_rank`)."""
    command = [*wrap, sys.executable, "-m", "tests.support.cluster_join_job", *map(str, dirs)]
    return run_job([*command, "--", "--timeout", "20", *options], ranks)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("cluster-join")
    return {
        "llama": make_model_dir(work / "llama", "llama"),
        "llama-other": make_model_dir(work / "llama-other", "llama", seed=1),
        "qwen3_next": make_model_dir(work / "qwen3_next", "qwen3_next"),
    }


def exit_codes(proc: subprocess.CompletedProcess) -> dict[int, int]:
    """Per rank, the exit status mlx.launch reports (it exits 0 itself whatever they did)."""
    found = re.findall(r"Node with rank (\d+) exited with code (-?\d+)", proc.stderr)
    return {int(rank): int(code) for rank, code in found}


def single_process_probe(model_dir: Path) -> list[int]:
    model, tokenizer = load(str(model_dir))
    return greedy_probe(model, tokenizer)


@pytest.mark.parametrize(("arch", "mode"), [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_two_ranks_step_together_and_decode_like_one_process(models, arch, mode):
    proc = join([models[arch]], 2, "--shard", mode)
    assert proc.returncode == 0 and not exit_codes(proc), proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if "greedy probe" in x]
    assert line.startswith("2 rank(s) on ") and f"{mode} parallel" in line
    probe = [int(t) for t in re.search(r"greedy probe \[([\d, ]+)\]", line).group(1).split(",")]
    assert probe == single_process_probe(models[arch])


def test_a_rank_with_other_model_files_is_named_on_every_rank(models):
    proc = join([models["llama"], models["llama-other"]], 2)
    assert 2 in exit_codes(proc).values(), proc.stderr
    refusals = [x for x in proc.stderr.splitlines() if "model files differ" in x]
    assert sorted(x.split(":")[1].strip() for x in refusals) == ["rank 0", "rank 1"]
    assert all("rank 1 (" in x and "copy the same model directory" in x for x in refusals)
    assert "greedy probe" not in proc.stdout


def test_a_copy_with_new_mtimes_under_another_name_joins(models, tmp_path):
    copy = tmp_path / "Llama-copied-with-scp"  # as `scp -r` leaves it: new mtimes, its own name
    shutil.copytree(models["llama"], copy, copy_function=shutil.copyfile)
    for path in copy.iterdir():
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    proc = join([models["llama"], copy], 2)
    assert proc.returncode == 0 and not exit_codes(proc), proc.stderr
    assert "greedy probe" in proc.stdout


def test_a_rank_with_other_versions_is_named_with_them_on_every_rank(models):
    proc = join([models["llama"]], 2, wrap=on_rank(1, MLX_KVSERVE_FAULTS="join_other_versions"))
    assert 2 in exit_codes(proc).values(), proc.stderr
    refusals = [x for x in proc.stderr.splitlines() if "install the same mlx-kvserve" in x]
    assert sorted(x.split(":")[1].strip() for x in refusals) == ["rank 0", "rank 1"]
    mlx_kvserve, mlx = versions()["mlx-kvserve"], versions()["mlx"]
    for line in refusals:
        assert "rank 1 (" in line and f"runs mlx-kvserve {mlx_kvserve}+other against " in line
        assert f"mlx {mlx}+other against {mlx}" in line and "on rank 0 (" in line
    assert "greedy probe" not in proc.stdout


def test_heads_the_world_size_does_not_divide_are_refused_on_every_rank(models):
    proc = join([models["llama"]], 3)
    assert 2 in exit_codes(proc).values(), proc.stderr
    refusals = [x for x in proc.stderr.splitlines() if "do not divide its 4 attention" in x]
    assert sorted(x.split(":")[1].strip() for x in refusals) == ["rank 0", "rank 1", "rank 2"]

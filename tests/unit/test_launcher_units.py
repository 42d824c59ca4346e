"""`serve --hostfile`'s own logic: the options the ranks get, the job's exit code from its ranks',
and the warning when a job's ring leaves the private ranges."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.distributed.launcher import job_exit_code, serve_argv, warn_public_ring


def test_the_ranks_get_every_option_but_the_hostfile():
    argv = [
        "--model",
        "m",
        "--hostfile",
        "h.json",
        "--port",
        "9",
        "--hostfile=x.json",
        "--no-cache",
    ]
    assert serve_argv(argv) == ["--model", "m", "--port", "9", "--no-cache"]


@given(st.dictionaries(st.integers(0, 7), st.sampled_from([0, 1, 2, 75, -9, -15]), max_size=8))
def test_the_job_exits_with_its_ranks_status(codes):
    code = job_exit_code(codes, 0)
    failed = {r: c for r, c in codes.items() if c}
    if not failed:
        assert code == 0
    elif 75 in failed.values():
        assert code == 75  # a lost peer: the service manager restarts the job
    else:
        first = failed[min(failed)]
        assert code == (128 - first if first < 0 else first) and code != 0


def test_a_launcher_that_failed_itself_is_a_failure():
    assert job_exit_code({}, 1) == 1 and job_exit_code({}, -15) == 0


@pytest.mark.parametrize(
    ("ring", "warned"),
    [
        ([["10.0.0.1:5000"], ["10.0.0.2:5001"]], []),
        ([["127.0.0.1:5000"], ["169.254.3.4:5001"]], []),
        ([["192.168.1.2:5000"], ["8.8.8.8:5001"]], ["8.8.8.8"]),
    ],
)
def test_a_ring_outside_the_private_ranges_is_warned_about(
    tmp_path, monkeypatch, caplog, ring, warned
):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(ring))
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve"):
        warn_public_ring()
    found = [r.getMessage().split(" over ")[1].split(",")[0] for r in caplog.records]
    assert found == warned

"""Hostfiles and sharding plans for jobs across machines, refused before anything starts, and the
`mlx-kvserve cluster check` command that says so (issue 21's bad input)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_model

from mlx_kvserve.distributed.hostfile import HostfileError, parse_hostfile, read_hostfile
from mlx_kvserve.distributed.sharding import ShardingError, plan_sharding
from tests.support.tiny_models import make_model_dir, model_config

TWO_MACS = {
    "backend": "ring",
    "hosts": [
        {"ssh": "mac-a.local", "ips": ["169.254.10.1"]},
        {"ssh": "mac-b.local", "ips": ["169.254.10.2"]},
    ],
}


def write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_a_hostfile_in_mlx_launch_format_is_read(tmp_path):
    job = read_hostfile(write(tmp_path, TWO_MACS))
    assert job.world_size == 2 and job.backend == "ring"
    assert [h.ssh for h in job.hosts] == ["mac-a.local", "mac-b.local"]
    assert job.public_addresses() == []  # link-local: a Thunderbolt bridge
    # mlx.launch also takes a bare list of hosts
    assert read_hostfile(write(tmp_path, TWO_MACS["hosts"])).world_size == 2


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ("{not json", "not JSON"),
        ({"hosts": []}, "'hosts' must be a non-empty list"),
        ({"hostz": []}, "unknown key(s) ['hostz']"),
        ({"hosts": [{"ips": ["10.0.0.1"]}]}, "host 0 has no 'ssh' name"),
        (
            {"hosts": [TWO_MACS["hosts"][0], {"ssh": "mac-b", "ips": ["10.0.0.300"]}]},
            "host 1 ('mac-b'): '10.0.0.300' is not an IP address",
        ),
        (
            {"hosts": [TWO_MACS["hosts"][0], {"ssh": "mac-b"}]},
            "host 1 ('mac-b'): the ring backend needs the address",
        ),
        (
            {"backend": "jaccl", "hosts": [{"ssh": "a", "rdma": [None]}, {"ssh": "b"}]},
            "host 0 ('a'): JACCL needs 2 'rdma' entries",
        ),
        ({"backend": "tcp", "hosts": TWO_MACS["hosts"]}, "backend 'tcp' is not one of"),
        ({"envs": "X=1", "hosts": TWO_MACS["hosts"]}, "'envs' must be a list"),
    ],
)
def test_a_bad_hostfile_is_refused_naming_the_host_and_cause(tmp_path, doc, expected):
    path = write(tmp_path, doc)
    with pytest.raises(HostfileError) as info:
        read_hostfile(path)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_a_jaccl_ring_hostfile_as_mlx_distributed_config_writes_it_is_read(tmp_path):
    hosts = [
        {"ssh": "mac-a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
        {"ssh": "mac-b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]},
    ]
    job = read_hostfile(write(tmp_path, {"backend": "jaccl-ring", "hosts": hosts, "envs": []}))
    assert job.backend == "jaccl-ring" and job.world_size == 2


def test_a_missing_hostfile_is_refused(tmp_path):
    with pytest.raises(HostfileError, match="cannot read it"):
        read_hostfile(tmp_path / "nowhere.json")


def test_addresses_outside_private_ranges_are_reported(tmp_path):
    doc = {"hosts": [{"ssh": "a", "ips": ["192.168.1.2"]}, {"ssh": "b", "ips": ["8.8.8.8"]}]}
    job = read_hostfile(write(tmp_path, doc))
    assert [(h.ssh, ip) for h, ip in job.public_addresses()] == [("b", "8.8.8.8")]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
HOSTISH = st.fixed_dictionaries(
    {
        "hosts": st.lists(
            st.dictionaries(st.sampled_from(["ssh", "ips", "rdma", "x"]), JSON), max_size=3
        )
    },
    optional={"backend": JSON, "envs": JSON},
)


@settings(max_examples=300, deadline=None)
@given(JSON | HOSTISH)
def test_any_document_is_a_hostfile_or_a_clear_refusal(doc):
    try:
        job = parse_hostfile(doc, Path("hosts.json"))
    except HostfileError as exc:
        assert str(exc).startswith("hostfile hosts.json")
    else:
        assert job.world_size >= 1 and all(h.ssh.strip() for h in job.hosts)
        job.public_addresses()  # every address parses


@pytest.fixture(scope="module")
def lazy_model(tmp_path_factory):
    def build(arch: str):
        model_dir = make_model_dir(tmp_path_factory.mktemp(arch), arch)
        model, _ = load_model(model_dir, lazy=True, strict=False)
        return model, model_config(arch), model_dir

    return build


def test_the_best_split_each_model_supports(lazy_model):
    llama, config, _ = lazy_model("llama")  # 4 heads, 2 KV heads; tensor parallel only
    assert plan_sharding(llama, config, 2).mode == "tensor"
    nxt, config, _ = lazy_model("qwen3_next")  # pipeline only
    assert plan_sharding(nxt, config, 2).mode == "pipeline"
    both, config, _ = lazy_model("qwen3_5")
    assert plan_sharding(both, config, 2).mode == "tensor"
    assert plan_sharding(both, config, 2, "pipeline").mode == "pipeline"


def test_splits_a_model_cannot_make_are_refused(lazy_model):
    llama, config, _ = lazy_model("llama")
    with pytest.raises(ShardingError, match="3 ranks do not divide its 4 attention heads"):
        plan_sharding(llama, config, 3)
    with pytest.raises(ShardingError, match="does not support --shard pipeline"):
        plan_sharding(llama, config, 2, "pipeline")
    both, config, _ = lazy_model("qwen3_5")
    with pytest.raises(
        ShardingError, match=r"4 ranks do not divide its 2 KV heads .*\(try --shard pipeline\)"
    ):
        plan_sharding(both, config, 4)
    with pytest.raises(ShardingError, match="4 layers cannot give each of 8 ranks one"):
        plan_sharding(both, config, 8, "pipeline")
    mamba, config, _ = lazy_model("mamba2")
    with pytest.raises(ShardingError, match="supports neither tensor nor pipeline"):
        plan_sharding(mamba, config, 2)
    assert plan_sharding(mamba, config, 1).world_size == 1  # one rank needs no split


def cluster_check(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlx_kvserve", "cluster", "check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cluster_check_command(tmp_path, lazy_model):
    _, _, llama_dir = lazy_model("llama")
    good = cluster_check("--hostfile", str(write(tmp_path, TWO_MACS)), "--model", str(llama_dir))
    assert good.returncode == 0, good.stderr
    assert "2 rank(s), backend ring" in good.stdout and "tensor parallel across 2" in good.stdout
    three = {"hosts": [*TWO_MACS["hosts"], {"ssh": "mac-c", "ips": ["8.8.4.4"]}]}
    bad = cluster_check("--hostfile", str(write(tmp_path, three)), "--model", str(llama_dir))
    assert bad.returncode == 2
    assert "3 ranks do not divide its 4 attention heads" in bad.stderr
    assert "rank 2 (mac-c) listens on 8.8.4.4, outside the private ranges" in bad.stderr
    broken = cluster_check("--hostfile", str(write(tmp_path, "[{]")))
    assert broken.returncode == 2 and "not JSON" in broken.stderr
    assert "Traceback" not in good.stderr + bad.stderr + broken.stderr

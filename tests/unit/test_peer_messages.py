"""What a rank reads from its peers (distributed/collective.py): a length header, a gather's
sizes and the JSON itself are checked before anything is allocated or believed, and a peer that
sends what no rank would ends the job with one clear line. The same against real ranks:
tests/cluster/test_collective.py (a hostile peer)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_kvserve.distributed.collective import (
    HEADER,
    MAX_MESSAGE,
    Collective,
    PeerMessageError,
    read_json,
    read_length,
    read_sizes,
)


def header(n: int) -> bytes:
    return n.to_bytes(HEADER, "little")


def test_a_length_within_the_cap_is_read():
    assert read_length(header(0)) == 0
    assert read_length(header(1234)) == 1234
    assert read_length(header(MAX_MESSAGE)) == MAX_MESSAGE


@pytest.mark.parametrize("n", [MAX_MESSAGE + 1, 1 << 40, (1 << 64) - 1])
def test_a_length_past_the_cap_is_refused(n):
    with pytest.raises(PeerMessageError, match=f"a message of {n} bytes announced"):
        read_length(header(n))


@given(st.binary(min_size=HEADER, max_size=HEADER))
def test_any_header_is_a_length_within_the_cap_or_a_refusal(raw):
    try:
        assert 0 <= read_length(raw) <= MAX_MESSAGE
    except PeerMessageError:
        assert int.from_bytes(raw, "little") > MAX_MESSAGE


def test_a_cut_header_is_refused():
    with pytest.raises(PeerMessageError, match="a length header of 3 bytes"):
        read_length(b"\x01\x02\x03")


@pytest.mark.parametrize(
    "sizes", [[-1, 5], [5, -(2**31)], [MAX_MESSAGE, 1], [2**31 - 1] * 3, [MAX_MESSAGE + 1]]
)
def test_gather_sizes_out_of_bounds_are_refused(sizes):
    with pytest.raises(PeerMessageError, match="gather sizes"):
        read_sizes(sizes)


def test_gather_sizes_within_bounds_are_read():
    assert read_sizes([0, 10, 20]) == [0, 10, 20]
    assert read_sizes([MAX_MESSAGE // 2, MAX_MESSAGE // 2]) == [MAX_MESSAGE // 2] * 2


@pytest.mark.parametrize(
    "data", [b"\xff\xfe", b'{"cancel": [', b"", b"[" * 100_000 + b"]" * 100_000, b"nul"]
)
def test_bytes_that_are_not_json_are_refused(data):
    with pytest.raises(PeerMessageError, match="a message that is not JSON"):
        read_json(data)


def test_a_hostile_message_ends_the_job_with_one_line():
    ended: list[str] = []
    collective = Collective(mx.distributed.init(), on_lost=ended.append)
    with pytest.raises(PeerMessageError):
        collective._checked(read_length, header(1 << 40), "the engine's turn")
    assert ended == [
        f"rank 0: a peer sent a message of {1 << 40} bytes announced (at most {MAX_MESSAGE}) "
        "during the engine's turn; ending the job"
    ]

"""Ollama's bodies onto the internal request, in process: `options` (types checked as Ollama's
`Options.FromMap` checks them, unknown names ignored), `keep_alive` durations, `think`, and tool
history whose calls and results carry no ids."""

from __future__ import annotations

import math

import pytest

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.ollama_request import chat_request, thinking
from mlx_kvserve.api.ollama_schemas import ChatBody, Options, keep_alive_seconds
from mlx_kvserve.api.schemas import parse


def test_options_apply_ollamas_defaults_and_names() -> None:
    default = Options(None)
    assert (default.temperature, default.top_k, default.top_p) == (0.8, 40, 0.9)
    assert default.num_predict is None and default.seed is None and default.stop == ()
    given = Options({"temperature": 0, "top_k": 1.0, "num_predict": 5, "seed": 3, "stop": "x"})
    assert (given.temperature, given.top_k, given.num_predict, given.seed) == (0.0, 1, 5, 3)
    assert given.stop == ("x",)
    assert Options({"num_predict": -1}).num_predict is None  # Ollama's "no limit"
    assert Options({"num_predict": -2, "seed": -1}).seed is None
    # Go reads every JSON number as a float64 and FromMap converts it with int64(t): cut
    cut = Options({"top_k": 1.9, "num_predict": 5.99, "seed": -1.5, "num_ctx": 2048.7})
    assert (cut.top_k, cut.num_predict, cut.seed, cut.num_ctx) == (1, 5, None, 2048)
    assert Options({"seed": 7.5}).seed == 7
    ignored = Options({"mirostat": 2, "penalize_newline": True, "min_p": 0.1, "num_gpu": 99})
    assert ignored.temperature == 0.8


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": "1"}, "top_k"),
        ({"num_predict": 1e300}, "num_predict"),
        ({"num_ctx": True}, "num_ctx"),
        ({"use_mmap": 1}, "use_mmap"),
        ({"stop": [1, 2]}, "stop"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ["s"] * 17}, "stop"),
    ],
)
def test_options_of_the_wrong_type_are_400s_naming_them(options: dict, named: str) -> None:
    with pytest.raises(APIError) as refused:
        Options(options)
    assert refused.value.status == 400 and named in refused.value.message


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        (30, 30.0),
        (2.5, 2.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("-1", math.inf),
        (-1, math.inf),
        ("-5m", math.inf),
    ],
)
def test_keep_alive_durations(given, seconds) -> None:
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "", "1e400", True, [1], {"m": 5}, 1e400])
def test_keep_alive_that_is_no_duration_is_a_400(given) -> None:
    with pytest.raises(APIError) as refused:
        keep_alive_seconds(given)
    assert refused.value.status == 400 and "keep_alive" in refused.value.message


def test_think_onto_the_reasoning_switch() -> None:
    assert thinking(None, True, "m").enabled is True  # Ollama turns it on when absent
    assert thinking(None, False, "m").enabled is None  # the template's own default
    assert thinking(False, False, "m").enabled is False
    level = thinking("max", True, "m")
    assert level.enabled is True and level.effort == "max"
    for think in (True, "low"):
        with pytest.raises(APIError) as refused:
            thinking(think, False, "tiny")
        assert refused.value.message == '"tiny" does not support thinking'


def test_tool_results_are_matched_to_calls_without_ids() -> None:
    body = parse(
        ChatBody,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather and time?"},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "two calls",
                    "tool_calls": [
                        {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                        {"id": "t1", "function": {"name": "time", "arguments": '{"tz": "CET"}'}},
                    ],
                },
                {"role": "tool", "tool_name": "time", "content": "12:00"},
                {"role": "TOOL", "content": "sunny"},
            ],
        },
    )
    chat = chat_request(body, Options(None), thinks=False)
    assistant, time_result, weather_result = chat.messages[1:]
    weather, clock = assistant.tool_calls
    assert weather.arguments == '{"city": "Paris"}' and weather.id == "call_1_0"
    assert clock.id == "t1" and clock.arguments == '{"tz": "CET"}'
    assert assistant.reasoning == "two calls"
    assert (time_result.tool_call_id, weather_result.tool_call_id) == ("t1", "call_1_0")
    orphan = parse(ChatBody, {"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(APIError) as refused:
        chat_request(orphan, Options(None), thinks=False)
    assert refused.value.status == 400 and "no earlier assistant message" in refused.value.message

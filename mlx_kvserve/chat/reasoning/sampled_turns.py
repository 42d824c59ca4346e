"""The tokens the model sampled for each tool-calling turn, spliced back when history replays it.

A tool loop only hits the prompt cache when the next prompt re-renders the previous answer as
the very tokens the model sampled. A chat template re-renders an answer from its parts, and
loses what the model wrote around them: whitespace it trims (`reasoning_content|trim`), an empty
`<think></think>` it adds to a turn that had none, tokens the model split unlike the tokenizer
(a grammar-forced `p` + `ing` where the tokenizer writes `ping`), arguments a client re-serialised.
So the server keeps, per turn that made tool calls, the sampled token ids, keyed by the turn's
call ids (as antirez/ds4 keeps the sampled text per call id), and when a later history holds
that turn unchanged it renders the sampled tokens in place of the template's rendering of it.

What keeps this safe:
* only tokens this server sampled are ever spliced; a client chooses, by call id, at most which
  of them, and only for a turn it replays unchanged: same call ids, names and parsed arguments,
  the same answer text and reasoning (or none), and a template rendering of the turn that shows
  that reasoning and text (a template that drops past reasoning is left to drop it);
* the prompt the turn was generated from must be the new render's prefix (a SHA-256 of its text),
  so a turn is spliced only into the conversation it came from;
* bounded: at most MAX_TURNS turns and MAX_TOKENS token ids, least recently used first out; a
  turn is kept for one model (the store lives in one server, and checks the model's name too).
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mlx_kvserve.chat.request import Message, ToolCall
from mlx_kvserve.json_value import JSON

MAX_TURNS = 2048
MAX_TOKENS = 4_000_000  # token ids kept across all turns (4 bytes each)
MAX_TURN_TOKENS = 65_536  # a longer answer is not kept
PROBE = "\x00sampled-turn-probe\x00"


def text_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _arguments(call: ToolCall) -> JSON:
    """A call's arguments as compared: parsed JSON for a function, the raw input for a custom
    tool (None when a function's arguments do not parse: such a call never matches)."""
    if call.kind == "custom":
        return call.arguments
    try:
        return json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return None


@dataclass
class SampledTurn:
    """One answer with tool calls, as sampled."""

    model: str
    prompt_len: int  # characters of the rendered prompt text it answered
    prompt_hash: bytes  # SHA-256 of that text
    tokens: array  # the sampled token ids, the end-of-sequence token excluded
    content: str
    reasoning: str
    calls: tuple[tuple[str, str, str, JSON], ...]  # (id, name, kind, arguments)
    canonical: str | None = None  # the template's text of this turn, learnt on first reuse

    def matches(self, message: Message, model: str) -> bool:
        """The message replays this turn unchanged."""
        if model != self.model or len(message.tool_calls) != len(self.calls):
            return False
        for call, (call_id, name, kind, arguments) in zip(
            message.tool_calls, self.calls, strict=True
        ):
            if (call.id, call.name, call.kind) != (call_id, name, kind):
                return False
            if _arguments(call) != arguments:
                return False
        if message.content.strip() != self.content.strip():
            return False
        return message.reasoning is None or message.reasoning.strip() == self.reasoning.strip()

    def template_arguments(self) -> list[dict[str, JSON]]:
        """Each call's arguments as the template is handed them (chat.render), keys in the
        order the model sampled them."""
        return [
            {"input": arguments} if kind == "custom" else arguments
            for _, _, kind, arguments in self.calls
        ]

    def shows(self, canonical: str) -> bool:
        """The template's text of the turn says what the sampled one says (it did not drop the
        reasoning or the answer)."""
        parts = [self.reasoning.strip(), self.content.strip(), *(c[1] for c in self.calls)]
        return all(part in canonical for part in parts if part)


class SampledTurns:
    """A bounded, thread-safe map from call id to the turn that made the call."""

    def __init__(self, max_turns: int = MAX_TURNS, max_tokens: int = MAX_TOKENS) -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self._turns: OrderedDict[str, SampledTurn] = OrderedDict()  # by first call id
        self._by_call: dict[str, str] = {}
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def remember(
        self,
        model: str,
        prompt_text: tuple[int, bytes],
        tokens: list[int],
        content: str,
        reasoning: str,
        calls: list[ToolCall],
    ) -> None:
        """Keep a finished turn (`prompt_text`: the length and hash of the prompt's text)."""
        if not calls or not tokens or len(tokens) > MAX_TURN_TOKENS:
            return
        described = tuple((c.id, c.name, c.kind, _arguments(c)) for c in calls)
        if any(c[3] is None for c in described):
            return
        turn = SampledTurn(
            model, prompt_text[0], prompt_text[1], array("i", tokens), content, reasoning, described
        )
        with self._lock:
            key = calls[0].id
            if key in self._turns:
                return
            self._turns[key] = turn
            self._by_call.update((c.id, key) for c in calls)
            self._tokens += len(turn.tokens)
            while len(self._turns) > self.max_turns or self._tokens > self.max_tokens:
                _, old = self._turns.popitem(last=False)
                self._tokens -= len(old.tokens)
                for call in old.calls:
                    self._by_call.pop(call[0], None)

    def match(self, message: Message, model: str) -> SampledTurn | None:
        """The kept turn this assistant message replays unchanged, if any."""
        if not message.tool_calls:
            return None
        with self._lock:
            key = self._by_call.get(message.tool_calls[0].id)
            turn = self._turns.get(key) if key is not None else None
            if turn is not None:
                self._turns.move_to_end(key)  # type: ignore[arg-type]
        return turn if turn is not None and turn.matches(message, model) else None


class Splicer:
    """Encodes one conversation's renders with its kept turns' sampled tokens spliced in.

    `render(n, generation)` renders the first n message dicts; `turns` pairs the index of each
    assistant message dict with its kept turn (in order)."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        render: Callable[[int, bool], str],
        probe: Callable[[], str | None],
        turns: list[tuple[int, SampledTurn]],
    ) -> None:
        self.encode = encode
        self.render = render
        self.probe = probe
        self.turns = turns
        self._end: str | None = None
        self.spliced = 0  # turns spliced into the last text encoded

    def tokens(self, text: str) -> list[int]:
        out: list[int] = []
        cursor = hashed = 0
        rolling = hashlib.sha256()
        self.spliced = 0
        if self._end is None:
            self._end = self.probe()
        for index, turn in self.turns:
            start = turn.prompt_len
            if start < cursor or start >= len(text):
                continue
            rolling.update(text[hashed:start].encode("utf-8"))
            hashed = start
            if rolling.copy().digest() != turn.prompt_hash:
                continue
            canonical = turn.canonical or self._learn(index, turn, text)
            if canonical is None or not text.startswith(canonical, start):
                continue
            if not text.startswith(self._end or "", start + len(canonical)):
                continue
            out += self.encode(text[cursor:start])
            out += turn.tokens.tolist()
            cursor = start + len(canonical)
            self.spliced += 1
        return out + self.encode(text[cursor:])

    def _learn(self, index: int, turn: SampledTurn, text: str) -> str | None:
        """The template's text of the turn after its prompt, up to the turn's closing tokens
        (Qwen's `<|im_end|>`); for a template that closes a turn with nothing (GLM), what a
        render ending with this turn adds to its prompt."""
        if self._end is None:
            self._end = self.probe()
            if self._end is None:
                return None
        start = turn.prompt_len
        if self._end:
            stop = text.find(self._end, start)
            if stop < 0:
                return None
            canonical = text[start:stop]
        else:
            try:
                upto = self.render(index + 1, False)
            except Exception:  # a template may refuse a partial conversation
                return None
            if not text.startswith(upto) or len(upto) <= start:
                return None
            canonical = upto[start:]
        if not canonical or not turn.shows(canonical):
            return None
        turn.canonical = canonical
        return canonical


def turn_end(render: Callable[[list[dict[str, JSON]]], str]) -> str | None:
    """What the template writes after an assistant turn's text (Qwen's `<|im_end|>\\n`, nothing
    for GLM), found by rendering a probe answer."""
    try:
        text = render([{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}])
    except Exception:
        return None
    at = text.rfind(PROBE)
    return None if at < 0 else text[at + len(PROBE) :]

"""Grammar-constrained decoding with llguidance: forced tool calls and JSON output.

Why llguidance: a maintained Rust core that compiles JSON Schema and Lark grammars (with lazy
grammars that start at a trigger string, which is what `tool_choice: auto` needs), computes a
token bitmask over the whole vocabulary in well under a millisecond, and needs only NumPy (no
torch). A grammar is compiled per request on a worker thread; the engine thread then asks the
`Constraint` for the allowed tokens before each sample and tells it the token it picked.

What each request gets:
* `tool_choice` "required" or a named function: the whole answer is one call (up to
  MAX_PARALLEL_CALLS when parallel calls are allowed) whose arguments follow the function's
  JSON Schema;
* "auto": free text, until the model writes the call's opening tag; from there the call is
  constrained the same way (a lazy grammar);
* `response_format` json_object / json_schema: the answer is that JSON (or, with tools in
  "auto", either that JSON or tool calls);
* a custom (freeform) tool's call, in the Hermes fallback: its raw input follows the tool's own
  Lark grammar or regex (nested as `%lark { ... }`), or is any text up to the closing tag.
JSON is written in one canonical form (`", "` and `": "` separators, no free whitespace), the
form the Hermes fallback renders history in, so the cache keeps a tool loop's turns.
"""

from __future__ import annotations

import copy
import json
import threading
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from mlx_kvserve.chat.call_syntax import CallFormat
from mlx_kvserve.chat.freeform import freeform_head
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import CUSTOM_PARAMETERS, ChatRequest, InputGrammar, Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import vocabulary_size

if TYPE_CHECKING:  # imported where used: the package loads without it until a grammar is needed
    from llguidance import LLMatcher, LLTokenizer

MAX_PARALLEL_CALLS = 4
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Tool schemas guide a call, and agents send keywords the library does not implement (Claude
# Code's `propertyNames`, for one); as on OpenAI's non-strict tools, those keywords are ignored
# rather than refusing the request. A response_format schema stays strict: there the client
# asked for exactly that schema.
TOOL_STYLE = {**JSON_STYLE, "lenient": True}


class Constraint:
    """One request's grammar state, used on the engine thread only."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, *, lazy: bool = False) -> None:
        """`vocab_size`: the ids llguidance's tokenizer knows (`LLTokenizer.vocab_size`), which
        its mask covers exactly; the model's logits may be wider (a padded embedding)."""
        import llguidance.numpy as lln

        # Free text until a trigger (tool_choice "auto"): the engine keeps such a request
        # pipelined while the mask stays the free-text one (engine/decode.py).
        self.lazy = lazy
        self.grammar: str | None = None  # its Lark text, which another rank compiles alike
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = lln.allocate_token_bitmask(1, vocab_size)
        self._fill = lln.fill_next_token_bitmask

    def allowed(self, n_logits: int) -> np.ndarray:
        """A boolean mask over the model's logits: True where the grammar allows the token.
        Logits past the tokenizer's ids (the rows a checkpoint pads its embedding with) are
        never allowed: no token has them."""
        self._fill(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
        known = min(self._vocab_size, n_logits)
        mask = np.zeros(n_logits, dtype=bool)
        mask[:known] = bits[:known]
        return mask

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """The tokens that must come next whatever the model prefers (consumed here)."""
        tokens = self._matcher.compute_ff_tokens()[:limit]
        # the library may tokenize forced multi-byte text otherwise than its grammar reads it
        # (a name in a rare script): keep what it accepts, sampling under the mask does the rest
        tokens = tokens[: self._matcher.validate_tokens(tokens)] if tokens else tokens
        if tokens and not self._matcher.consume_tokens(tokens):
            raise RuntimeError(
                f"grammar rejected its own forced tokens: {self._matcher.get_error()}"
            )
        return tokens

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self._matcher.is_stopped()

    def fork(self) -> Constraint:
        """A copy in this state (llguidance's `deep_copy`) that speculation walks a draft
        through (engine/decode.py `Decoder.walk`); the bitmask is scratch space, shared."""
        twin = copy.copy(self)
        twin._matcher = self._matcher.deep_copy()
        return twin


class GrammarCompiler:
    """Compiles requests' grammars against one tokenizer (its llguidance twin is built once)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._lltok: LLTokenizer | None = None

    def _llg_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._lltok is None:
                import llguidance.hf
                from mlx_lm.tokenizer_utils import TokenizerWrapper

                wrapped = isinstance(self._tokenizer, TokenizerWrapper)
                hf = self._tokenizer._tokenizer if wrapped else self._tokenizer
                ids = getattr(self._tokenizer, "eos_token_ids", None)
                # a config may list an end id past the tokenizer (a padded row), which
                # llguidance refuses; the sampler never draws such a row anyway
                size = vocabulary_size(self._tokenizer)
                known = isinstance(ids, set | list | tuple)
                eos = sorted(i for i in ids if size is None or i < size) if known else []
                self._lltok = llguidance.hf.from_tokenizer(hf, eos_token=eos or None)
            return self._lltok

    def token_bytes(self, token: int) -> bytes:
        """The exact bytes of one token (for logprobs' `bytes`)."""
        return self._llg_tokenizer().decode_bytes([token])

    def constraint_for(self, req: ChatRequest, fmt: CallFormat | None) -> Constraint | None:
        """The request's constraint, or None when decoding is free. 400 on a bad schema."""
        grammar = self.grammar_for(req, fmt)
        if grammar is None:
            return None
        constraint = self._compile(grammar, "the request's grammar")
        constraint.lazy = req.tool_choice.mode not in {"required", "function"}
        constraint.lazy &= _output_schema(req) is None
        return constraint

    def json_constraint(self, schema: dict[str, JSON], param: str) -> Constraint:
        return self._compile(_json_grammar(schema, param=param), param)

    def grammar_for(self, req: ChatRequest, fmt: CallFormat | None) -> str | None:
        """The Lark grammar text for a request (None: unconstrained)."""
        output = _output_schema(req)
        calls = None
        if req.tools_active and fmt is not None and fmt.constrained:
            self._check_tools(req.tools)
            calls = _calls_rule(req, fmt, self._marker)
        mode = req.tool_choice.mode
        if output is not None:
            self._compile(_json_grammar(output, param=_output_param(req)), _output_param(req))
        answer = fmt.answer_rules if fmt is not None else None  # gpt-oss's: its own layout
        if answer is not None and (calls is not None or output is not None):
            rules = answer(
                req, self._marker, self._tokens, _parameters, TOOL_STYLE, output, JSON_STYLE
            )
            return _lark(*rules)
        if calls is None:
            return None if output is None else _json_grammar(output)
        assert fmt is not None
        opening = self._marker(fmt.start)
        syntax = fmt.syntax
        most = MAX_PARALLEL_CALLS if req.tool_choice.parallel else 1
        most = min(most, getattr(syntax, "most_calls", most))
        between = json.dumps(getattr(syntax, "between", "\n"))  # what separates two blocks
        more = f" ({between} call){{0,{most - 1}}}" if most > 1 else ""
        lead = f"{json.dumps(syntax.lead)} " if syntax and syntax.lead else ""
        if syntax is not None and syntax.calls_per_block:
            more = ""  # one block holds every call (its call_body allows up to `most`)
        forced = f"calls: {lead}call{more}\ncall: {opening} call_body"
        if mode in {"required", "function"}:
            return _lark("start: calls", forced, calls)
        if output is not None:
            answer = f"answer: %json {json.dumps({**output, 'x-guidance': JSON_STYLE})}"
            return _lark("start: answer | calls", answer, forced, calls)
        if fmt.at_start:  # a call is the whole answer; other answers do not begin with `{`
            return _lark("start: PLAIN | calls", forced, r"PLAIN: /(\s*[^{\s](.|\n)*)?/", calls)
        if opening.startswith("<["):  # a token: text cannot hold it, so it ends the text
            seg = f"seg: TEXT {opening} call_body"
        else:
            seg = f"seg: trig call_body\ntrig[lazy]: TEXT {opening}"
        head = "start: (seg)* TEXT" if most > 1 else "start: TEXT | seg"
        return _lark(head, seg, "TEXT: /(.|\\n)*/", calls)

    def _marker(self, text: str) -> str:
        """A format marker as a Lark item: the marker's own token where the tokenizer has one
        (Qwen's `<tool_call>`, which llguidance keeps apart from text as a special token), else
        the literal text."""
        lltok = self._llg_tokenizer()
        ids = lltok.tokenize_str(text)
        if len(ids) == 1 and lltok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        if any(lltok.is_special_token(i) for i in ids):  # tags and text (Kimi K3's XTML)
            return self._tokens(text)
        return json.dumps(text)

    def _tokens(self, text: str) -> str:
        """Fixed text as the tokens the tokenizer makes of it (Lark items): the model cannot
        spell it another way, so it re-tokenizes as sampled."""
        ids = self._llg_tokenizer().tokenize_str(text)
        return " ".join(f"<[{i}]>" for i in ids) or '""'

    def _check_tools(self, tools: list[Tool]) -> None:
        for i, tool in enumerate(tools):
            _check_name(tool, i)
            if tool.is_custom:
                if tool.grammar is not None:
                    grammar = _lark(f"start: {_nested(tool.grammar)}")
                    self._compile(grammar, f"tools[{i}].format.definition")
                continue
            param = f"tools[{i}].function.parameters"
            self._compile(_json_grammar(_parameters(tool), TOOL_STYLE, param=param), param)

    def _compile(self, grammar: str, param: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"Invalid schema for '{param}': the constrained-decoding library cannot compile "
                f"it: {matcher.get_error().strip()}",
                param=param,
                code="invalid_schema",
            )
        constraint = Constraint(matcher, self._llg_tokenizer().vocab_size)
        constraint.grammar = grammar
        return constraint

    def constraint_from(self, grammar: str, *, lazy: bool) -> Constraint:
        """A constraint another rank of a job compiled from `grammar` (already checked)."""
        constraint = self._compile(grammar, "the request's grammar")
        constraint.lazy = lazy
        return constraint


_UNWRITABLE = {"Cc", "Cf", "Cs", "Co", "Cn"}  # control, format, surrogate, private, unassigned


def _check_name(tool: Tool, i: int) -> None:
    """A name the model is made to write must be text a tokenizer writes back as itself:
    controls, format marks, surrogates and private or unassigned code points are refused
    (OpenAI and Anthropic allow only letters, digits, `_` and `-` in tool names)."""
    bad = next((c for c in tool.name if unicodedata.category(c) in _UNWRITABLE), None)
    if bad is not None:
        param = f"tools[{i}].name" if tool.is_custom else f"tools[{i}].function.name"
        raise InvalidRequest(
            f"Invalid value for '{param}': tool names cannot hold the character "
            f"U+{ord(bad):04X}; use letters, digits, '_' or '-'.",
            param=param,
        )


def input_grammar_error(grammar: InputGrammar) -> str | None:
    """Why llguidance cannot compile a custom tool's grammar, or None (no tokenizer needed)."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(_lark(f"start: {_nested(grammar)}"))
    except (ValueError, RuntimeError, TypeError) as exc:
        return str(exc) or type(exc).__name__
    return error.strip() or None


def _nested(grammar: InputGrammar) -> str:
    """A custom tool's grammar as one nested Lark expression."""
    import llguidance

    if grammar.syntax == "regex":
        return f"%lark {{\nstart: /{llguidance.regex_to_lark(grammar.definition)}/\n}}"
    return f"%lark {{\n{grammar.definition}\n}}"


def _parameters(tool: Tool) -> dict[str, JSON]:
    params = CUSTOM_PARAMETERS if tool.is_custom else tool.parameters or {}
    return params if params.get("type") or params.get("properties") else {"type": "object"}


def _call_schema(tools: list[Tool]) -> dict[str, JSON]:
    """{"name": <one of the tools>, "arguments": <that tool's parameters>}, name first."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, JSON] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": TOOL_STYLE}


def _calls_rule(req: ChatRequest, fmt: CallFormat, marker: Callable[[str], str]) -> str:
    """Lark rule `call_body`: what follows a call's opening tag (JSON body, closing tag), or,
    for a custom tool in the Hermes fallback, its name line and raw input."""
    tools = req.tools
    if req.tool_choice.mode == "function":
        tools = [t for t in tools if t.name == req.tool_choice.name]
    if fmt.syntax is not None:
        most = MAX_PARALLEL_CALLS if req.tool_choice.parallel else 1
        return fmt.syntax.calls_rule(tools, _parameters, TOOL_STYLE, marker, fmt.end, most)
    if not fmt.json_body:
        return ""  # the format's answer_rules lay out its calls (gpt-oss's channels)
    end = marker(fmt.end)
    freeform = [t for t in tools if t.is_custom and not fmt.native]
    functions = [t for t in tools if t not in freeform]
    names: list[str] = []
    rules: list[str] = []
    if functions:
        body = json.dumps(_call_schema(functions))
        names.append("call_json")
        rules.append(f'call_json: "\\n" %json {body} "\\n" {end}')
    for k, tool in enumerate(freeform):
        head = json.dumps(f"\n{freeform_head(tool.name)}\n")
        closing = json.dumps("\n" + fmt.end)
        names.append(f"call_custom_{k}")
        if tool.grammar is None:  # any text, up to the first closing tag
            rules.append(f"call_custom_{k}: {head} custom_text_{k}")
            rules.append(f"custom_text_{k}[lazy]: /(.|\\n)*/ {closing}")
        else:
            rules.append(f"call_custom_{k}: {head} custom_input_{k} {closing}")
            rules.append(f"custom_input_{k}: {_nested(tool.grammar)}")
    return "\n".join([f"call_body: {' | '.join(names)}", *rules])


def _output_schema(req: ChatRequest) -> dict[str, JSON] | None:
    if req.output.kind == "json_object":
        return {"type": "object"}
    if req.output.kind == "json_schema":
        return req.output.schema or {"type": "object"}
    return None


def _output_param(req: ChatRequest) -> str:
    return (
        "response_format.json_schema.schema"
        if req.output.kind == "json_schema"
        else "response_format"
    )


def _json_grammar(
    schema: dict[str, JSON], style: dict[str, JSON] = JSON_STYLE, *, param: str = "schema"
) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=style)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer past 64 bits
        raise InvalidRequest(
            f"Invalid schema for '{param}': the constrained-decoding library cannot read it: {exc}",
            param=param,
            code="invalid_schema",
        ) from None


def _lark(*parts: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark("%llguidance {}\n" + "\n".join(parts) + "\n")

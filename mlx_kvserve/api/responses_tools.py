"""Responses tools as the model sees them, and the model's calls as the client expects them.

* `function` tools are offered as they are.
* `custom` (freeform) tools are offered with their input format (a Lark grammar, a regex, or free
  text); a grammar llguidance cannot compile is a 400 naming `tools[i].format.definition`.
* A `namespace` tool groups function and custom tools. Its members are offered under Codex's flat
  name `<namespace>__<name>` (the namespace's trailing and the name's leading underscores
  trimmed, as Codex's `ToolName::canonical_flat_name` does), a name every chat template and tool
  parser accepts; their calls come back as `function_call` / `custom_tool_call` items with
  `name` and `namespace` apart, as Codex parses them, and replayed items are mapped back.
* Built-in tools the server cannot run (`web_search`, `file_search`, ...) are accepted and not
  offered to the model; a `tool_choice` that forces one is a 400. Unknown types are a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.openai_responses_schemas import (
    CustomTool,
    FunctionTool,
    GrammarInputFormat,
    NamespaceTool,
    ResponsesRequest,
)
from mlx_kvserve.api.schemas import Body, _describe
from mlx_kvserve.chat import InputGrammar, Tool, ToolChoice
from mlx_kvserve.chat.grammar import input_grammar_error
from mlx_kvserve.json_value import JSON

BUILTIN_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use_preview",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
    }
)


def flat_name(namespace: str | None, name: str) -> str:
    """The name a namespaced tool is offered under (Codex's canonical flat name)."""
    if namespace is None:
        return name
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


@dataclass
class ToolSet:
    """The tools offered to the model, and where each flat name came from."""

    tools: list[Tool] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (ns, name)
    skipped: list[str] = field(default_factory=list)  # built-in types accepted, not offered

    def is_custom(self, flat: str) -> bool:
        return any(t.name == flat and t.is_custom for t in self.tools)

    def wire(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of a call to the tool offered as `flat`."""
        if flat in self.namespaces:
            return self.namespaces[flat]
        return None, flat

    def _add(self, tool: Tool, where: str) -> None:
        if any(t.name == tool.name for t in self.tools):
            raise APIError(
                400,
                f"{where}: a second tool named {tool.name!r}; tool names must be unique.",
                param=f"{where}.name",
            )
        self.tools.append(tool)


def parse_tools(body: ResponsesRequest) -> ToolSet:
    """Validate `tools` into the ones the model is offered (400 naming the offending field)."""
    tools = ToolSet()
    for i, raw in enumerate(body.tools or []):
        where = f"tools[{i}]"
        kind = raw.get("type")
        if kind in BUILTIN_TOOL_TYPES:
            tools.skipped.append(kind)
        elif kind == "namespace":
            group = _validate(NamespaceTool, raw, where)
            for j, member in enumerate(group.tools):
                inner = f"{where}.tools[{j}]"
                tool = _member(member, inner, flat_name(group.name, str(member.get("name", ""))))
                tools._add(tool, inner)
                tools.namespaces[tool.name] = (group.name, str(member["name"]))
        elif kind in {"function", "custom"}:
            tools._add(_member(raw, where, None), where)
        else:
            raise APIError(
                400,
                f"Invalid value for '{where}.type': tools of type {kind!r} are not supported by "
                "this server (function, custom and namespace tools are; built-in tools such as "
                "web_search are accepted and not offered to the model).",
                param=f"{where}.type",
                code="invalid_value",
            )
    return tools


def _member(raw: dict[str, JSON], where: str, flat: str | None) -> Tool:
    """One function or custom tool (at the top level or inside a namespace)."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "function":
        fn = _validate(FunctionTool, raw, where)
        return Tool(flat or fn.name, fn.description, fn.parameters or {"type": "object"})
    if kind == "custom":
        custom = _validate(CustomTool, raw, where)
        grammar = None
        if isinstance(custom.format, GrammarInputFormat):
            grammar = InputGrammar(custom.format.syntax, custom.format.definition)
            error = input_grammar_error(grammar)
            if error is not None:
                raise APIError(
                    400,
                    f"Invalid value for '{where}.format.definition': the constrained-decoding "
                    f"library cannot compile this {grammar.syntax} grammar: {error[:500]}",
                    param=f"{where}.format.definition",
                    code="invalid_grammar",
                )
        return Tool(flat or custom.name, custom.description, kind="custom", grammar=grammar)
    raise APIError(
        400,
        f"Invalid value for '{where}.type': a namespace holds function and custom tools "
        f"(got {kind!r}).",
        param=f"{where}.type",
        code="invalid_value",
    )


def tool_choice(body: ResponsesRequest, tools: ToolSet) -> ToolChoice:
    """The internal tool choice; forcing a tool that is not offered is a 400 naming it."""
    choice = body.tool_choice
    offered = tools.tools
    if choice is None or isinstance(choice, str):
        return ToolChoice.plain(choice, has_tools=bool(offered), parallel=body.parallel_tool_calls)
    kind = choice.get("type")
    if kind in BUILTIN_TOOL_TYPES:
        raise APIError(
            400,
            f"tool_choice forces the built-in tool {kind!r}, which this server cannot run.",
            param="tool_choice.type",
        )
    if kind not in {"function", "custom"}:
        raise APIError(
            400,
            f"Invalid value for 'tool_choice.type': {kind!r} is not supported by this server "
            "(none, auto, required, or a function or custom tool by name are).",
            param="tool_choice.type",
        )
    name, namespace = choice.get("name"), choice.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str | None):
        raise APIError(400, "tool_choice needs the tool's 'name'.", param="tool_choice.name")
    flat = _find(tools, name, namespace, custom=kind == "custom")
    if flat is None:
        raise APIError(
            400,
            f"tool_choice names the {kind} tool {name!r}, which is not among the tools.",
            param="tool_choice",
        )
    return ToolChoice("function", flat, parallel=False)


def _find(tools: ToolSet, name: str, namespace: str | None, *, custom: bool) -> str | None:
    """The flat name of the tool a choice names: exactly, by namespace and name, or by a name
    that only one namespace holds."""
    candidates = [t for t in tools.tools if t.is_custom == custom]
    if namespace is not None:
        wanted = flat_name(namespace, name)
        return next((t.name for t in candidates if t.name == wanted), None)
    exact = [t.name for t in candidates if t.name == name]
    if exact:
        return exact[0]
    bare = [t.name for t in candidates if tools.wire(t.name)[1] == name]
    return bare[0] if len(bare) == 1 else None


def _validate(model: type[Body], data: JSON, where: str) -> Body:
    if not isinstance(data, dict):
        raise APIError(400, f"Invalid value for '{where}': expected an object.", param=where)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _describe(exc)
        full = f"{where}.{param}" if param else where
        text = message.replace(f"'{param}'", f"'{full}'", 1) if param else f"{where}: {message}"
        raise APIError(400, text, param=full, code="invalid_value") from None

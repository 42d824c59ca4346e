"""The tool-format registry (chat.formats) without a server: the format each family's real
template gets through mlx-lm's own tokenizer loading, the same surface on every format module,
and the registry as the only path that picks a format."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mlx_kvserve.chat import formats
from mlx_kvserve.chat.formats import FORMATS, tool_format_for
from mlx_kvserve.chat.formats.tool_format import ToolFormat
from tests.support import thinking_models as tm

PACKAGE = Path(formats.__file__).parents[2]  # mlx_kvserve/
# family (tests/support/thinking_models.FAMILIES; "gpt-oss": tests/support/harmony_model) ->
# the format module that must pick it, and the tokens its real tokenizer has for its tags
FAMILIES = {
    "qwen3": ("json_tools", tm.TOOL_TOKENS),
    "qwen3.5": ("qwen3_coder", tm.TOOL_TOKENS),
    "deepseek-r1": ("hermes", ()),  # its template has no tool support
    "glm-4.6": ("glm47", tm.GLM_TOOL_TOKENS),
    "laguna": ("glm47", tm.GLM_TOOL_TOKENS),  # mlx-lm's `laguna` module is GLM's parser
    "minimax-m2": ("minimax_m2", tm.MINIMAX_TOOL_TOKENS),
    "kimi-k2": ("kimi_k2", tm.KIMI_TOOL_TOKENS),
    "kimi-k3": ("kimi_k3", tm.KIMI_K3_TOOL_TOKENS),  # found by its vocabulary, not its template
    "lfm2.5": ("pythonic", tm.LFM_TOOL_TOKENS),
    "gemma4": ("gemma4", tm.GEMMA4_TOOL_TOKENS),
    "function-gemma": ("function_gemma", tm.FUNCTION_GEMMA_TOOL_TOKENS),
    "longcat": ("longcat", tm.LONGCAT_TOOL_TOKENS),
    "minicpm5": ("minicpm5", ()),
    "muse-spark": ("muse_spark", ()),
    "mistral-v13": ("mistral", tm.MISTRAL_TOOL_TOKENS),
    "mistral-v11": ("mistral", tm.MISTRAL_TOOL_TOKENS),
    "mistral-v7": ("mistral", tm.MISTRAL_TOOL_TOKENS),
    "llama3": ("llama3_json", tm.LLAMA3_TOOL_TOKENS),
    "deepseek-v3.1": ("deepseek_v31", tm.DEEPSEEK_TOOL_TOKENS),
    "gpt-oss": ("harmony", ()),
}
MISTRAL_LAYOUTS = {"mistral-v13": "V13", "mistral-v11": "V11", "mistral-v7": "V7"}
CATCH_ALL = ("parsed_only", "hermes")  # they take any model with a parser, any model at all
SURFACE = ("detect", "syntax", "tool_call_start", "tool_call_end", "parse_tool_call")
HELPERS = {  # modules of chat/formats that formats share, not formats themselves
    "tool_format",
    "xml_calls",
    "keyword_calls",
    "named_json",
    "mistral_legacy",
    "harmony.channels",
    "harmony.history",
    "harmony.answer_grammar",
    "harmony.channel_reader",
    "harmony.analysis_gate",
}


def _name(module: object) -> str:
    return module.__name__.removeprefix("mlx_kvserve.chat.formats.")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(family: str, tmp_path_factory: pytest.TempPathFactory):
    """The family's tokenizer as mlx-lm loads it (its template picks mlx-lm's parser)."""
    from mlx_lm.tokenizer_utils import load

    from tests.support.harmony_model import build_harmony_model

    dest = tmp_path_factory.mktemp("registry") / family
    if family == "gpt-oss":
        return load(build_harmony_model(dest))
    return load(tm.build_thinking_model(dest, family, tool_tokens=FAMILIES[family][1]))


def test_each_family_gets_its_format(tokenizer, family):
    """The registry picks the module named for the family's format, and that module alone of
    the named formats recognises the model: their order in FORMATS does not matter, only the
    catch-alls' place at the end."""
    expected = FAMILIES[family][0]
    fmt = tool_format_for(tokenizer)
    assert fmt.name == expected and fmt.constrained
    named = [_name(m) for m in FORMATS if _name(m) not in CATCH_ALL and m.detect(tokenizer)]
    assert named == ([] if expected in CATCH_ALL else [expected])
    module = next(m for m in FORMATS if _name(m) == expected)
    assert module.detect(tokenizer) == fmt
    assert (fmt.start, fmt.end) == (module.tool_call_start, module.tool_call_end)
    if family in MISTRAL_LAYOUTS:  # read from the template: each layout its own syntax
        assert fmt == getattr(formats.mistral, MISTRAL_LAYOUTS[family])
    elif expected != "glm47":  # GLM's layout is read from the template too
        assert fmt.syntax == module.syntax


def test_every_format_module_has_the_same_surface():
    """Each registered module offers mlx-lm's parser surface plus `syntax` and `detect`
    (parsed_only takes the markers and parser mlx-lm chose); the fallback comes last."""
    for module in FORMATS:
        surface = SURFACE[:2] if _name(module) == "parsed_only" else SURFACE
        missing = [name for name in surface if not hasattr(module, name)]
        assert not missing, f"{module.__name__} lacks {missing}"
        assert callable(module.detect) and callable(getattr(module, "parse_tool_call", len))
    assert [_name(m) for m in FORMATS[-1:]] == ["hermes"]
    assert isinstance(formats.hermes.detect(object()), ToolFormat)  # any model


def test_every_format_module_is_registered():
    """A module of chat/formats is a registered format or a named helper: a new format cannot
    be left out of the registry, and a helper cannot detect a format."""
    root = Path(formats.__file__).parent
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in root.rglob("*.py")
        if p.name != "__init__.py" or p.parent != root
    }
    assert modules == {_name(m) for m in FORMATS} | HELPERS
    for name in HELPERS:
        assert "def detect(" not in (root / (name.replace(".", "/") + ".py")).read_text()


def _imports(path: Path) -> set[str]:
    """What `path` imports from mlx_kvserve.chat.formats and its modules, as `module:name`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(formats.__name__):
            found |= {f"{node.module}:{alias.name}" for alias in node.names}
    return found


def test_nothing_else_picks_a_format():
    """Outside chat/formats, the package gets a model's format from `tool_format_for` (or its
    start-up helpers) and no detector, probe or format module is asked directly; only the
    registry calls `detect`."""
    allowed = {
        f"{formats.__name__}:{name}"
        for name in ("tool_format_for", "tool_format_notice", "add_end_tokens")
    }
    allowed.add(f"{formats.__name__}.tool_format:ToolFormat")  # the type, to annotate
    root = Path(formats.__file__).parent
    for path in PACKAGE.rglob("*.py"):
        if root in path.parents:
            continue
        extra = _imports(path) - allowed
        assert not extra, f"{path.relative_to(PACKAGE.parent)} imports {sorted(extra)}"
    callers = [
        path.relative_to(root)
        for path in root.rglob("*.py")
        if ".detect(" in path.read_text(encoding="utf-8")
    ]
    assert callers == [Path("__init__.py")]

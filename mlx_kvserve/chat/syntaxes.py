"""The registry of tool-call syntaxes that can be constrained and streamed, by mlx-lm parser
name (chat.call_syntax). A format that is not here is parsed only, and says so at start-up."""

from __future__ import annotations

from mlx_kvserve.chat.call_syntax import CallSyntax
from mlx_kvserve.chat.function_gemma_calls import FUNCTION_GEMMA
from mlx_kvserve.chat.gemma4_calls import GEMMA4
from mlx_kvserve.chat.kimi_calls import KIMI_K2
from mlx_kvserve.chat.kimi_k3_calls import KIMI_K3
from mlx_kvserve.chat.longcat_calls import LONGCAT
from mlx_kvserve.chat.minicpm_calls import MINICPM5
from mlx_kvserve.chat.minimax_calls import MINIMAX_M2
from mlx_kvserve.chat.muse_calls import MUSE_SPARK
from mlx_kvserve.chat.pythonic_calls import PYTHONIC
from mlx_kvserve.chat.xml_calls import LAYOUTS

SYNTAXES: dict[str, CallSyntax] = {
    **LAYOUTS,
    MINIMAX_M2.format: MINIMAX_M2,
    MUSE_SPARK.format: MUSE_SPARK,
    KIMI_K2.format: KIMI_K2,
    PYTHONIC.format: PYTHONIC,
    GEMMA4.format: GEMMA4,
    KIMI_K3.format: KIMI_K3,
    LONGCAT.format: LONGCAT,
    MINICPM5.format: MINICPM5,
    FUNCTION_GEMMA.format: FUNCTION_GEMMA,
}

"""The text layer: text in, text out, above the generate layer.

:class:`Tokenizer` reads a Hugging Face model folder offline (the fast tokenizer, special
tokens, end-of-sequence ids, the chat template); :class:`TextClient` wraps a
:class:`~anyio_genout.Client` with it, so ``async with text_client.generate(TextRequest(...))
as stream`` streams :class:`TextOutput` deltas: vLLM 0.32's incremental detokenization and
stop strings, with a stop-string match freeing the engine's request under
:attr:`AbortCause.STOP_STRING_MATCHED <anyio_genout.AbortCause.STOP_STRING_MATCHED>`.
:class:`TextDecoder` is the same text state without I/O, for callers that drive the token
layer themselves. :func:`bundled_model_dir` is the small byte-level BPE tokenizer shipped
with the package (what the command line's embedded mock engine writes in). See docs/text.md.
"""

from .bundled import bundled_corpus, bundled_model_dir, bundled_tokenizer
from .client import TextClient
from .decoding import TextDecoder, TextStep
from .output import CollectedTextOutput, LogprobRows, TextOutput, TokenLogprob, collect_text
from .request import TextRequest
from .stream import TextStream
from .tokenizer import Tokenizer

__all__ = [
    "CollectedTextOutput",
    "LogprobRows",
    "TextClient",
    "TextDecoder",
    "TextOutput",
    "TextRequest",
    "TextStep",
    "TextStream",
    "TokenLogprob",
    "Tokenizer",
    "bundled_corpus",
    "bundled_model_dir",
    "bundled_tokenizer",
    "collect_text",
]

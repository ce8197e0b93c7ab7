"""``TextClient``: text in, text out, over a generate-layer :class:`~anyio_genout.Client`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, final

from ..generate import Client
from .offload import Offload, encode_request
from .request import TextRequest, check_text_request
from .stream import ModelEos, TextStream, new_text_stream
from .tokenizer import Tokenizer

__all__ = ["TextClient"]

T = TypeVar("T")


@final
class TextClient:
    """Generate text from vLLM engines with a model folder's tokenizer, one scope per request:

    .. code-block:: python

        text_client = TextClient(client, Tokenizer.from_model_dir("/models/my-model"))
        async with text_client.generate(TextRequest(prompt="Once upon a time")) as stream:
            async for out in stream:
                print(out.text, end="", flush=True)

    It fills in the model's end-of-sequence tokens as vLLM does (the tokenizer's, else
    ``ClientConfig.eos_token_id``: see :func:`~anyio_genout.protocol.sampling.fill_eos`) and
    runs the text layer (detokenization, stop strings) in the consumer's task; chat
    templates and long prompts are rendered and encoded in worker threads (a few at a
    time), so they never stall the event loop; everything else (scopes, aborts, metrics,
    health) is the :class:`Client`'s.
    """

    __slots__ = ("_client", "_eos", "_offload", "_tokenizer")

    def __init__(self, client: Client, tokenizer: Tokenizer) -> None:
        """Wrap ``client`` with ``tokenizer`` (usually ``Tokenizer.from_model_dir(folder)``).

        Raises:
            ValueError: the tokenizer's vocabulary is larger than the client's
                ``vocab_size``: it belongs to another model (its token ids would be refused).
        """
        vocab = client.engine.config.vocab_size
        if vocab is not None and tokenizer.vocab_size > vocab:
            raise ValueError(
                f"the tokenizer's vocabulary ({tokenizer.vocab_size} tokens) does not fit the "
                f"client's vocab_size={vocab}: is it the engines' model?")
        self._client = client
        self._tokenizer = tokenizer
        self._eos = ModelEos(tokenizer, fallback=client.config.eos_token_id)
        self._offload = Offload(tokenizer)

    @property
    def client(self) -> Client:
        """The generate-layer client underneath (metrics, ``abort``, the engine client)."""
        return self._client

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def generate(self, request: TextRequest, *, per_step: bool = False) -> TextStream:
        """Start ``request``: ``async with text_client.generate(request) as stream:``.

        Nothing is checked or sent until the ``async with`` block is entered (see
        :class:`TextStream` for what entering raises and what leaving early does). Outputs
        that wait while the consumer is busy come merged into one, their text together
        (docs/lifecycle.md, "Coalescing"); ``per_step=True``: one output per engine step, as
        :meth:`Client.generate` gives them.
        """
        return new_text_stream(self._client, self._tokenizer, self._eos, request, self._offload,
                               per_step=per_step)

    async def encode(self, request: TextRequest) -> tuple[str | None, list[int]]:
        """What entering ``request``'s stream would send: the prompt text (the rendered
        chat template for ``messages``; None for ``prompt_token_ids``) and its token ids
        (empty if the text encodes to none: entering would refuse that). Nothing is sent.
        As on entering: a text that cannot fit the engines' ``max_model_len`` is refused
        before it is encoded; templates and long texts are rendered and encoded in worker
        threads.

        Raises:
            InvalidRequestError: a bad field (named), or a prompt too long for the context
                (vLLM's message).
            ChatTemplateError: ``messages`` without a usable chat template, or a template
                that failed or went past its budget.
        """
        check_text_request(request)
        return await encode_request(self._offload, self._tokenizer, request,
                                    max_model_len=self._client.engine.max_model_len,
                                    allow_empty=True)

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                     field: str = "token_ids") -> str:
        """The text of ``token_ids``, each checked against the tokenizer's vocabulary; a
        long sequence (more than :data:`~.offload.DECODE_INLINE_TOKENS`) is checked and
        decoded in a worker thread, as a long text is encoded.

        Raises:
            InvalidRequestError: ``token_ids`` holds something that is not a token id of
                the vocabulary (named as ``field``).
        """
        return await self._offload.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                          field=field)

    async def run_in_worker(self, work: Callable[[], T]) -> T:
        """``work()`` in the worker thread that renders chat templates, for CPU work in
        Python that would stall the event loop (the server renders a large whole response
        this way): one such work at a time, each holding the GIL only in turns with the
        event loop. A cancellation leaves at once: ``work`` runs on to its end in its
        thread and its result is dropped.

        Raises:
            Whatever ``work`` raises.
        """
        return await self._offload.run_python(work)

#!/usr/bin/env python3
"""Train the tokenizer the project ships (``anyio_genout/text/bundled/``), deterministically.

A byte-level BPE trained with the ``tokenizers`` library on ``corpus.txt`` (original prose the
project wrote, in English and several other scripts): 1024 tokens in all, every one of the 256
byte-level characters in the alphabet (so any text encodes, and a multi-byte character often
spans several tokens), and five special tokens at fixed ids::

    0 <pad>   1 <s> (bos)   2 </s> (eos)   3 <|im_start|>   4 <|im_end|>

Encoding a single text prepends ``<s>`` (a ``TemplateProcessing`` post-processor); the chat
template is ChatML-style. The files written beside the corpus are ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json`` (eos ids ``[2, 4]``) and ``config.json``
(a Llama-shaped config with ``vocab_size`` 1024), the layout of a Hugging Face model folder
without weights. Running the tool twice gives the same bytes (``--check`` verifies the
committed files are what the tool writes)::

    python tools/build_tokenizer.py            # rewrite the bundled files
    python tools/build_tokenizer.py --check    # exit 1 if they differ from a fresh build
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
MAX_LENGTH = 2048
SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIALS))
BUNDLED = Path(__file__).resolve().parent.parent / "anyio_genout" / "text" / "bundled"
CORPUS = "corpus.txt"
OUTPUTS = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")

#: ChatML: each message is ``<|im_start|>{role}\n{content}<|im_end|>\n`` after one ``<s>``.
CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' ~ message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def train(corpus: str) -> str:
    """The trained tokenizer as ``tokenizer.json`` text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(token, special=True, normalized=False) for token in SPECIALS]
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         min_frequency=2, show_progress=False)
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    bos = SPECIALS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, BOS_ID)])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"trained {size} tokens, not {VOCAB_SIZE}: the corpus is too small")
    for token_id, token in enumerate(SPECIALS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer.to_str(pretty=True) + "\n"


def _dump(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def configs() -> dict[str, str]:
    """``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` texts."""
    added = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, token in enumerate(SPECIALS)}
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": SPECIALS[BOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIALS[EOS_ID],
        "extra_special_tokens": {},
        "model_max_length": MAX_LENGTH,
        "pad_token": SPECIALS[PAD_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID],
                         "pad_token_id": PAD_ID}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "max_position_embeddings": MAX_LENGTH,
        "model_type": "llama",
        "pad_token_id": PAD_ID,
        "vocab_size": VOCAB_SIZE,
    }
    return {"tokenizer_config.json": _dump(tokenizer_config),
            "generation_config.json": _dump(generation_config), "config.json": _dump(config)}


def build(out: Path, corpus: str) -> None:
    """Write the four files to ``out``."""
    files = {"tokenizer.json": train(corpus), **configs()}
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, default=BUNDLED,
                        help="folder to write (default: the bundled folder)")
    parser.add_argument("--check", action="store_true",
                        help="build into a temporary folder and compare with --output")
    args = parser.parse_args(argv)
    corpus = (BUNDLED / CORPUS).read_text(encoding="utf-8")
    if not args.check:
        build(args.output, corpus)
        print(f"wrote {', '.join(OUTPUTS)} to {args.output}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), corpus)
        differ = [name for name in OUTPUTS
                  if (Path(tmp) / name).read_bytes() != (args.output / name).read_bytes()]
    if differ:
        print(f"differ from a fresh build: {', '.join(differ)}", file=sys.stderr)
        return 1
    print("the bundled tokenizer files are what this tool builds")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Write a tiny random-weight Llama model (and an offline tokenizer) for real-vLLM tests.

Nothing is downloaded: the weights come from ``torch.manual_seed(0)``, so every build is
bit-identical, and the tokenizer is a ``tokenizers`` WordLevel model built in place.

* ``LlamaForCausalLM``: vocab 1024, hidden 256, intermediate 512, 2 layers, 4 attention heads
  and 4 KV heads, so ``head_dim`` is 64 (vLLM's CPU attention backend only takes head sizes
  32, 64, 80, 96, 112, 128, ...; 16 starts but dies on the first forward pass), max positions
  2048, float32, ``bos_token_id=1``, ``eos_token_id=2``, ``pad_token_id=0``.
* Tokenizer: ids 0-3 are ``<pad> <s> </s> <unk>``; id N >= 4 is the word ``tN``, split on
  whitespace (``"t5 t6 t100"`` encodes to ``[5, 6, 100]``).

Needs torch, transformers and tokenizers (the interop venv has them)::

    python tools/build_tiny_model.py OUTPUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

VOCAB_SIZE = 1024
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
MAX_POSITIONS = 2048
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SEED = 0


def build(out: Path) -> int:
    """Write the model and tokenizer to ``out``; return the parameter count."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for i in range(len(specials), VOCAB_SIZE):
        vocab[f"t{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("output", type=Path, help="folder to write (created if absent)")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    params = build(args.output)
    print(f"tiny model: {params} parameters written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

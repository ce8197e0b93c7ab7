"""Benchmark model folders with realistic tokenizers, built offline and cached.

The models people serve decode through a byte-level BPE (Llama 3, Qwen: ``ByteLevel``
pre-tokenizer and decoder) or a SentencePiece-style BPE with byte fallback (Llama 2,
Mistral: ``Metaspace`` pre-tokenizer, decoder ``Replace("▁", " ")``, ``ByteFallback``,
``Fuse``, ``Strip(left=1)``). No model can be downloaded here, so :func:`build_model_dir`
trains both kinds with the ``tokenizers`` library on a synthetic corpus drawn from a seeded
RNG (English-like words, code, text in several scripts) and writes a model folder the text
layer, the mock engine and ``vllm serve`` read: ``config.json`` (a Llama config, its
``vocab_size`` the tokenizer's), ``tokenizer.json``, ``tokenizer_config.json`` (a chat
template, bos/eos), ``generation_config.json``. The folder goes to
``~/.cache/anyio-genout/bench-models/<name>-<hash>/``, the hash over the recipe and the
``tokenizers`` version; training is deterministic (the same hash, the same files).

:data:`TOKENIZERS` names them: ``bpe-bytelevel-32k`` and ``sp-bytefallback-32k``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

__all__ = ["BUILT", "BUILT_HELP", "TOKENIZERS", "build_model_dir", "cache_root", "synthetic_corpus"]

#: The built tokenizers' names (``model``, the benchmarks' ``--model`` folder, is the third).
BUILT: Final = ("bpe-bytelevel-32k", "sp-bytefallback-32k")
TOKENIZERS: Final = ("model", *BUILT)
#: What the built ones are, for the benchmark commands' ``--tokenizers`` help.
BUILT_HELP: Final = ("bpe-bytelevel-32k (a Llama 3 / Qwen style byte-level BPE), "
                     "sp-bytefallback-32k (a Llama 2 / Mistral style byte-fallback BPE); the "
                     "last two are built locally and cached (default: all three)")
VOCAB_SIZE: Final = 32768
#: Bump when the recipe changes (the cache key holds it).
RECIPE: Final = 1
CORPUS_SEED: Final = 20261202
LEXICON: Final = 60000
CORPUS_LINES: Final = 40000
_PARALLELISM: Final = "TOKENIZERS_PARALLELISM"

_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}{% for message in messages %}<|start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")

#: Llama 2 / Mistral's shape, for the byte-fallback folder (no added turn tokens).
_INST_TEMPLATE: Final = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}{% else %}[INST] {{ message['content'] }} [/INST]"
    "{% endif %}{% endfor %}")

_ONSETS: Final = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s",
                  "t", "v", "w", "st", "tr", "pl", "br", "ch", "sh", "th", "gr", "sp", "cl")
_VOWELS: Final = ("a", "e", "i", "o", "u", "ea", "ou", "io", "ai", "ee", "y")
_CODAS: Final = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "x")
_COMMON: Final = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with",
                  "was", "on", "be", "by", "this", "are", "from", "or", "an", "which", "not")
_CODE: Final = ("def {w}(self, {v}):\n    return {v} + {n}\n",
                "for ({w} = 0; {w} < {n}; {w}++) {{ {v}[{w}] = {n}; }}\n",
                "if {w} is not None and {v} >= {n}:\n    raise ValueError(\"{w}\")\n",
                "const {w} = await fetch(`/api/{v}?id=${{{n}}}`);\n",
                "SELECT {w}, COUNT(*) FROM {v} WHERE id > {n} GROUP BY {w};\n",
                "    {w}_{v} = {{\"{w}\": [{n}, {n}.5e-3], \"ok\": true}}\n")
#: Text in other scripts (multi-byte UTF-8: 2, 3 and 4 bytes a character).
_UNICODE: Final = ("Привет, как дела? Это пример текста.",
                   "Γειά σου κόσμε, καλημέρα.",  # noqa: RUF001
                   "日本語のテキストと漢字を混ぜた文です。",
                   "中文文本示例，包括标点符号。",  # noqa: RUF001
                   "한국어 문장도 조금 포함합니다.", "مرحبا بالعالم، هذا نص عربي.",
                   "नमस्ते दुनिया, यह हिंदी पाठ है।", "emoji 🙂🚀✨ and symbols → ≤ ≠ ∑ €",
                   "Ünïcödé äccénts: naïve café façade jalapeño Straße.")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(rng.choice((1, 1, 2, 2, 3))))


def synthetic_corpus(lines: int = CORPUS_LINES, seed: int = CORPUS_SEED) -> str:
    """A deterministic training text: English-like prose from a fixed lexicon (Zipf-ish
    word frequencies), code in a few languages, and text in other scripts."""
    rng = random.Random(seed)
    lexicon = list(_COMMON) + [_word(rng) for _ in range(LEXICON)]
    cumulative = list(itertools.accumulate((rank + 1) ** -0.7 for rank in range(len(lexicon))))
    out: list[str] = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.7:
            words = rng.choices(lexicon, cum_weights=cumulative, k=rng.randint(5, 24))
            if rng.random() < 0.2:
                words[0] = words[0].capitalize()
            out.append(" ".join(words) + rng.choice((".", ".", ",", "?", "!", ":")) + "\n")
        elif kind < 0.9:
            a, b = rng.choices(lexicon, cum_weights=cumulative, k=2)
            out.append(rng.choice(_CODE).format(w=a, v=b, n=rng.randint(0, 4096)))
        else:
            out.append(rng.choice(_UNICODE) + " " + str(rng.randint(0, 999)) + "\n")
    return "".join(out)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/anyio-genout/bench-models`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "anyio-genout", "bench-models")


def _recipe(name: str) -> dict[str, Any]:
    import tokenizers

    return {"name": name, "recipe": RECIPE, "vocab_size": VOCAB_SIZE, "seed": CORPUS_SEED,
            "lines": CORPUS_LINES, "lexicon": LEXICON, "tokenizers": tokenizers.__version__}


def _key(name: str) -> str:
    return hashlib.sha256(json.dumps(_recipe(name), sort_keys=True).encode()).hexdigest()[:16]


def _train_bytelevel(corpus: list[str]) -> str:
    """A Llama 3 / Qwen style byte-level BPE; its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))])
    return tokenizer.to_str()


def _train_bytefallback(corpus: list[str]) -> str:
    """A Llama 2 / Mistral style SentencePiece BPE with byte fallback; its JSON. The 256
    ``<0xAB>`` byte pieces are ordinary vocabulary entries (ids
    3-258, as in Llama 2), not added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                       prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=specials + byte_pieces, show_progress=False,
                                  limit_alphabet=1000)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B",
        special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]
    data["pre_tokenizer"]["split"] = False  # as Mistral's: one piece, "▁" first only
    return json.dumps(data, ensure_ascii=False)


def _config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    """A small Llama config (what the mock engine and ``vllm serve`` read)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "bos_token_id": bos, "eos_token_id": eos, "hidden_size": 256,
            "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "dtype": "float32", "vocab_size": vocab_size}


def _write_folder(dest: Path, name: str, tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer_json)
    if name.startswith("bpe-"):
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
        extra: dict[str, Any] = {"additional_special_tokens": ["<|start|>", "<|end|>"]}
    else:
        bos, eos = "<s>", "</s>"
        extra = {"unk_token": "<unk>"}
    bos_id, eos_id = backend.token_to_id(bos), backend.token_to_id(eos)
    assert bos_id is not None and eos_id is not None, "trained as special tokens"
    end_id = backend.token_to_id("<|end|>")
    size = backend.get_vocab_size(with_added_tokens=True)
    (dest / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "tokenizer_class": "TokenizersBackend",
        "bos_token": bos, "eos_token": eos, "model_max_length": 2048,
        "chat_template": _CHAT_TEMPLATE if end_id is not None else _INST_TEMPLATE,
        **extra}, indent=1))
    eos_ids = [eos_id] if end_id is None else [eos_id, end_id]
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_ids}, indent=1))
    (dest / "config.json").write_text(json.dumps(_config(size, bos_id, eos_id), indent=1))
    (dest / ".anyio-genout-bench-model.json").write_text(json.dumps(_recipe(name), indent=1))


def build_model_dir(name: str, root: Path | None = None) -> Path:
    """The cached folder of the built tokenizer ``name`` (one of :data:`BUILT`), trained
    and written on first use (a few seconds), atomically (a rename), so concurrent builders
    are safe.

    Raises:
        ValueError: ``name`` is not one of :data:`BUILT`.
    """
    if name not in BUILT:
        raise ValueError(f"tokenizer {name!r} is not one of {', '.join(BUILT)}")
    root = cache_root() if root is None else root
    dest = root / f"{name}-{_key(name)}"
    if (dest / "config.json").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    corpus = synthetic_corpus().splitlines(keepends=True)
    train = _train_bytelevel if name.startswith("bpe-") else _train_bytefallback
    parallel = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"  # one thread: the same merges every time
    try:
        tokenizer_json = train(corpus)
    finally:
        if parallel is None:
            del os.environ[_PARALLELISM]
        else:
            os.environ[_PARALLELISM] = parallel
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_folder(tmp, name, tokenizer_json)
        try:
            tmp.rename(dest)
        except OSError:  # another builder was first
            if not (dest / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest

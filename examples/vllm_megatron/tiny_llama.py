"""The tiny model and task of the vLLM + Megatron example: a random HF Llama, a local tokenizer, the digit task.

    from examples.vllm_megatron.tiny_llama import save_tiny_llama
    path = save_tiny_llama("/tmp/tiny-llama", seed=0)   # config.json, model.safetensors, tokenizer files
    # vllm.LLM(model=path, ...), LlamaForCausalLM.from_pretrained(path), mbridge ... all read this directory

Nothing is downloaded: the model is ``LlamaForCausalLM(LlamaConfig(...))`` with a
seeded random init (float32, untied embeddings: Megatron's GPTModel default, so
the HF <-> Megatron mapping needs no tying), and the tokenizer is a
character-level ``PreTrainedTokenizerFast`` built with the ``tokenizers``
library over the digits, ``=`` and the special tokens (token id of digit d is d;
16 tokens, so the vocabulary splits over TP=2, 4, 8 or 16 without padding).

The sizes suit both engines on CPU: head_dim 32 (vLLM's CPU attention refuses
16; it supports 32, 64, 80, 96, 112, 128, ...), 4 attention heads and 2 KV
heads (GQA, both divisible by TP=2), 2 layers (one per stage with PP=2).

The task: a prompt is ``digits`` random digits and ``=``; the answer is every
digit plus one (mod 10), e.g. ``3914=`` -> ``4025``; the reward is the fraction
of answer characters that are right. A random policy scores about 0.07.

    python examples/vllm_megatron/tiny_llama.py /tmp/tiny-llama     # write the checkpoint
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

DIGITS = "0123456789"
SPECIAL = {"eq": "=", "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>", "sep": "<sep>"}
# Token id of digit d is d. 16 tokens (``<sep>`` is unused by the task): a vocabulary divisible by the
# TP size, so Megatron's vocab-parallel embedding and output layer need no padding rows (padding
# rows would add logits that vLLM and HF do not have, and the log-probs would differ).
VOCAB = [*DIGITS, *SPECIAL.values()]
# head_dim = hidden_size / num_attention_heads = 32; heads and KV heads divisible by TP=2.
TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
RANDOM_POLICY_REWARD = 0.07  # mean reward of a random policy on the digit task


# ------------------------------------------------------------------------------ tokenizer, model
def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over :data:`VOCAB` (built here, nothing downloaded).

    >>> build_tokenizer()("3914=")["input_ids"]
    [11, 3, 9, 1, 4, 10]
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    bos = SPECIAL["bos"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=SPECIAL["eos"],
                                   pad_token=SPECIAL["pad"], unk_token=SPECIAL["unk"])


def model_config(**overrides):
    """The tiny Llama's ``LlamaConfig``: :data:`TINY_LLAMA` sizes, vocabulary and special ids from :data:`VOCAB`.

    >>> model_config().head_dim
    32
    """
    from transformers import LlamaConfig

    sizes = {**TINY_LLAMA, **overrides}
    sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["num_attention_heads"])
    return LlamaConfig(vocab_size=len(VOCAB), tie_word_embeddings=False, torch_dtype="float32",
                       bos_token_id=VOCAB.index(SPECIAL["bos"]), eos_token_id=VOCAB.index(SPECIAL["eos"]),
                       pad_token_id=VOCAB.index(SPECIAL["pad"]), **sizes)


def build_model(seed: int = 0, **overrides):
    """A randomly initialised float32 ``LlamaForCausalLM``; the same ``seed`` gives the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        return LlamaForCausalLM(model_config(**overrides)).float().eval()


def save_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Build the tiny Llama and its tokenizer and ``save_pretrained`` both into ``path``; returns ``path``.

    ``overrides`` change :data:`TINY_LLAMA` sizes (e.g. ``num_hidden_layers=4``).
    """
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    build_model(seed, **overrides).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------------------------ the digit task
def expected(prompt: str) -> str:
    """The right answer for a prompt like ``'3914='``: every digit plus one, mod 10.

    >>> expected("3914=")
    '4025'
    """
    return "".join(DIGITS[(int(c) + 1) % 10] for c in prompt.rstrip("="))


def score_text(prompt: str, answer: str) -> float:
    """Fraction of the answer's characters that are right (the reward); a short answer scores less.

    >>> score_text("3914=", "4?27")
    0.5
    """
    want = expected(prompt)
    return sum(a == b for a, b in zip(answer, want, strict=False)) / len(want)


def answer_text(tokenizer, ids) -> str:
    """Decode an answer one character per token (a special token reads as '?', so positions stay aligned)."""
    return "".join(t if len(t) == 1 else "?" for t in tokenizer.convert_ids_to_tokens(list(ids)))


def answer_texts(tokenizer, answer_ids) -> list[str]:
    """:func:`answer_text` of every row of a 2-D tensor/array of answer token ids."""
    return [answer_text(tokenizer, r) for r in answer_ids.tolist()]


def make_prompts(n: int, digits: int, seed: int) -> list[str]:
    """``n`` prompts of ``digits`` random digits and ``=`` (deterministic in ``seed``)."""
    rows = np.random.default_rng(seed).integers(0, 10, (n, digits))
    return ["".join(map(str, r)) + "=" for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the HF checkpoint and tokenizer into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    args = parser.parse_args(argv)
    print(save_tiny_llama(args.path, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

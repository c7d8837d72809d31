"""Tiny random-weight models of the architectures kvflow supports, and a tiny byte-level
BPE tokenizer with a chat template, for fast tests that still run real transformers code."""

from __future__ import annotations

import functools

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?\n\nStep 1: In May she sold 48 / 2 = 24 clips.\n\n",
    "Step 2: Altogether she sold 48 + 24 = 72 clips.\n\nThe answer is \\boxed{72}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] . , ; : ? ! $ % the a an of to in is and",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: architecture -> (config class name, extra config kwargs); covers GQA (2 and 3 KV heads) and MHA
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama": ("LlamaConfig", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)),
    "mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    # head_dim 32: the smallest vLLM's CPU attention serves (its kernels take 32, 64, 80, ...)
    "qwen2-hd32": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=128)),
}


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (~`vocab_size` tokens) with `<|im_end|>` as EOS and a chat
    template. Different sizes tokenize the same text differently (same special token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(arch: str = "qwen2", *, vocab_size: int | None = None, seed: int = 0, num_layers: int = 2,
               dtype: str = "float32"):
    """A random-weight causal LM of `arch` (see ARCHITECTURES), in eval mode."""
    import torch
    import transformers

    cls_name, extra = ARCHITECTURES[arch]
    kwargs = dict(
        vocab_size=vocab_size or len(tiny_tokenizer()), hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    kwargs.update(extra)
    tok = tiny_tokenizer()
    kwargs.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def tiny_runner(arch: str = "qwen2", **kwargs):
    """An `HFRunner` over `tiny_model(arch)` and `tiny_tokenizer()`."""
    from kvflow.backends.hf.engine import HFRunner

    return HFRunner(tiny_model(arch, **kwargs), tiny_tokenizer())


def tiny_engine(arch: str = "qwen2", **kwargs):
    """An `hf` engine (`HFEngine`) over `tiny_runner(arch)`."""
    from kvflow.backends.hf.decode import HFEngine

    return HFEngine(tiny_runner(arch, **kwargs))


def propose_now(engine, request, *, max_steps: int = 100_000):
    """Submit one ProposeRequest and step `engine` until it is finished: its Proposal."""
    engine.submit([request])
    for _ in range(max_steps):
        for proposal in engine.step():
            if proposal.request is request:
                return proposal
    raise RuntimeError("propose_now: the proposal did not finish")

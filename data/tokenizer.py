"""
All tokenization of rebm in one place: characters (the CPU demo) or GPT-2's 50k BPE (the paper).

GPT-2 BPE runs offline: tiktoken would download the vocabulary at first use, so the ranks file
is vendored in assets/ (from the openai-whisper 20250625 sdist, MIT, see assets/) and checked
against the hash tiktoken itself expects for r50k_base, which is GPT-2's vocabulary.

A tokenizer is rebuilt from a data dir's meta.json, so data, models and samples always agree.
"""

import base64
import hashlib
import os

EOT = '<|endoftext|>'
GPT2_RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'assets', 'gpt2.tiktoken')
GPT2_SHA256 = '306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930'


class CharTokenizer:
    """id 0 is the end-of-text token that separates documents; ids 1.. are the characters."""

    def __init__(self, chars):
        self.chars = list(chars)
        self.stoi = {c: i + 1 for i, c in enumerate(self.chars)}
        self.eot_id, self.vocab_size, self.name = 0, len(self.chars) + 1, 'char'

    def encode(self, text):
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this corpus's character table") from None

    def decode(self, ids):
        return ''.join(EOT if i == 0 else self.chars[i - 1] for i in ids)


class GPT2Tokenizer:

    def __init__(self):
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str
        with open(GPT2_RANKS, 'rb') as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != GPT2_SHA256:
            raise ValueError(f"{GPT2_RANKS} does not have GPT-2's sha256: restore it from git")
        ranks = {base64.b64decode(tok): int(rank)
                 for tok, rank in (l.split() for l in data.splitlines() if l)}
        self.enc = tiktoken.Encoding('gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={EOT: 50256}, explicit_n_vocab=50257)
        self.eot_id, self.vocab_size, self.name = 50256, 50257, 'gpt2'

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # EOT inside text stays text, never a separator

    def decode(self, ids):
        return self.enc.decode(list(ids))


def build_tokenizer(name, texts=()):
    """A new tokenizer; for 'char' its table is every character in texts."""
    if name == 'char':
        return CharTokenizer(sorted(set().union(*map(set, texts))))
    if name == 'gpt2':
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer '{name}': use 'char' or 'gpt2'")


def tokenizer_meta(tok):
    """What meta.json (and every checkpoint) records to rebuild the tokenizer."""
    meta = dict(tokenizer=tok.name, vocab_size=tok.vocab_size, eot_id=tok.eot_id)
    if tok.name == 'char':
        meta['chars'] = ''.join(tok.chars)
    return meta


def load_tokenizer(meta):
    return CharTokenizer(meta['chars']) if meta['tokenizer'] == 'char' else build_tokenizer(meta['tokenizer'])

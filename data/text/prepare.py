"""
Prepare any UTF-8 text for rebm: one or more files, or folders of *.txt files.

Each file is one document. With several documents they are split by document (whole files go to
val and test, so their text is never seen in training); a single file is cut into three
contiguous pieces instead. Writes train/val/test.bin and meta.json (see data/__init__.py).

    python data/text/prepare.py my_book.txt --out_dir data/my_book                  # chars
    python data/text/prepare.py corpus_dir/ --out_dir data/my_corpus --tokenizer gpt2  # GPT-2 BPE
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from data import prepare  # noqa: E402
from runtime import ArgumentParser, check, check_writable, run_main  # noqa: E402


def read_documents(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(root, f) for root, _, fs in os.walk(p) for f in fs if f.endswith('.txt'))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"input '{p}' does not exist: give text files or folders of .txt files")
    docs = []
    for f in files:
        try:
            with open(f, encoding='utf-8') as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise ValueError(f"{f} is not UTF-8 text: convert it (e.g. iconv -t utf-8)") from None
        if text.strip():
            docs.append(text)
    if not docs:
        raise ValueError(f"no non-empty text found in {' '.join(paths)}")
    return docs


def split_documents(docs, val_frac, test_frac):
    """Whole documents per split when there are at least 3, else contiguous pieces of one text."""
    if len(docs) >= 3:
        n_val = max(1, round(val_frac * len(docs)))
        n_test = max(1, round(test_frac * len(docs)))
        return dict(train=docs[:-n_val - n_test], val=docs[-n_val - n_test:-n_test], test=docs[-n_test:])
    text = '\n'.join(docs)
    a, b = int(len(text) * (1 - val_frac - test_frac)), int(len(text) * (1 - test_frac))
    for split, piece, flag in (('val', text[a:b], '--val_frac'), ('test', text[b:], '--test_frac')):
        if not piece.strip():
            raise ValueError(f"{flag} gives the {split} split no text (one document of {len(text)} characters): raise it")
    return dict(train=[text[:a]], val=[text[a:b]], test=[text[b:]])


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument('inputs', nargs='+', help='text files and/or folders of .txt files')
    parser.add_argument('--out_dir', required=True, help='where to write the prepared data')
    parser.add_argument('--tokenizer', default='char', choices=['char', 'gpt2'])
    parser.add_argument('--val_frac', type=float, default=0.05, help='fraction of documents (or text) for val')
    parser.add_argument('--test_frac', type=float, default=0.05, help='fraction of documents (or text) for test')
    parser.add_argument('--seed', type=int, default=0, help='shuffles documents before choosing val/test ones')
    parser.add_argument('--quiet', action='store_true', help='no summary line')
    parser.add_argument('--force', action='store_true', help='replace other prepared data in --out_dir')
    args = parser.parse_args(argv)
    for name in ('val_frac', 'test_frac'):
        check(args, name, lambda v: 0 < v < 1, 'in (0, 1)')
    if args.val_frac + args.test_frac >= 1:
        raise ValueError(f"--val_frac {args.val_frac} + --test_frac {args.test_frac} leave no text for training: their sum must be below 1")
    check_writable(args.out_dir, '--out_dir')
    docs = read_documents(args.inputs)
    random.Random(args.seed).shuffle(docs)
    prepare(split_documents(docs, args.val_frac, args.test_frac), args.out_dir, args.tokenizer, args.quiet, args.force)


if __name__ == '__main__':
    run_main(main)

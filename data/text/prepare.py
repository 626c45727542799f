"""
Prepare any UTF-8 text for rebm: one or more files, or folders of *.txt files.

Each file is one document. With several documents they are split by document (whole files go to
select, val and test, so their text is never seen in training); fewer than 4 files are joined and
cut into four contiguous pieces instead. The selection set ('select') is carved from the
training documents: it chooses whatever is tuned, so that val and test are only reported.
Writes train/val/test.bin and meta.json (see data/__init__.py).

    python -m data.text.prepare my_book.txt --out_dir data/my_book                  # chars
    python -m data.text.prepare corpus_dir/ --out_dir data/my_corpus --tokenizer gpt2  # GPT-2 BPE
"""

import os
import random
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m data.text.prepare")
from data import made_with, prepare, prepare_flags  # noqa: E402
from plumbing import ArgumentParser, check_writable, not_a_file, run_main  # noqa: E402


def read_documents(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(root, f) for root, _, fs in os.walk(p)
                            for f in fs if f.endswith('.txt'))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"input '{p}' {not_a_file(p)}: give text files or folders of .txt files")
    seen = {}
    for f in files:  # one file read twice would sit in two splits: a test text also trained on
        if os.path.realpath(f) in seen:
            raise ValueError(f"{f} is given twice (also as {seen[os.path.realpath(f)]}): "
                             f"give each file once (a folder includes its .txt files)")
        seen[os.path.realpath(f)] = f
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


def split_documents(docs, val_frac, test_frac, select_frac):
    """Whole documents per split when there are at least 4, the selection set carved from the
    training ones; else contiguous pieces of one text, in the order train, select, val, test."""
    if len(docs) >= 4:
        n_val, n_test, n_sel = (max(1, round(f * len(docs))) for f in (val_frac, test_frac, select_frac))
        train = docs[:-n_val - n_test]
        return dict(train=train[:-n_sel], select=train[-n_sel:], val=docs[-n_val - n_test:-n_test],
                    test=docs[-n_test:])
    text = '\n'.join(docs)
    a, b, c = (int(len(text) * f)
               for f in (1 - val_frac - test_frac - select_frac, 1 - val_frac - test_frac, 1 - test_frac))
    pieces = dict(train=text[:a], select=text[a:b], val=text[b:c], test=text[c:])
    for split, piece in pieces.items():
        if not piece.strip():
            raise ValueError(f"--{split}_frac gives the {split} split no text "
                             f"(one document of {len(text)} characters): raise it"
                             if split != 'train' else "the fractions leave training no text: lower them")
    return {split: [piece] for split, piece in pieces.items()}


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument('inputs', nargs='+', help='text files and/or folders of .txt files')
    prepare_flags(parser, None, 'shuffles documents before choosing val/test ones', tokenizer='char')
    parser.add_argument('--val_frac', type=float, default=0.05, above=0, below=1,
                        help='fraction of documents (or text) for val, in (0, 1)')
    parser.add_argument('--test_frac', type=float, default=0.05, above=0, below=1,
                        help='fraction of documents (or text) for test, in (0, 1)')
    parser.add_argument('--select_frac', type=float, default=0.05, above=0, below=1,
                        help='fraction of documents (or text) carved from training for the selection set, '
                             'which chooses what is tuned (early stopping, recipes) '
                             'so that val and test are only reported')
    args = parser.parse_args(argv)
    if args.val_frac + args.test_frac + args.select_frac >= 1:
        raise ValueError(f"--val_frac {args.val_frac} + --test_frac {args.test_frac} "
                         f"+ --select_frac {args.select_frac} "
                         f"leave no text for training: their sum must be below 1")
    check_writable(args.out_dir, '--out_dir')
    docs = read_documents(args.inputs)
    random.Random(args.seed).shuffle(docs)
    prepare(split_documents(docs, args.val_frac, args.test_frac, args.select_frac), args.out_dir,
            args.tokenizer, args.quiet, args.force, made_with('text', parser, args))


if __name__ == '__main__':
    run_main(main)

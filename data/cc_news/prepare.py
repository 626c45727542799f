"""
CC-News, the paper's corpus (English news articles), for users who are online: it comes from the
Hugging Face hub through the optional `datasets` package (`pip install datasets`). Offline, or
without `datasets`, it stops with one line saying so; the default corpus is data/shakespeare.

Each article is one document; val and test are whole articles chosen by a seeded shuffle.
The paper uses GPT-2-sized BPE, so gpt2 is the default tokenizer here.

    python -m data.cc_news.prepare --max_docs 100000          # a 100k-article subset
"""

import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m data.cc_news.prepare")
from data import made_with, prepare, prepare_flags  # noqa: E402
from plumbing import ArgumentParser, check_writable, run_main  # noqa: E402


def load_articles(name, max_docs):
    try:
        import datasets
    except ImportError:
        raise ValueError("cc_news needs the optional `datasets` package: pip install datasets "
                         "(or use the offline default, data/shakespeare)") from None
    try:
        ds = datasets.load_dataset(name, split='train')
    except Exception as e:
        raise ValueError(f"could not load '{name}' from the Hugging Face hub ({type(e).__name__}); "
                         f"this corpus needs network access") from None
    texts = (t for t in ds['text'] if t and t.strip())
    return [t for _, t in zip(range(max_docs), texts)] if max_docs else list(texts)


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    prepare_flags(parser, HERE, 'seeds the choice of val/test articles', tokenizer='gpt2')
    parser.add_argument('--dataset', default='vblagoje/cc_news', help='hub name of the CC-News dataset')
    parser.add_argument('--max_docs', type=int, default=0, at_least=0, at_most='count',
                        help='use only the first N articles (0: all)')
    parser.add_argument('--eval_docs', type=int, default=1000, at_least=1, at_most='count',
                        help='articles in each of select (carved from training), val and test')
    args = parser.parse_args(argv)
    check_writable(args.out_dir, '--out_dir')  # before the download
    docs = load_articles(args.dataset, args.max_docs)
    if len(docs) < 3 * args.eval_docs + 1:
        raise ValueError(f"only {len(docs)} articles for {args.eval_docs} select + val + test each: "
                         "lower --eval_docs")
    random.Random(args.seed).shuffle(docs)
    n = args.eval_docs
    prepare(dict(train=docs[3 * n:], select=docs[2 * n:3 * n], val=docs[:n], test=docs[n:2 * n]),
            args.out_dir, args.tokenizer, args.quiet, args.force, made_with('cc_news', parser, args))


if __name__ == '__main__':
    run_main(main)

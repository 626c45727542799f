"""
A corpus with a known answer: addition problems `a+b=c`, the sum written most-significant digit
first, so that a left-to-right LM must decide each digit before it has seen the carries from the
digits to its right; an energy that reads the whole line checks them instead. The task of the
paper's first author's public notebook (da03/Residual-EBM, REBM.ipynb), here char-level.

Every problem is one document of fixed length, operands and sum zero-padded to N and N + 1
digits, followed by the end-of-text id (data/__init__.py), e.g. for N = 5:

    01234+56789=058023<eot>        prefix: `01234+56789=` (2N + 2 tokens);
                                   continuation: the sum and the end of text (N + 2 tokens)

so the pipeline's non-overlapping windows (data.windows, stride prefix_len + gen_len = 3N + 4)
start exactly at the problems: run every stage with --prefix_len 2N+2 --gen_len N+2.
Carries are made frequent: at each digit position, with probability --chain the two digits sum
to 9 (a carry coming in then passes through, so a digit before a run of them waits on the first
column past it: the lookahead an LM must compute, extensions/carry.py),
else both are uniform. Problems are distinct, also as b+a (a problem and its mirror sit in one
split only); the selection split (`select`) chooses what is tuned; val and test are reported.

    python -m data.addition.prepare                      # N = 6, 200,000 training problems
    python -m data.addition.prepare --digits 10 --out_dir data/addition10
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m data.addition.prepare")
from data import made_with, prepare, prepare_flags  # noqa: E402
from plumbing import (ArgumentParser, check_memory, check_writable, rng_seed,  # noqa: E402
                      run_main)


def line(a, b, digits):
    """The document of one problem: a and b zero-padded to `digits`, their sum to digits + 1."""
    return f'{a:0{digits}d}+{b:0{digits}d}={a + b:0{digits + 1}d}'


def draw_operands(rs, count, digits, chain):
    """(a, b) arrays of `count` operands below 10^digits: at each digit position, with probability
    chain a pair summing to 9 (a carry chain link), else two uniform digits."""
    da = rs.integers(0, 10, size=(count, digits))
    db = rs.integers(0, 10, size=(count, digits))
    link = rs.random((count, digits)) < chain
    db = np.where(link, 9 - da, db)
    place = 10 ** np.arange(digits - 1, -1, -1, dtype=np.int64)
    return da @ place, db @ place


def problems_memory(total, digits):
    """Bytes make_problems and prepare hold for `total` problems, roughly: draw_operands' arrays (33
    bytes per digit), and per problem a Python pair in a set and a list (~250), its document and its
    token ids (~100)."""
    return total * (33 * digits + 350 + 8 * (3 * digits + 4))


def distinct_pairs(rs, count, digits, chain, seen):
    """`count` operand pairs drawn by draw_operands, each new to `seen` (a problem and its mirror b+a
    are one key), which they join."""
    pairs = []
    while len(pairs) < count:
        for a, b in zip(*draw_operands(rs, count, digits, chain)):
            key = (min(a, b), max(a, b))
            if key not in seen:
                seen.add(key)
                pairs.append((int(a), int(b)))
                if len(pairs) == count:
                    break
    return pairs


def make_problems(sizes, digits, chain, seed, extra_test=0):
    """{split: [document, ...]} with sizes {split: count}: distinct problems, a problem and its
    mirror b+a never in two splits (nor twice in one). extra_test more test problems come from a
    random stream of their own, after all the others: every split, and the test split's first
    sizes['test'], are the same with or without them (the models trained on them still apply)."""
    total = sum(sizes.values()) + extra_test
    if total > 10 ** (2 * digits) // 4:
        raise ValueError(f"{total:,} distinct problems of {digits} digits are too many to draw: "
                         f"use more --digits or fewer problems")
    seen = set()
    pairs = distinct_pairs(np.random.default_rng(rng_seed(seed, 'addition')), total - extra_test, digits,
                           chain, seen)
    if extra_test:
        pairs += distinct_pairs(np.random.default_rng(rng_seed(seed, 'addition extra test')), extra_test,
                                digits, chain, seen)
    docs, start = {}, 0
    for split, count in dict(sizes, test=sizes['test'] + extra_test).items():
        docs[split] = [line(a, b, digits) for a, b in pairs[start:start + count]]
        start += count
    return docs


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    prepare_flags(parser, HERE, 'draws the problems')
    a = parser.add_argument
    a('--digits', type=int, default=6, at_least=1, at_most=18,
      help='N: operands below 10^N, sums of N + 1 digits (at most 18: sums must fit in 64 bits)')
    a('--chain', type=float, default=0.3, at_least=0, at_most=1,
      help='per digit position, the probability that the two digits sum to 9')
    for split, n in dict(train=200000, select=5000, val=5000, test=5000).items():  # memory: check_memory
        a(f'--{split}_problems', dest=split, type=int, default=n, at_least=1, at_most='count',
          help=f'problems of the {split} split')
    a('--extra_test_problems', dest='extra_test', type=int, default=0, at_least=0, at_most='count',
      help='more test problems, drawn after all the others from a stream of their own: the other splits '
           'and the first --test_problems stay as without them (a larger test split for trained models)')
    args = parser.parse_args(argv)
    sizes = dict(train=args.train, select=args.select, val=args.val, test=args.test)
    check_writable(args.out_dir, '--out_dir')
    total = sum(sizes.values()) + args.extra_test
    check_memory(problems_memory(total, args.digits),
                 f"drawing {total:,} problems (--train_problems, --select_problems, ...)", "lower them")
    docs = make_problems(sizes, args.digits, args.chain, args.seed, args.extra_test)
    meta = prepare(docs, args.out_dir, 'char', args.quiet, args.force, made_with('addition', parser, args))
    if not args.quiet:
        P = 2 * args.digits + 2
        print(f"windows: --prefix_len {P} --gen_len {args.digits + 2} (vocab {meta['vocab_size']})")


if __name__ == '__main__':
    run_main(main)

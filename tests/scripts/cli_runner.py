# Runs every row of the CLI table (tests/test_bad_input.py) in one python process: argv[1] the rows
# (JSON), argv[2] the artifacts folder, argv[3] the results (JSON). Each row's script runs as
# __main__ with its argv, stderr captured; around each row every file under the artifacts folder is
# hashed.
import contextlib, hashlib, io, json, os, runpy, sys, traceback
import torch
torch.set_num_threads(1)
rows_path, root, out_path = sys.argv[1:4]

def snapshot():
    snap = {}
    for d, _, files in os.walk(root):
        snap[os.path.relpath(d, root) + '/'] = 'folder'
        for f in files:
            with open(os.path.join(d, f), 'rb') as fh:
                snap[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return snap

results = {}
for row in json.load(open(rows_path)):
    before, err = snapshot(), io.StringIO()
    sys.argv = list(row['argv'])
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if row['argv'][0] == '-m':  # python -m job.claims ...: a module of the repo root, the cwd
                sys.argv = row['argv'][1:]
                runpy.run_module(row['argv'][1], run_name='__main__', alter_sys=True)
            else:
                runpy.run_path(row['argv'][0], run_name='__main__')
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            err.write(e.code + '\n')
    except BaseException:
        rc = 1
        err.write(traceback.format_exc())
    after = snapshot()
    results[row['id']] = dict(rc=rc, stderr=err.getvalue(),
                              changed=sorted(k for k in before if after.get(k) != before[k]),
                              created=sorted(k for k in after if k not in before))
json.dump(results, open(out_path, 'w'))

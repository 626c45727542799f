# A stage of the reproduce.py --jobs tests (tests/test_job.py): sleeps argv[2] seconds, then records
# in argv[1] when it ran and on how many threads; argv[3] 'fail' makes it fail instead, 'late' fail with
# its reason first and more lines after it, 'kill' die of SIGKILL.
import json, os, signal, sys, time
t0 = time.time()
time.sleep(float(sys.argv[2]))
print('stage writing', sys.argv[1])
if sys.argv[3] == 'fail':
    sys.exit('error: boom')
if sys.argv[3] == 'late':
    print('error: the real reason', flush=True)
    sys.exit('trained 100 iters')
if sys.argv[3] == 'kill':
    os.kill(os.getpid(), signal.SIGKILL)
json.dump(dict(start=t0, end=time.time(), threads=os.environ.get('OMP_NUM_THREADS')), open(sys.argv[1], 'w'))

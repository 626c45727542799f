# A script whose run_main ends with one error line, then receives SIGTERM during the interpreter's exit
# (as torchrun ends the survivors of a killed rank while torch's atexit callbacks run): test_resume.py.
import atexit, os, signal, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
import plumbing  # noqa: E402


def terminated_while_exiting():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)


def main(argv):
    raise ValueError('the one line')


atexit.register(terminated_while_exiting)
plumbing.run_main(main)

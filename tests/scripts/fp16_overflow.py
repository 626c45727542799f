# Runs the script of argv with its gradients made infinite at the $OVERFLOW_AT-th unscale_ of the
# GradScaler (test_fp16_scaler_skips_an_overflow_and_resumes_exactly, tests/test_resume.py).
import os, runpy, sys
import torch

unscale, calls = torch.amp.GradScaler.unscale_, []


def overflow_once(self, optimizer):
    calls.append(1)
    if len(calls) == int(os.environ['OVERFLOW_AT']):
        for group in optimizer.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    p.grad.fill_(float('inf'))
    return unscale(self, optimizer)


torch.amp.GradScaler.unscale_ = overflow_once
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')

# Runs the trainer of argv (ddp_recorder.py SCRIPT FLAGS..., under torchrun) with two checks added: as
# the process group closes it saves the rank's parameters to $PARAMS_DIR/rank{r}.pt; every
# all_reduce and broadcast refuses a tensor that is not on the run's device (--device), as NCCL
# does. Used by run_ddp_and_single (tests/common.py) and test_negatives_under_ddp_match_one_process.
import os, runpy, sys
import torch
import torch.distributed as dist
import torch.nn.parallel

wrapped = []
argv = sys.argv[2:]
RUN_DEVICE = argv[argv.index('--device') + 1].split(':')[0] if '--device' in argv else 'cpu'


class RecordingDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        wrapped.append(module)


def save_then_destroy(*args, destroy=dist.destroy_process_group, **kwargs):
    if wrapped:
        flat = torch.cat([p.detach().double().flatten() for p in wrapped[0].parameters()])
        torch.save(flat.cpu(), os.path.join(os.environ['PARAMS_DIR'], f'rank{dist.get_rank()}.pt'))
    destroy(*args, **kwargs)


def on_the_run_device(collective):
    """The collective, refusing a tensor that is not on the run's device, as NCCL refuses a CPU
    tensor on a CUDA run (gloo takes any)."""
    def checked(tensor, *args, **kwargs):
        if tensor.device.type != RUN_DEVICE:
            raise RuntimeError(f'{collective.__name__} of a {tensor.device} tensor in a {RUN_DEVICE} run')
        return collective(tensor, *args, **kwargs)
    return checked


def gloo(*args, init=dist.init_process_group, **kwargs):
    return init(backend='gloo')


torch.nn.parallel.DistributedDataParallel = RecordingDDP  # what the trainer imports as DDP
dist.destroy_process_group = save_then_destroy  # the trainer's last DDP call
dist.all_reduce, dist.broadcast = on_the_run_device(dist.all_reduce), on_the_run_device(dist.broadcast)
if RUN_DEVICE == 'cuda':  # both ranks on the one GPU: gloo takes CUDA tensors, NCCL wants a GPU each
    os.environ['LOCAL_RANK'] = '0'
    dist.init_process_group = gloo
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')

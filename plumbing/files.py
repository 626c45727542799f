"""
Files: atomic writes (a reader never sees half a file), the one line of a full disk, JSON and text
outputs, and checkpoints: saved atomically, their files checked as they load (weights_only=True).
"""

import errno
import hashlib
import json
import math
import os
import shutil

import torch

# -----------------------------------------------------------------------------
# atomic writes and a full disk

def atomic_write(path, write, nbytes=None):
    """write(tmp), then rename tmp to path (atomic_writes, for one file of about nbytes if known)."""
    atomic_writes([(path, write, nbytes)])


def atomic_writes(writes):
    """write(tmp) for each (path, write, nbytes) of writes, then each tmp renamed to its path, in
    order: a reader never sees half a file, and a failed write (full disk, Ctrl-C) leaves every
    previous file as it was and no temp file behind. Where every size is known (nbytes, else None)
    the disk is checked for all of them first. An OSError names the path; a full disk is the one
    disk-full line."""
    if all(n is not None for *_, n in writes):
        check_disk(writes[0][0], sum(n for *_, n in writes))
    tmps = []
    try:
        for path, write, nbytes in writes:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmps.append(f"{path}.{os.getpid()}.tmp")
            write(tmps[-1])
        for (path, *_), tmp in zip(writes, tmps):
            os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C too
        written = os.path.getsize(tmps[-1]) if tmps and os.path.exists(tmps[-1]) else 0
        full = tmps and out_of_space(e, path, nbytes and max(0, nbytes - written))  # before the temps go
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        if not isinstance(e, (OSError, RuntimeError)):  # a full disk is a RuntimeError inside torch.save
            raise
        if full:
            raise OSError(errno.ENOSPC, disk_full(path), path) from None
        raise OSError(getattr(e, 'errno', None) or errno.EIO,
                      f"cannot write {path} ({getattr(e, 'strerror', None) or e})", path) from None


def out_of_space(e, path, remaining=None):
    """Whether a write to path failed for want of disk space: ENOSPC, or, from a writer that says
    so without an errno (torch.save's 'enforce fail ... unexpected pos', numpy's 'N requested and
    M written'), less free than the `remaining` bytes to write (None: unknown) and 1 MiB."""
    if getattr(e, 'errno', None) == errno.ENOSPC:
        return True
    if not isinstance(e, (RuntimeError, OSError)) or getattr(e, 'errno', None):
        return False
    return free_space(path) < (remaining or 0) + 2**20


def finite(obj):
    """obj with every NaN or infinite float replaced by None: JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def nearest_existing(path):
    """path, or the nearest of its parents that exists (where it would be created)."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d


def first_missing(path):
    """The outermost folder that creating path creates (path itself if its parent exists)."""
    d = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(d)):
        d = os.path.dirname(d)
    return d


def not_a_file(path):
    """Why path cannot be read as an input file ('' if it can): it does not exist, is a folder, or
    is not a regular file (/dev/null, a pipe: 'does not exist' would send the user looking for it)."""
    if not os.path.exists(path):
        return 'does not exist'
    if os.path.isdir(path):
        return 'is a folder, not a file'
    return '' if os.path.isfile(path) else 'is not a regular file (a device, a pipe or a socket)'


# ---- a full disk: one line everywhere, found before the write where the size is known ----


def disk_full(path, needed=None, free=None):
    """The one disk-full line (ENOSPC), with the sizes where they are known."""
    if needed is None:
        return (f"the disk holding {path} is full: free some space and rerun "
                f"(what was written before is intact)")
    mb = lambda n: f"{n / 1e6:.{1 if n >= 1e5 else 3}f} MB"
    return f"the disk holding {path} is full: {mb(needed)} needed, {mb(free)} free"


def free_space(path):
    """Bytes free on the disk that holds path (or would: its nearest existing folder)."""
    return shutil.disk_usage(nearest_existing(path)).free


def check_disk(path, nbytes):
    """Refuses a write of about nbytes to path that the disk cannot hold, before it starts: an
    OSError (ENOSPC) with the one disk-full line and its sizes."""
    free = free_space(path)
    if free < nbytes:
        raise OSError(errno.ENOSPC, disk_full(path, nbytes, free) + ": free some space and rerun", path)


def check_free_space(path, nbytes, flag):
    """check_disk for the output a flag names, as bad input: before any work."""
    free = free_space(path)
    if free < nbytes:
        raise ValueError(f"{flag}: {disk_full(path, nbytes, free)}: free some space or choose another {flag}")


def checkpoint_iter(path):
    """The iteration a trainer's checkpoint holds (mmap: no wait on a big one)."""
    return torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num']

# -----------------------------------------------------------------------------
# text and JSON outputs

def text_writer(text):
    """write(tmp) writing text: for atomic_writes, beside other files."""
    def write(tmp):
        with open(tmp, 'w') as f:
            f.write(text)
    return write


def write_text(text, path):
    """Atomic text write (atomic_write)."""
    atomic_write(path, text_writer(text))


def json_text(obj):
    """obj as write_json writes it: NaN and infinities as null (JSON has neither)."""
    return json.dumps(finite(obj), indent=2, allow_nan=False)


def write_json(obj, path):
    """Atomic JSON write, like write_text."""
    write_text(json_text(obj), path)


# -----------------------------------------------------------------------------
# checkpoints: self-describing dicts of tensors and plain Python values, so weights_only=True loads them

def save_checkpoint(obj, path):
    """torch.save, atomically: a kill mid-write leaves the previous checkpoint intact."""
    save_checkpoints([(obj, path)])


def save_checkpoints(saves, texts=()):
    """Each (obj, path) of saves torch.saved, and after them each (text, path) of texts written,
    together (atomic_writes): the disk checked for all of them first, every one written to a temp
    file, then each renamed into place in order. A full disk leaves every previous file as it was."""
    atomic_writes([(path, lambda tmp, obj=obj: torch.save(obj, tmp), saved_bytes(obj)) for obj, path in saves]
                  + [(path, text_writer(text), len(text.encode())) for text, path in texts])


def saved_bytes(obj):
    """About the size of torch.save(obj): its tensors' storages, 1 KiB for each one's zip record,
    64 KiB for the pickle of the rest."""
    storages = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            storages[o.untyped_storage().data_ptr(), o.untyped_storage().nbytes()] = 1
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(obj)
    return sum(n for _, n in storages) + 2**10 * len(storages) + 2**16


def checked_load(path, what='a train_lm.py or nce_train.py checkpoint'):
    """The file at path torch.loaded with weights_only=True (never code from its pickle), or one
    line saying why it cannot be: missing, a folder, not the zip archive torch.save writes, more
    than tensors and plain data, corrupt or truncated."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a checkpoint: "
                         f"give the file, e.g. {os.path.join(path, 'ckpt.pt')}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} {not_a_file(path)}: "
                         + ("train one first (train_lm.py / nce_train.py)" if not os.path.exists(path)
                            else f"give {what}"))
    with open(path, 'rb') as f:
        if f.read(4) != b'PK\x03\x04':  # the zip archive torch.save writes (truncated ones too)
            raise ValueError(f"{path} is not a checkpoint (not the zip archive torch.save writes): "
                             f"give {what}")
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        if 'Weights only load failed' in str(e):  # code in the pickle: never run
            raise ValueError(f"{path} holds more than tensors and plain data, "
                             "which weights_only=True refuses to load "
                             f"(it could run code): it is not a rebm checkpoint") from None
        raise ValueError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}): "
                         f"retrain it or restore a copy") from None


def file_hash(path):
    """Content hash of a file: energies and negatives record the one of the LM they belong to."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()[:16]


def content_hash(paths):
    """One hash of the content of files (a data folder's meta.json and splits): what a checkpoint
    records of its inputs, so that a --resume on other data at the same path is found."""
    digests = (file_hash(p) if os.path.isfile(p) else '-' for p in paths)  # missing: the reader says so
    return hashlib.sha256(' '.join(digests).encode()).hexdigest()[:16]


def load_weights(model, state, path, strict=True):
    """model.load_state_dict(state); a checkpoint whose weights do not fit its own config (edited
    or damaged) is refused in one line naming the file."""
    try:
        return model.load_state_dict(state, strict=strict)
    except RuntimeError as e:
        detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise ValueError(f"{path}: its weights do not match its config ({detail[:160]}): the file was "
                         f"edited or damaged; retrain it or restore a copy") from None

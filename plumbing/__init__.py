"""
Plumbing: a reader may skip this package. Nothing here is the method or specific to the paper; it
is what lets the scripts run on any machine and fail with one clear line. Importing it changes
nothing (no environment variable, no file read) until a function is called.

    run.py      the entry point run_main: one-line errors (REBM_DEBUG=1 shows the traceback),
                Ctrl-C and SIGTERM hints, the output folders of a failed run removed; ArgumentParser,
                whose flags declare their help, kind and bounds (checked as they are parsed: one
                `error:` line, before any work), and the flag checks; lock_folder
    device.py   the threads' wait policy and malloc's freed memory (both set by run_main), pick_device
                and the precision from what the hardware has, DDP setup / teardown / all_reduce,
                rng_seed: one rule for every random stream
    budget.py   the memory and time a run's sizes need, checked before any work
    files.py    atomic writes, the one line of a full disk, write_json / write_text, and
                checkpoints: saved atomically, their files checked as they load (weights_only=True)
    trainer.py  what the two trainers share besides their loop: the flags and their checks,
                --resume's, the output folder (RunDir), the lines of a diverged or interrupted run
    guards.py   the method scripts' own checks, each called in one line from the script: flags beyond
                argparse, memory, time and disk budgets, the trainers' --resume fields, the files'
                agreement (`from plumbing import guards`)
    checkpoints.py  a checkpoint's checks as the method loads it: kind, vocabulary, a RALM's base and an
                energy's LM unchanged, finite weights; load_checkpoint; check_checkpoint: its entries,
                config, size and memory before a model is built
"""

from plumbing.budget import (TIME_LIMIT_S, available_memory, check_memory, check_time,  # noqa: F401
                             check_training_memory, duration, forward_seconds, training_memory)
from plumbing.checkpoints import check_checkpoint  # noqa: F401
from plumbing.device import (CPU_BF16_MIN_WIDTH, DTYPES, Precision, all_reduce, autocast,  # noqa: F401
                             check_compiler, choose_dtype, cores_in_use, cpu_bf16_units, keep_freed_memory,
                             openmp_wait_policy, pick_device, precision, rng, rng_seed, set_deterministic,
                             set_wait_policy, setup, setup_distributed, teardown_distributed)
from plumbing.files import (atomic_write, atomic_writes, check_disk, check_free_space,  # noqa: F401
                            checked_load, checkpoint_iter, content_hash, disk_full, file_hash, finite,
                            first_missing, free_space, json_text, load_weights, not_a_file, out_of_space,
                            save_checkpoint, save_checkpoints, write_json, write_text)
from plumbing.run import (COMMON_FLAGS, LOCKS, ArgumentParser, at_least, check, check_heads,  # noqa: F401
                          check_new, check_writable, comma_ints, common_flags, interrupt, lock_folder,
                          named_paths, new_folder, one_job, parser_of, progress, rerun_command, run_main)
from plumbing.trainer import (RunDir, check_new_run, check_resumed_flags, check_resumed_iters,  # noqa: F401
                              check_training_flags, checkpoint_hint, diverged, given_flags,
                              micro_batches, missing_checkpoint, run_trainer, training_parser)

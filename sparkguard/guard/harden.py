"""Harden the guard process: locked memory, OOM-killer immunity, CPU priority; the PSI trigger."""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import sys
import threading

MCL_CURRENT, MCL_FUTURE, MCL_ONFAULT = 1, 2, 4
M_ARENA_MAX = -8
PSI_TRIGGERS = (b"some 100000 1000000\0", b"some 150000 2000000\0")
NICE = -20                  # CPU priority of the guard (setpriority(2)); needs CAP_SYS_NICE; the unit's Nice=
THREAD_STACK = 512 * 1024   # bytes; threads' stacks are locked by mlockall(MCL_FUTURE)
SWITCH_INTERVAL = 0.0005    # seconds (sys.setswitchinterval): the most the loop waits for the interpreter lock
                            # after each system call while another thread runs Python (bench/threads_load.py)


def harden_self() -> list[str]:
    """Keep the guard's own pages in RAM and itself away from the OOM killer.

    mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT) (mlockall(2), Linux >= 4.4; needs CAP_IPC_LOCK or
    RLIMIT_MEMLOCK): every page the guard has touched stays in RAM, without pre-faulting whole
    libraries and reserved regions (earlyoom locks the same way; it keeps the RSS budget of 30 MiB with
    prometheus_client loaded).  The caller exercises the decision path once at start-up
    (:meth:`sparkguard.guard.act.Actions.warm_up`) so its pages are touched and locked before they
    are needed.
    oom_score_adj -1000 (proc(5); lowering needs CAP_SYS_RESOURCE), nice -20 (setpriority(2); needs
    CAP_SYS_NICE; measured against SCHED_RR in the unit's comment) so a spike of busy threads
    cannot starve the decision, a single malloc arena and
    small thread stacks so locked memory stays small.  Returns warnings for what was not
    permitted; never raises.
    """
    warnings = []
    threading.stack_size(THREAD_STACK)
    sys.setswitchinterval(SWITCH_INTERVAL)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        libc.mallopt(M_ARENA_MAX, 1)
    except AttributeError:
        pass
    rc = libc.mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)
    if rc != 0 and ctypes.get_errno() == errno.EINVAL:      # kernel < 4.4: no MCL_ONFAULT
        rc = libc.mlockall(MCL_CURRENT | MCL_FUTURE)
    if rc != 0:
        err = ctypes.get_errno()
        warnings.append(f"mlockall failed ({os.strerror(err)}): the guard can be paged out under heavy swap "
                        "and react late; run as root or with LimitMEMLOCK=infinity / CAP_IPC_LOCK")
    for adj in ("-1000", "-900"):
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(adj)
            break
        except OSError as e:
            last = e
    else:
        warnings.append(f"cannot lower oom_score_adj ({last.strerror}); the kernel OOM killer may pick the guard")
    try:
        # The filler is often many busy threads; at nice 0 the guard gets 1/N of a core and its
        # scan+signal path (a few ms of CPU) stretches to ~100 ms (bench/headtohead.py, tree scenario).
        # earlyoom's -p does the same (-20).  Idle cost is unchanged: the guard sleeps.
        # only ever raise the priority: the unit's Nice=-20 must not be undone
        os.setpriority(os.PRIO_PROCESS, 0, min(NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError as e:
        warnings.append(f"cannot raise the guard's CPU priority to nice {NICE} ({e.strerror}); under a CPU-heavy "
                        "memory spike it may react late")
    try:
        # one pidfd per victim process: systemd's default soft NOFILE (1024) must not cap the tree
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass
    return warnings


def open_psi_trigger(path: str = "/proc/pressure/memory") -> int | None:
    """Open a PSI memory trigger fd that polls POLLPRI on stalls (Documentation/accounting/psi.rst).

    Tries a 1 s window (needs CAP_SYS_RESOURCE below 2 s), then 2 s.  Returns the fd or None.
    """
    for trig in PSI_TRIGGERS:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            os.write(fd, trig)
            return fd
        except OSError:
            os.close(fd)
    return None

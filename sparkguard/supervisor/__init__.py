"""Engine supervision: start the inference engine, know it is healthy, restart it once memory is back.

With an ``engine:`` section (:class:`sparkguard.config.EngineConfig`) the daemon starts the
engine as its own child and keeps it running.  Everything here runs in the
supervisor's own threads; the guard's poll loop only calls the cheap, non-blocking hooks
(:meth:`Supervisor.target`, :meth:`Supervisor.on_guard_event`, :meth:`Supervisor.take_incident`).

One start, in order (each step interruptible by stop / lane / shutdown):

1. **backoff** after an automatic restart: ``backoff_initial * 2**n`` capped at ``backoff_max``;
   ``n`` goes back to 0 after a run that lasted ``stable_after`` seconds.
2. **sweep** what is left of the previous run: every process still in the engine's process
   group (vLLM never calls setsid, FIELD-NOTES) and every process recorded as a descendant
   (also ``VLLM::EngineCore`` / ``VLLM::Worker_TP*`` reparented away when the API server was
   SIGKILLed).  SIGTERM, ``guard.grace``, SIGKILL + process_mrelease.  The dead root is kept as
   an unreaped zombie until then, so its process-group id cannot be reused meanwhile.
3. **guard hold**: no start while a guard incident is open (memory below the SIGTERM line).
4. ``sync`` + drop the page cache (``drop_caches``): vLLM's start-up check on unified memory
   counts page cache as used ("Free memory on device ... less than desired GPU memory
   utilization", FIELD-NOTES); then ``compact_memory`` (``start_gate.compact``).
5. **quiesce gate**: MemAvailable >= ``start_above`` and stable (within ``stable_band``) for
   ``stable_for`` seconds, because memory stranded by a kill comes back only after a while;
   with ``start_gate.memfree`` also MemFree >= utilization x MemTotal + margin in >= 2 MiB
   blocks (:mod:`.memgate`; fragmentation holds the start: docs/start-gate.md).
6. **peers gate**: every ``engine.peers`` reports MemAvailable >= ``start_above``
   (:mod:`sparkguard.peers`).  Past ``quiesce_timeout`` (steps 4-6) it starts anyway and says so.
7. **spawn**: own session and process group, stdin /dev/null, stdout/stderr forwarded line by
   line to the journal under the engine's identifier (last ``log_lines`` kept for incident
   reports), oom_score_adj reset to 0 (the daemon's -1000 would be inherited), NOTIFY_SOCKET
   removed, and for vLLM ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` below ``guard.grace``.
8. **ready** when ``health_url`` answers 200 within ``ready_timeout`` (vLLM's port listens
   only once loaded).  Then the liveness **probe**: a real one-token completion every
   ``probe.interval``; ``probe.failures`` failures in a row = wedged (vLLM's /health answers
   200 while wedged): SIGTERM, grace, SIGKILL, restart, incident of kind ``"wedged"``.
   A headless rank with ``head_url``: once the head had answered 200, a head failing for
   ``head_lost_after`` seconds means stop and restart this rank (vLLM headless ranks do not exit
   by themselves), so it waits at the rendezvous when the head comes back.

Restart reasons (metric label ``reason``): ``exit`` (the engine exited by itself), ``guard``
(the guard signalled it), ``wedged``, ``lane``, ``head``, ``not_ready`` (ready_timeout),
``manual`` (``sparkguard engine restart``), ``link`` (reserved for the link watch).

Threads: one supervisor thread, and per run an exit watcher (pidfd), an output pump and a
monitor (health/probe/head).  The daemon sets ``threading.stack_size`` (512 KiB) before.  The
supervisor thread owns the state: the other threads post events that it applies (:mod:`.core`
says who writes what).

Modules, one concern each:

* :mod:`.core`: :class:`core.Supervisor`, its state, the supervisor thread's main loop and the
  guard's hooks;
* :mod:`.spawn`, :mod:`.stopping`, :mod:`.afterrun`: one run's start; its supervision and stop
  (the one escalation); after its exit: sweep, reap, record, the restart decision;
* :mod:`.api`: the mailbox, and the hooks of the reload, link watch and control threads;
* :mod:`.state`: the status dict, the history, incident engine parts, the state file;
* :mod:`.runthreads`: the exit watcher, output pump and monitor of a run, the gate hooks;
* :mod:`.schedule`: between two runs: the backoff wait, the start gates, the restart decision;
* :mod:`.process`: spawn, exit watch, the run's tree, the sweep of leftovers;
* :mod:`.output`: output forwarding to the journal, the last-lines ring;
* :mod:`.health`: readiness, liveness probe, head watch;
* :mod:`.gates`: hold, drop caches, quiesce and peers gates (fake-clock testable);
* :mod:`.restart`: restart policy and backoff (pure);
* :mod:`.lanes`: lanes, the engine's argv/env, the persisted state file;
* :mod:`.reports`: the engine's part of incident reports, ``wedged`` incidents;
* :mod:`.collector`, :mod:`.render`: metrics and the human status lines;
* :mod:`.run`: the state of one spawned engine.

This package file imports nothing, so that importing one of its modules (the CLI's
``engine`` command needs only :mod:`.render`) loads only that module and what it imports.
"""

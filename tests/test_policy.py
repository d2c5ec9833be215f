"""The pure decision core, driven by a fake clock (no I/O)."""

from sparkguard import policy as P

GiB = 1024**3
LINE = int(0.75 * GiB)


def mk(kill_below=None, grace=10.0, recovery_wait=10.0, dry_run=False):
    return P.Policy(P.Thresholds(term_below=LINE, kill_below=kill_below, grace=grace,
                                 recovery_wait=recovery_wait), dry_run=dry_run)


def test_above_line_does_nothing():
    p = mk()
    for t in range(100):
        assert p.step(t * 0.2, 5 * GiB) == ()
    assert p.state == P.OK


def test_crossing_terms_once_and_exit_closes_when_memory_back():
    p = mk()
    assert p.step(0.0, LINE - 1) == (P.CROSSED, P.TERM)
    assert p.state == P.TERM_SENT
    # still below, victim alive, within grace: nothing, and never a second TERM
    for i in range(1, 49):
        assert p.step(i * 0.2, LINE - 100) == ()
    assert p.step(9.8, LINE - 100, victim_gone=True) == (P.EXITED,)
    assert p.state == P.RECOVERING
    assert p.step(10.0, LINE + 1) == (P.RECOVERED,)
    assert p.state == P.OK


def test_exit_with_memory_already_back_closes_at_once():
    p = mk()
    p.step(0.0, LINE - 1)
    assert p.step(1.5, 2 * GiB, victim_gone=True) == (P.EXITED, P.RECOVERED)
    assert p.state == P.OK


def test_term_ignored_escalates_to_kill_after_grace_and_never_re_terms():
    p = mk(grace=10.0)
    p.step(0.0, LINE - 1)
    assert p.step(9.99, LINE - 1) == ()
    assert p.step(10.0, LINE - 1) == (P.KILL,)
    assert p.state == P.KILL_SENT
    # memory above the line does not cancel escalation of a TERMed victim
    acts = [p.step(10.0 + i * 0.2, 3 * GiB) for i in range(1, 30)]
    assert all(P.TERM not in a for a in acts)
    assert sum(a.count(P.KILL) for a in acts) >= 1  # repeated KILL sweeps, never TERM
    assert p.step(16.0, 3 * GiB, victim_gone=True) == (P.EXITED, P.RECOVERED)


def test_kill_below_cuts_the_grace_short():
    p = mk(kill_below=LINE // 2, grace=30.0)
    p.step(0.0, LINE - 1)
    assert p.step(0.2, LINE // 2 + 1) == ()
    assert p.step(0.4, LINE // 2 - 1) == (P.KILL,)


def test_no_second_victim_while_memory_comes_back():
    p = mk(recovery_wait=10.0)
    p.step(0.0, LINE - 1)
    p.step(1.0, LINE - 1, victim_gone=True)
    # memory still below the line for a while: no new TERM within recovery_wait
    for i in range(1, 49):
        assert p.step(1.0 + i * 0.2, LINE - 10) == ()
    # recovery_wait over and memory still low: the incident closes; the next poll acts again
    assert p.step(11.0, LINE - 10) == (P.GAVE_UP_WAITING,)
    assert p.step(11.2, LINE - 10) == (P.CROSSED, P.TERM)


def test_no_target_retries_and_closes_when_memory_is_back():
    p = mk()
    assert p.step(0.0, LINE - 1) == (P.CROSSED, P.TERM)
    p.no_target(0.0)
    assert p.step(0.5, LINE - 1) == ()
    assert p.step(1.0, LINE - 1) == (P.RETRY_TARGET,)
    p.no_target(1.0)
    assert p.step(1.2, LINE + 5) == (P.RECOVERED,)
    assert p.state == P.OK


def test_target_found_on_retry_starts_grace():
    p = mk(grace=5.0)
    p.step(0.0, LINE - 1)
    p.no_target(0.0)
    assert p.step(1.0, LINE - 1) == (P.RETRY_TARGET,)
    p.target_found(1.0)
    assert p.step(5.9, LINE - 1) == ()
    assert p.step(6.0, LINE - 1) == (P.KILL,)


def test_dry_run_kills_once_and_closes_when_memory_back():
    p = mk(grace=1.0, dry_run=True)
    p.step(0.0, LINE - 1)
    assert p.step(1.0, LINE - 1) == (P.KILL,)
    assert [p.step(1.0 + i, LINE - 1) for i in range(1, 5)] == [()] * 4
    assert p.step(6.0, LINE + 1) == (P.RECOVERED,)


def test_deadline_follows_the_grace_period():
    p = mk(grace=10.0)
    assert p.deadline(0.0) is None
    p.step(0.0, LINE - 1)
    assert p.deadline(4.0) == 6.0


def test_next_interval_shrinks_with_headroom():
    assert P.next_interval(20 * GiB, 0.2) == 0.2
    # headroom / FILL_RATE: memory falling at the assumed rate reaches the line as the next sample is taken
    assert abs(P.next_interval(int(P.FILL_RATE * 0.05), 0.2) - 0.05) < 1e-6
    assert P.next_interval(1024, 0.2) == 0.002
    assert P.next_interval(-5, 0.2) == 0.002
    # monotone: less headroom never means a longer sleep
    xs = [P.next_interval(h, 0.2) for h in range(0, 4 * GiB, 64 * 1024**2)]
    assert xs == sorted(xs)


def test_fast_polling_only_near_a_line_that_matters():
    p = mk(kill_below=LINE // 2)
    assert p.watch_line() == LINE
    p.step(0.0, LINE - 1)
    assert p.watch_line() == LINE // 2          # the grace period can be cut short
    p.step(10.0, LINE - 1)                       # KILL_SENT: only the exit matters
    assert p.watch_line() is None
    p.step(10.2, LINE - 1, victim_gone=True)     # RECOVERING: nothing to act on for recovery_wait
    assert p.state == P.RECOVERING and p.watch_line() is None
    q = mk()                                     # no kill_below: nothing to watch during the grace
    q.step(0.0, LINE - 1)
    assert q.watch_line() is None


def test_a_victim_that_cannot_die_is_given_up_and_the_next_crossing_chooses_again():
    p = mk(grace=1.0)
    p.step(0.0, LINE - 1)
    assert p.step(1.0, LINE - 1) == (P.KILL,)
    acts = [p.step(1.0 + 0.5 * i, LINE - 1) for i in range(1, 59)]      # up to t = 30.0
    assert all(a in ((), (P.KILL,)) for a in acts)
    assert p.step(31.0, LINE - 1) == (P.UNKILLABLE,)
    assert p.state == P.OK
    assert p.step(31.2, LINE - 1) == (P.CROSSED, P.TERM)


def test_the_grace_runs_from_the_sigterm_not_from_the_crossing_sample():
    # choosing and signalling the victim took 80 ms after the sample that crossed
    p = mk(grace=2.0)
    assert p.step(100.0, LINE - 1) == (P.CROSSED, P.TERM)
    p.term_sent_at(100.08)
    assert p.step(102.05, LINE - 100) == ()
    assert p.step(102.08, LINE - 100) == (P.KILL,)


def test_a_joined_escalation_keeps_the_first_sigterms_grace():
    # the guard joined the supervisor's escalation: its SIGTERM went out 4 s before the crossing
    p = mk(grace=10.0)
    assert p.step(100.0, LINE - 1) == (P.CROSSED, P.TERM)
    p.term_sent_at(96.0)
    assert p.step(105.9, LINE - 100) == ()
    assert p.step(106.0, LINE - 100) == (P.KILL,)
    assert p.state == P.KILL_SENT


# ---- the rate trigger and the load phase (docs/rate.md) ------------------------------------------

def mk_rate(lead=1.0, rate_min=256 * 1024**2, load=None):
    return P.Policy(P.Thresholds(term_below=LINE, kill_below=None, grace=10.0, rate_lead=lead, rate_min=rate_min,
                                 load=load))


def test_a_fall_that_would_cross_within_the_lead_terms_before_the_line():
    p = mk_rate(lead=1.0)
    # 2 GiB/s, 3 GiB above the line: 1.5 s away, not yet
    assert p.step(0.0, LINE + 3 * GiB, fall_rate=2 * GiB) == ()
    # 1.5 GiB above: 0.75 s away, inside the lead
    assert p.step(0.1, LINE + int(1.5 * GiB), fall_rate=2 * GiB) == (P.CROSSED, P.TERM)
    assert p.state == P.TERM_SENT
    assert p.fired == {"trigger": "predicted", "phase": "serving", "line_bytes": LINE,
                       "fall_rate_bytes_per_second": 2 * GiB, "seconds_to_line": 0.75}


def test_a_slow_fall_and_a_rise_never_predict_and_the_line_still_acts():
    p = mk_rate(lead=10.0, rate_min=512 * 1024**2)
    assert p.step(0.0, LINE + 100, fall_rate=256 * 1024**2) == ()     # below rate_min: never predicted
    assert p.step(0.1, LINE + 100, fall_rate=0.0) == ()
    assert p.step(0.2, LINE - 1, fall_rate=0.0) == (P.CROSSED, P.TERM)
    assert p.fired["trigger"] == "line" and p.fired["seconds_to_line"] == 0.0


def test_without_a_lead_the_fall_rate_changes_nothing():
    p = mk()
    assert p.step(0.0, LINE + 1, fall_rate=100 * GiB) == ()
    assert p.trigger(LINE + 1, 100 * GiB) is None


def test_a_predicted_trigger_without_a_target_waits_until_the_fall_stops():
    p = mk_rate(lead=1.0)
    assert p.step(0.0, LINE + GiB, fall_rate=2 * GiB) == (P.CROSSED, P.TERM)
    p.no_target(0.0)
    # above the line but still predicted to cross: the same incident, no RECOVERED/CROSSED churn
    assert p.step(0.2, LINE + GiB, fall_rate=2 * GiB) == ()
    assert p.step(1.0, LINE + GiB, fall_rate=2 * GiB) == (P.RETRY_TARGET,)
    p.no_target(1.0)
    assert p.step(1.2, LINE + GiB, fall_rate=0.0) == (P.RECOVERED,)


def test_while_loading_the_load_lines_apply_and_the_incident_is_a_failed_load():
    load = P.LoadLines(term_below=LINE // 2, rate_lead=0.0, rate_min=0.0)
    p = mk_rate(lead=1.0, load=load)
    # a load's steep fall by design: the serving lead would fire here, the load's (0: line alone) does not
    assert p.trigger(LINE + GiB, 3 * GiB, loading=False) == "predicted"
    assert p.step(0.0, LINE + GiB, fall_rate=3 * GiB, loading=True) == ()
    assert p.step(0.1, LINE - 1, fall_rate=3 * GiB, loading=True) == ()      # above the load's own line
    assert p.step(0.2, LINE // 2 - 1, fall_rate=3 * GiB, loading=True) == (P.CROSSED, P.TERM)
    assert p.fired["phase"] == "loading" and p.fired["trigger"] == "line" and p.fired["line_bytes"] == LINE // 2
    # the fast path's line covers both phases
    assert p.lines(True)[0] == LINE // 2 and p.lines(False)[0] == LINE


def test_a_load_lead_stops_a_load_predicted_to_cross_its_line():
    p = mk_rate(lead=1.0, load=P.LoadLines(term_below=LINE, rate_lead=2.0, rate_min=GiB))
    assert p.step(0.0, LINE + 5 * GiB, fall_rate=2 * GiB, loading=True) == ()
    assert p.step(0.5, LINE + 3 * GiB, fall_rate=2 * GiB, loading=True) == (P.CROSSED, P.TERM)
    assert p.fired["phase"] == "loading" and p.fired["trigger"] == "predicted"
    assert p.fired["seconds_to_line"] == 1.5


def test_memory_back_on_the_per_cpu_lists_extends_the_wait_instead_of_a_second_victim():
    # the victim's memory went to the kernel's per-CPU lists (sparkguard.pcp), outside MemAvailable:
    # past recovery_wait the wait goes on while MemAvailable + the lists is above the line
    p = mk(recovery_wait=10.0)
    p.step(0.0, LINE - 1)
    assert p.counts_pcp(1.0, victim_gone=True) is False          # nothing asked before RECOVERING
    assert p.step(1.0, LINE - 100, victim_gone=True) == (P.EXITED,)
    assert p.counts_pcp(10.9, victim_gone=False) is False
    assert p.counts_pcp(11.0, victim_gone=False) is True
    assert p.deadline(5.0) == 6.0
    assert p.step(11.0, LINE - 100, pcp_free=100) == ()          # back, on the lists
    assert p.state == P.RECOVERING and p.t_drain == 11.0 and p.v_drain == LINE - 100
    assert p.deadline(11.0) == P.PCP_DRAIN_WAIT                  # the cap is the next deadline
    assert p.step(40.0, LINE - 50, pcp_free=60) == ()
    assert p.step(41.0, LINE) == (P.RECOVERED,)                  # MemAvailable alone is back
    assert p.state == P.OK and p.counts_pcp(42.0, victim_gone=True) is False
    assert p.step(42.0, LINE - 1) == (P.CROSSED, P.TERM) and p.t_drain is None   # a new incident


def test_the_wait_on_the_lists_ends_when_they_no_longer_lift_it_or_at_the_cap():
    p = mk(recovery_wait=10.0)
    p.step(0.0, LINE - 1)
    p.step(1.0, LINE - 100, victim_gone=True)
    assert p.step(11.0, LINE - 100, pcp_free=200) == ()
    assert p.step(12.0, LINE - 100, pcp_free=99) == (P.GAVE_UP_WAITING,)   # consumed again: act again
    q = mk(recovery_wait=10.0)
    q.step(0.0, LINE - 1)
    q.step(1.0, LINE - 100, victim_gone=True)
    assert q.step(11.0 + P.PCP_DRAIN_WAIT - 0.1, LINE - 100, pcp_free=GiB) == ()
    assert q.step(11.0 + P.PCP_DRAIN_WAIT, LINE - 100, pcp_free=GiB) == (P.GAVE_UP_WAITING,)


def test_the_wait_on_the_lists_ends_when_memavailable_falls_though_the_lists_stay_full():
    # a hog that is not a target goes on after the victim is gone: the lists of the CPUs that freed
    # the victim stay full (reclaim runs before they are drained), MemAvailable alone falls
    p = mk(recovery_wait=10.0)
    p.step(0.0, LINE - 1)
    p.step(1.0, LINE // 2, victim_gone=True)
    assert p.step(11.0, LINE // 2, pcp_free=4 * GiB) == ()
    assert p.step(11.2, LINE // 2 - P.DRAIN_SLACK, pcp_free=4 * GiB) == ()        # within the slack
    assert p.step(11.4, LINE // 2 - P.DRAIN_SLACK - 1, pcp_free=4 * GiB) == (P.GAVE_UP_WAITING,)
    assert p.step(11.6, LINE // 2 - P.DRAIN_SLACK - 1, pcp_free=4 * GiB) == (P.CROSSED, P.TERM)


def test_the_wait_on_the_lists_ends_below_kill_below():
    p = mk(recovery_wait=10.0, kill_below=LINE // 2)
    p.step(0.0, LINE - 1)
    p.step(1.0, LINE // 2 + 10, victim_gone=True)
    assert p.step(11.0, LINE // 2 + 10, pcp_free=GiB) == ()
    assert p.step(11.2, LINE // 2 - 1, pcp_free=GiB) == (P.GAVE_UP_WAITING,)


def test_free_pages_on_the_per_cpu_lists_never_delay_or_cancel_an_action():
    # the crossing and the escalation look at the signal alone: lists that would lift it above
    # the line do not stop the SIGTERM, nor the SIGKILL after the grace
    p = mk(grace=2.0)
    assert p.step(0.0, LINE - 1, pcp_free=4 * GiB) == (P.CROSSED, P.TERM)
    assert p.step(2.0, LINE - 1, pcp_free=4 * GiB) == (P.KILL,)
    assert p.step(2.5, LINE - 1, victim_gone=True, pcp_free=4 * GiB) == (P.EXITED,)
    assert p.step(5.0, LINE - 1, pcp_free=4 * GiB) == ()                    # still within recovery_wait


def test_no_recovery_wait_means_no_wait_on_the_lists_either():
    # guard.recovery_wait: 0 asks to act again at once: the lists do not add a wait
    p = mk(recovery_wait=0.0)
    p.step(0.0, LINE - 1)
    assert p.counts_pcp(1.0, victim_gone=True) is False
    assert p.step(1.0, LINE - 100, victim_gone=True, pcp_free=GiB) == (P.EXITED, P.GAVE_UP_WAITING)

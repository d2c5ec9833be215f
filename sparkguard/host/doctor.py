"""``sparkguard doctor``: check this host against what the guard needs.

Each check returns a :class:`Check` with a verdict (PASS, WARN, FAIL, or INFO for facts
that are neither), a one-line message with the measured values, and the fix.  A check
that cannot run (an odd /proc, a missing tool) is a WARN saying so; doctor itself never
dies of one.  Exit status: 1 when any check FAILs, else 0.

The checks live by area: :mod:`~sparkguard.host.doctor_memory` (zram, sysctls, PSI, page cache,
container), :mod:`~sparkguard.host.doctor_guard` (the running guard),
:mod:`~sparkguard.host.doctor_engine` (engines and other killers); what they share is
:mod:`~sparkguard.host.doctor_base`.  This module runs them in :data:`CHECKS` order and prints
the report.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Callable

from sparkguard import config
from sparkguard.host import virt
from sparkguard.host.doctor_base import FAIL, INFO, PASS, WARN, Check, Context
from sparkguard.host.doctor_engine import (check_engine_restart_policy, check_engine_sandbox, check_engine_timeout,
                                           check_nvidia, check_other_killers)
from sparkguard.host.doctor_guard import (check_guard_priority, check_hidepid, check_links, check_memlock,
                                          check_metrics, check_unit)
from sparkguard.host.doctor_memory import (HOST_ONLY, check_boot_sysctls, check_container, check_min_free,
                                           check_page_cache, check_page_cluster, check_psi, check_swappiness,
                                           check_watermark, check_zram)
from sparkguard.host.files import HostError

def _host_fixes(checks: list[Check]) -> None:
    """Say "on the host" in the fixes that cannot be carried out here (HOST_ONLY, read-only)."""
    for c in checks:
        path = HOST_ONLY.get(c.name)
        if path and c.fix and c.status in (WARN, FAIL) and (m := virt.read_only_mount(path)):
            c.fix = f"on the host ({m.point} is read-only here): {c.fix}"


CHECKS: list[Callable[[Context], Check]] = [
    check_zram, check_swappiness, check_watermark, check_page_cluster, check_min_free, check_boot_sysctls,
    check_memlock, check_psi, check_hidepid, check_unit, check_guard_priority, check_other_killers, check_container,
    check_engine_sandbox, check_engine_timeout, check_engine_restart_policy,
    check_page_cache, check_nvidia,
    check_links,
    check_metrics,
]


def run_checks(ctx: Context) -> list[Check]:
    """Every check in :data:`CHECKS`; one that raises becomes a WARN naming the error."""
    out = []
    for fn in CHECKS:
        name = fn.__name__.removeprefix("check_")
        try:
            out.append(fn(ctx))
        except Exception as e:  # noqa: BLE001 - a broken check must not hide the others
            out.append(Check(name, WARN, f"check could not run: {type(e).__name__}: {e}"))
    _host_fixes(out)
    return out


def doctor(args) -> int:
    """Handler of ``sparkguard doctor``: prints the verdicts (or JSON); 1 on any FAIL."""
    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        raise HostError(f"cannot check against the configuration: {e}") from None
    checks = run_checks(Context(cfg, args.gpu_memory_utilization))
    status = 1 if any(c.status == FAIL for c in checks) else 0
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "counts": counts, "config": cfg.path,
                          "exit_status": status}, indent=2, default=str))
        return status
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        if c.fix and c.status != PASS:
            print(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    print(f"\n{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail, {counts[INFO]} info")
    return status


"""What the supervisor tracks as the engine's processes, and why: the status's ``tracking`` entry.

Three things can make up a run's tree (:mod:`.process`): the run's own cgroup or its process
group (:mod:`.cgroup`: the mode in force and why, including how systemd's delegation was found,
:mod:`.cgroup_delegation`), and for a ``docker|podman run`` engine the container's cgroup, found
from the runtime's ``State.Pid`` (:mod:`.container`).  For a container engine the client (the
process sparkguard spawned) is only the front: what is tracked, signalled and waited for is the
container's cgroup, and the status says so.
"""

from __future__ import annotations

from sparkguard.supervisor import cgroup as cgroups

#: ``tracks`` values: what the tree is
ENGINE = "engine"                #: the spawned process's own tree
CONTAINER = "container"          #: a container engine: the container's cgroup (+ the client)


def status(placement, run) -> dict:
    """The ``tracking`` entry of the supervisor's status.

    Args:
        placement: :class:`cgroup.Placement` (None: not decided yet).  run: the current ``Run`` or None.
    Returns:
        dict: ``mode`` (``cgroup`` / ``process-group``: how the spawned process's tree is held; the
        current run's, or between runs the next start's), ``cgroup`` (the run's cgroup or None),
        ``parent``, ``why`` (the placement's reason), ``delegation`` (``xattr``, ``write-test`` or
        ``""``), ``tracks`` (:data:`ENGINE` / :data:`CONTAINER`), ``container`` (``{"id", "name",
        "pid", "cgroup"}`` once known, else None) and ``detail`` (one line for ``engine status``).
    """
    pl = placement or cgroups.Placement(cgroups.PGROUP, None, "not decided yet")
    cg = run.cgroup if run is not None else None
    in_cgroup = cg is not None if run is not None else pl.mode == cgroups.CGROUP
    detail = cgroups.describe(pl, cg, run=run is not None)
    if pl.delegation and in_cgroup:
        detail += f" [delegation: {pl.delegation.replace('-', ' ')}]"
    launch = getattr(run, "launch", None) if run is not None else None
    ctr = getattr(run, "container", None) if run is not None else None
    if ctr is not None:
        where = ctr.cgroup or "(its cgroup not found here)"
        detail = (f"{ctr.label()}: its cgroup {where} (init pid {ctr.pid}, from {launch.runtime}'s State.Pid); "
                  f"the client: {detail}")
    elif launch is not None:
        detail = (f"container not known yet ({launch.runtime} has not reported its State.Pid): the client only, "
                  f"{detail}")
    return {"mode": cgroups.CGROUP if in_cgroup else cgroups.PGROUP, "cgroup": cg.path if cg is not None else None,
            "parent": pl.parent, "why": pl.reason, "delegation": pl.delegation,
            "tracks": CONTAINER if launch is not None else ENGINE,
            "container": ctr.as_dict() if ctr is not None else None, "detail": detail}

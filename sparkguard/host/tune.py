"""``sparkguard tune`` and ``sparkguard install-zram``: the two commands that change the
running kernel, each also persisting what it set for the next boot."""

from __future__ import annotations

import os

from sparkguard import __version__
from sparkguard.host import sysctl, zram, zramboot, zramdev
from sparkguard.host.files import Changes, HostError, Manifest, remove_empty_dirs
from sparkguard.host.systemctl import systemctl, systemd_running
from sparkguard.units import parse_size


def tune(args) -> int:
    """Handler of ``sparkguard tune``; returns the exit status.

    Values: the persisted file's (or the defaults), then the command-line options.
    Exit 2 when a guard rail refuses (nothing is changed then; under --dry-run the whole plan
    is printed first, then the refusal), 1 when a write fails.
    """
    root = os.path.abspath(args.root)
    ch = Changes(args.dry_run)
    persisted = sysctl.read_persisted(root)
    if args.boot:
        if persisted is None:
            ch.info(f"{sysctl.SYSCTL_FILE} is absent: nothing to apply")
            return 0
        values = persisted
    else:
        values = dict(sysctl.DEFAULTS)
        values.update(persisted or {})
        for opt, key in (("swappiness", "vm.swappiness"), ("watermark_scale_factor", "vm.watermark_scale_factor"),
                         ("page_cluster", "vm.page-cluster")):
            if getattr(args, opt) is not None:
                values[key] = getattr(args, opt)
    sysctl.check_ranges(values)
    if not args.no_apply:
        sysctl.check_writable()
    refusals = sysctl.guard_rails(values, sysctl.fast_swap())
    refused = bool(refusals) and not (args.force or args.boot)
    if refused and not ch.dry_run:
        _refuse(ch, refusals)
        ch.info("nothing changed; --force sets these values anyway (--dry-run shows every step)")
        return 2
    if not refused:
        for r in refusals:
            ch.warn(f"{r.key} = {r.value}: {r.reason}")
    manifest = Manifest(root)
    if not args.no_apply:
        sysctl.apply(ch, values)
    if not (args.no_persist or args.boot):
        sysctl.persist(ch, root, values, manifest)
        if not ch.dry_run:
            manifest.save(__version__)
        for f, k, v in sysctl.overrides(root, values):
            ch.warn(f"{f} sets {k} = {v}, which is applied after {sysctl.SYSCTL_FILE} at boot and undoes "
                    f"{values[k]}; remove that line (sparkguard-setup.service re-applies ours after systemd-sysctl)")
    ch.summary()
    if refused:  # dry run: the plan above, and why a real run would not carry it out
        _refuse(ch, refusals)
        ch.info("a run without --dry-run changes nothing; --force sets these values anyway")
        return 2
    return 0


def _refuse(ch: Changes, refusals: list) -> None:
    for r in refusals:
        ch.info(f"refused: {r.key} = {r.value}: {r.reason}.")


def install_zram(args) -> int:
    """Handler of ``sparkguard install-zram``; returns the exit status."""
    root = os.path.abspath(args.root)
    ch = Changes(args.dry_run)
    device = zramdev.device_name(args.device) if args.device else None
    # the generator owns zram0 on a systemd machine: let it set the device up
    generator_live = (root == "/" and systemd_running() and device is None and not args.boot
                      and zramboot.generator_installed("/"))

    if not args.no_now and not generator_live:
        zramdev.check_writable()
    manifest = Manifest(root)
    if args.remove:
        if not args.boot:
            zramboot.unpersist(ch, root, manifest)
            if not ch.dry_run:
                manifest.save(__version__)
            remove_empty_dirs(ch, root, "/etc/sparkguard", "/var/lib/sparkguard")
        if generator_live:
            systemctl(ch, "daemon-reload")
            systemctl(ch, "restart", "systemd-zram-setup@zram0.service", check=False)
        if not args.no_now:
            zram.remove_now(ch, device)
        ch.summary()
        return 0

    if args.boot:
        settings = zramboot.read_conf(root)
        if settings is None:
            ch.info(f"{zramboot.CONF_PATH} is absent (zram not configured, or owned by systemd-zram-generator): "
                    "nothing to do")
            return 0
    else:
        settings = zram.ZramSettings(parse_size(args.size) if isinstance(args.size, str) else args.size,
                                     args.priority, args.algorithm)
    zram.validate(settings)
    if not args.no_now:
        if generator_live:
            zramboot.persist(ch, root, settings, manifest)
            systemctl(ch, "daemon-reload")
            systemctl(ch, "restart", "systemd-zram-setup@zram0.service")
            systemctl(ch, "start", "dev-zram0.swap")
        else:
            name = zram.apply_now(ch, settings, device, boot=args.boot)
            if not ch.dry_run:
                st = zramdev.state(name)
                if not st["swap"]:
                    raise HostError(f"/dev/{name} was set up but does not show in /proc/swaps")
        zram.check_priority(ch, settings.priority)
    # with the generator live, "now" above already wrote its config; --no-now still must
    if not (args.boot or args.no_persist) and not (generator_live and not args.no_now):
        zramboot.persist(ch, root, settings, manifest)
    if not (args.boot or ch.dry_run):
        manifest.save(__version__)
    ch.summary()
    return 0

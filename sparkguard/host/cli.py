"""Sub-commands install, uninstall, install-zram, tune and doctor.

Only argparse at import time (``sparkguard run`` imports every command module); the
handlers import their modules when called.  Exit statuses: 0 done (or nothing to do),
1 failed, 2 refused (a guard rail) or bad input; doctor: 1 when a check FAILs.
"""

from __future__ import annotations

import argparse
import sys


def _size(text: str) -> int:
    from sparkguard.units import parse_size

    try:
        v = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be greater than 0, got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.9, got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return v


def _handler(module: str, func: str):
    def run(args) -> int:
        import importlib

        from sparkguard.host.files import HostError

        try:
            return getattr(importlib.import_module(module), func)(args)
        except HostError as e:
            print(f"sparkguard {args.command}: error: {e}", file=sys.stderr)
            return e.status
        except PermissionError as e:
            print(f"sparkguard {args.command}: error: {e} (run as root)", file=sys.stderr)
            return 1
    return run


def _root(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--root", default="/", metavar="DIR",
                   help=f"{what} under DIR instead of / (packaging, containers; default /)")


def _dry(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print every step, change nothing")


def register(sub) -> None:
    """Add the host set-up sub-commands to ``sub`` (an argparse subparsers object)."""
    from sparkguard import host as _z  # the package itself imports nothing

    p = sub.add_parser("install", help="put units, sysctl file, zram config and default config in place",
                       description="Install the systemd units (ExecStart: this interpreter), the sysctl file, "
                       "the zram boot configuration and a commented default /etc/sparkguard/sparkguard.yaml. "
                       "Keeps a file edited since sparkguard wrote it unless --force (never the config: --force "
                       "writes the new default beside it as sparkguard.yaml.dist). With an engine: command in "
                       "the config (or --engine-sandbox) also the drop-in sparkguard.service.d/engine.conf that "
                       "relaxes the sandbox for the engine. Runs systemctl daemon-reload when systemd runs this "
                       "machine. Idempotent.")
    _root(p, "install (DIR is created when missing)")
    _dry(p)
    p.add_argument("--python", metavar="PATH", help="interpreter the units run, as seen inside the root "
                   f"(default: this one, {sys.executable})")
    p.add_argument("--zram-size", type=_size, metavar="SIZE", help="zram swap size for the boot configuration "
                   "(default: what sparkguard configured before, else 6GiB)")
    p.add_argument("--zram-priority", type=int, metavar="N", help="default: as configured before, else 100")
    p.add_argument("--zram-algorithm", metavar="NAME", help="default: as configured before, else lz4")
    p.add_argument("--no-zram", action="store_true", help="do not install a zram boot configuration")
    p.add_argument("--force", action="store_true", help="replace files edited since sparkguard wrote them "
                   "(units, sysctl file, zram config, drop-in); an edited config is kept and the new default "
                   "written beside it as sparkguard.yaml.dist")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--engine-sandbox", dest="engine_sandbox", action="store_true", default=None,
                   help="install the engine sandbox drop-in even without an engine: command in the config")
    g.add_argument("--no-engine-sandbox", dest="engine_sandbox", action="store_false",
                   help="remove the engine sandbox drop-in (guard-only sandbox)")
    p.add_argument("--prometheus-rules", metavar="DIR", help="also copy sparkguard-rules.yml into DIR (under --root, like every file)")
    p.add_argument("--grafana-dashboard", metavar="DIR", help="also copy sparkguard-dashboard.json into DIR (under --root, like every file)")
    p.set_defaults(func=_handler("sparkguard.host.install", "install"))

    p = sub.add_parser("uninstall", help="remove what install put in place (keeps incidents unless --purge)",
                       description="Stop and disable the guard (when systemd runs), remove the units, drop-in, "
                       "sysctl file and zram boot configuration. Keeps (and names) every file edited since "
                       "sparkguard wrote it, and the incident records, unless --purge. Idempotent.")
    _root(p, "uninstall")
    _dry(p)
    p.add_argument("--purge", action="store_true", help="also remove edited files, the config file and "
                   "/var/lib/sparkguard (incidents)")
    p.set_defaults(func=_handler("sparkguard.host.install", "uninstall"))

    p = sub.add_parser("install-zram", help="set up a zram swap now and at boot",
                       description="Set up a zram swap now (hot_add a device, comp_algorithm, disksize, mkswap, "
                       "swapon) and make it survive reboots (systemd-zram-generator's config when installed, "
                       "else /etc/sparkguard/zram.conf for sparkguard-setup.service). Idempotent.")
    p.add_argument("--size", type=_size, default=_z.ZRAM_DEFAULT_SIZE, metavar="SIZE", help="default 6GiB")
    p.add_argument("--priority", type=int, default=_z.ZRAM_DEFAULT_PRIORITY, metavar="N",
                   help="swap priority, above any file swap (default 100)")
    p.add_argument("--algorithm", default=_z.ZRAM_DEFAULT_ALGORITHM, metavar="NAME",
                   help="compression algorithm: lz4, zstd, lzo-rle... (default lz4)")
    p.add_argument("--device", metavar="zramN", help="use this existing, free device instead of a new one")
    p.add_argument("--remove", action="store_true", help="undo: swapoff, reset and remove our device(s), "
                   "drop the boot configuration")
    p.add_argument("--no-now", action="store_true", help="only write the boot configuration")
    p.add_argument("--no-persist", action="store_true", help="only set up the swap now")
    p.add_argument("--boot", action="store_true", help="set up the swap of /etc/sparkguard/zram.conf "
                   "(what sparkguard-setup.service runs at boot); writes no files")
    _root(p, "write the boot configuration")
    _dry(p)
    p.set_defaults(func=_handler("sparkguard.host.tune", "install_zram"))

    p = sub.add_parser("tune", help="apply and persist the memory sysctls",
                       description="Set vm.swappiness, vm.watermark_scale_factor and vm.page-cluster now and "
                       "persist them in /etc/sysctl.d/99-zz-sparkguard.conf. Values: that file's, or 180/100/0, "
                       "then the options. Refuses watermark_scale_factor above 200 and swappiness above 100 "
                       "without zram, unless --force.")
    p.add_argument("--swappiness", type=int, metavar="N", help="0-200 (default: the persisted file's, else 180; "
                   "above 100 is refused while no zram or zswap is active: run install-zram first, or use 60)")
    p.add_argument("--watermark-scale-factor", type=int, metavar="N", help="1-3000, in 1/10000 (default: the "
                   "persisted file's, else 100; above 200 is refused)")
    p.add_argument("--page-cluster", type=int, metavar="N", help="0-31, log2 pages per swap read (default: the "
                   "persisted file's, else 0)")
    p.add_argument("--force", action="store_true", help="set values a guard rail refuses")
    p.add_argument("--no-apply", action="store_true", help="only write the file")
    p.add_argument("--no-persist", action="store_true", help="only apply now")
    p.add_argument("--boot", action="store_true", help="apply the persisted file now (sparkguard-setup.service)")
    _root(p, "persist")
    _dry(p)
    p.set_defaults(func=_handler("sparkguard.host.tune", "tune"))

    p = sub.add_parser("doctor", help="check this host against what the guard needs",
                       description="One PASS/WARN/FAIL/INFO line per check, with the fix. Exit 1 on any FAIL.")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--config", metavar="PATH", help="configuration to check against "
                   "(default /etc/sparkguard/sparkguard.yaml or the built-in defaults)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                   help="the engine's --gpu-memory-utilization, for the page-cache check (default: the "
                        "configured engine's, else vLLM's default 0.92)")
    p.set_defaults(func=_handler("sparkguard.host.doctor", "doctor"))

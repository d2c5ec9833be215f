"""``sparkguard install`` and ``sparkguard uninstall``.

install puts in place (under ``--root``, default ``/``):

==========================================  ===============================================
/etc/systemd/system/sparkguard.service      the guard (systemd/sparkguard.service)
/etc/systemd/system/sparkguard-setup.service  zram + sysctls at boot, before the guard
/etc/sysctl.d/99-zz-sparkguard.conf         the memory sysctls (sysctl.d/)
/etc/sparkguard/zram.conf                   zram at boot, or our [zram0] in
                                            /etc/systemd/zram-generator.conf (zram/)
/etc/sparkguard/sparkguard.yaml             commented default configuration
/var/lib/sparkguard/installed.json          sha256 of what install wrote
==========================================  ===============================================

A file that differs from what install last wrote (edited by a person, by ``tune`` or by
``install-zram``) is kept and reported, never overwritten.  It changes nothing live
except ``systemctl daemon-reload`` when systemd runs this machine and the root is ``/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from sparkguard import __version__
from sparkguard.host import configfile, sysctl, zram
from sparkguard.host.files import (Changes, HostError, Manifest, MANIFEST_PATH, in_root, install_file,
                                   read_text, remove_empty_dirs, remove_file, shipped)
from sparkguard.host.systemctl import systemctl, systemd_running

UNIT_DIR = "/etc/systemd/system"
UNITS = ("sparkguard.service", "sparkguard-setup.service")
CONFIG_PATH = "/etc/sparkguard/sparkguard.yaml"
STATE_DIR = "/var/lib/sparkguard"

#: package data the link engineer ships: (option, resource, file name it is installed as)
EXTRAS = {
    "prometheus_rules": ("prometheus/sparkguard-rules.yml", "sparkguard-rules.yml"),
    "grafana_dashboard": ("grafana/sparkguard-dashboard.json", "sparkguard-dashboard.json"),
}


def package_parent() -> str:
    """The folder that holds this ``sparkguard`` package (site-packages or a checkout)."""
    import sparkguard

    return os.path.dirname(os.path.dirname(os.path.realpath(sparkguard.__file__)))


def needs_pythonpath(python: str) -> str | None:
    """The PYTHONPATH a unit needs for ``python -m sparkguard`` to run *this* sparkguard.

    Runs ``python`` from ``/`` without PYTHONPATH and asks where it finds sparkguard;
    returns :func:`package_parent` when that is somewhere else (a checkout, or another
    install), None when the interpreter finds this one by itself.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    code = "import os, sparkguard; print(os.path.dirname(os.path.dirname(os.path.realpath(sparkguard.__file__))))"
    try:
        p = subprocess.run([python, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return package_parent()
    here = package_parent()
    return None if p.returncode == 0 and p.stdout.strip() == here else here


def render_unit(name: str, python: str, pythonpath: str | None) -> str:
    """Unit ``name`` from systemd/ with ``@PYTHON@`` and ``@ENVIRONMENT@`` filled in.

    Raises:
        HostError: ``python`` is not an absolute path (systemd needs one for ExecStart).
    """
    if not os.path.isabs(python) or any(c.isspace() for c in python):
        raise HostError(f"--python {python!r}: ExecStart needs an absolute path without spaces", 2)
    env = f"Environment=PYTHONPATH={pythonpath}\n" if pythonpath else ""
    return shipped(f"host/systemd/{name}").replace("@PYTHON@", python).replace("@ENVIRONMENT@", env)


def _extras(args) -> list[tuple[str, str, str]]:
    """(resource text, destination dir, file name) for --prometheus-rules / --grafana-dashboard.

    Checked before anything is written, so a missing file changes nothing.
    """
    out = []
    for opt, (res, fname) in EXTRAS.items():
        dest = getattr(args, opt, None)
        if dest:
            if not os.path.isabs(dest):
                raise HostError(f"--{opt.replace('_', '-')} {dest!r}: expected an absolute folder", 2)
            out.append((shipped(res), dest, fname))
    return out


def install(args) -> int:
    """Handler of ``sparkguard install``; returns the exit status (see README "Host set-up")."""
    root = os.path.abspath(args.root)
    ch = Changes(args.dry_run)
    if not os.path.isdir(root):
        raise HostError(f"--root {args.root}: no such folder", 2)
    extras = _extras(args)
    python = args.python or sys.executable
    pythonpath = None if args.python else needs_pythonpath(python)
    if pythonpath:
        ch.info(f"note: {python} does not import this sparkguard by itself; the units set PYTHONPATH={pythonpath}")
    settings = zram.ZramSettings(args.zram_size, args.zram_priority, args.zram_algorithm)
    zram.validate(settings)
    manifest = Manifest(root)

    for unit in UNITS:
        install_file(ch, root, f"{UNIT_DIR}/{unit}", render_unit(unit, python, pythonpath), manifest)
    install_file(ch, root, sysctl.SYSCTL_FILE, sysctl.render(sysctl.DEFAULTS), manifest)
    if args.no_zram:
        ch.note("skipped", "zram boot configuration", "--no-zram")
    elif (where := zram.configured(root)):
        if zram.persisted_as(root, settings):
            ch.note("unchanged", where)
        else:
            ch.note("kept", where, "zram configured otherwise before; change it with sparkguard install-zram")
    else:
        zram.persist(ch, root, settings)
    install_file(ch, root, CONFIG_PATH, configfile.render(), manifest)
    for text, dest, fname in extras:
        install_file(ch, root, f"{dest.rstrip('/')}/{fname}", text, manifest)
    if not ch.dry_run:
        manifest.save(__version__)

    live = root == "/" and systemd_running()
    if live:
        systemctl(ch, "daemon-reload")
    elif root == "/":
        ch.info("systemd is not running this machine: skipped systemctl daemon-reload")
    ch.summary()
    if root == "/":
        ch.info("next: systemctl enable --now sparkguard   (sparkguard-setup.service applies zram and sysctls "
                "first; `sparkguard doctor` checks the result)")
    else:
        ch.info(f"next, inside {root}: systemctl enable sparkguard")
    return 0


def _default_config_untouched(text: str, manifest: Manifest) -> bool:
    try:
        return text == configfile.render() or manifest.untouched(CONFIG_PATH, text)
    except RuntimeError:
        return manifest.untouched(CONFIG_PATH, text)


def uninstall(args) -> int:
    """Handler of ``sparkguard uninstall``; returns the exit status."""
    root = os.path.abspath(args.root)
    ch = Changes(args.dry_run)
    if not os.path.isdir(root):
        raise HostError(f"--root {args.root}: no such folder", 2)
    manifest = Manifest(root)
    live = root == "/" and systemd_running()
    if live and os.path.exists(f"{UNIT_DIR}/sparkguard.service"):
        systemctl(ch, "disable", "--now", "sparkguard.service", check=False)
        systemctl(ch, "stop", "sparkguard-setup.service", check=False)

    for unit in UNITS:
        remove_file(ch, root, f"{UNIT_DIR}/{unit}")
        manifest.forget(f"{UNIT_DIR}/{unit}")
    remove_file(ch, root, sysctl.SYSCTL_FILE)
    manifest.forget(sysctl.SYSCTL_FILE)
    zram.unpersist(ch, root)
    # extras (prometheus rules, dashboards) recorded by install
    for path in [p for p in manifest.files if p != CONFIG_PATH]:
        remove_file(ch, root, path)
        manifest.forget(path)

    cfg = read_text(in_root(root, CONFIG_PATH))
    if cfg is not None:
        if args.purge or _default_config_untouched(cfg, manifest):
            remove_file(ch, root, CONFIG_PATH)
        else:
            ch.note("kept", CONFIG_PATH, "edited by you; --purge removes it")
    manifest.forget(CONFIG_PATH)
    remove_file(ch, root, MANIFEST_PATH)
    remove_empty_dirs(ch, root, "/etc/sparkguard")

    state = in_root(root, STATE_DIR)
    if args.purge:
        if os.path.isdir(state):
            if not ch.dry_run:
                shutil.rmtree(state)
            ch.note("removed", STATE_DIR + "/", "--purge: incidents and state")
    else:
        remove_empty_dirs(ch, root, STATE_DIR)
        if os.path.isdir(state) and not (ch.dry_run and not os.listdir(state)):
            if os.path.exists(os.path.join(state, "incidents")):
                ch.note("kept", STATE_DIR + "/incidents/", "incident records; --purge removes them")
    if live:
        systemctl(ch, "daemon-reload")
    ch.summary()
    if root == "/":
        ch.info("live state is left as it is: `sparkguard install-zram --remove` takes the zram swap away; "
                "sysctls return to the kernel defaults at the next boot")
    return 0

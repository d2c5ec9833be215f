"""``sparkguard install`` and ``sparkguard uninstall``.

install puts in place (under ``--root``, default ``/``):

==========================================  ===============================================
/etc/systemd/system/sparkguard.service      the guard (systemd/sparkguard.service)
/etc/systemd/system/sparkguard-setup.service  zram + sysctls at boot, before the guard
/etc/sysctl.d/99-zz-sparkguard.conf         the memory sysctls (sysctl.d/)
/etc/sparkguard/zram.conf                   zram at boot, or our [zram0] in
                                            /etc/systemd/zram-generator.conf (zram/)
/etc/sparkguard/sparkguard.yaml             commented default configuration
/etc/sparkguard/sparkguard.yaml.dist        the new default beside an edited config (--force)
/etc/systemd/system/sparkguard.service.d/   the engine sandbox, when the config has an
  engine.conf                               engine command or with --engine-sandbox
/usr/local/lib/systemd/catalog/             the journal catalog (what ``journalctl -x`` says
  sparkguard.catalog                        about an incident); journalctl --update-catalog
/usr/local/bin/sparkguard                   a link to a venv's sparkguard, so it is on PATH
                                            (root / only: sparkguard/host/pathlink.py)
/usr/local/share/man/man8/sparkguard.8      the man page and the bash completion, generated
/usr/local/share/bash-completion/             (sparkguard/docgen.py; root / only, when
  completions/sparkguard                    argparse-manpage and shtab are installed)
/var/lib/sparkguard/installed.json          sha256 of what sparkguard wrote (install, tune,
                                            install-zram)
DIR/sparkguard-rules.yml,                   with --prometheus-rules DIR / --grafana-dashboard
DIR/sparkguard-dashboard.json               DIR (absolute, on the target: also under --root)
==========================================  ===============================================

A file whose text differs from the hash recorded (edited by someone) is kept and reported
by install and uninstall: ``install --force`` replaces it (never the config: the new default
goes to ``sparkguard.yaml.dist``), ``uninstall --purge`` removes it.  Install changes nothing
live except, when the root is ``/`` and something changed, ``systemctl daemon-reload`` (units,
drop-in; when systemd runs this machine) and ``journalctl --update-catalog`` (the catalog).  A re-run
prints only what changed (``unchanged`` lines are counted, not printed), and its ``next:`` hint
follows the guard's state (none when it is enabled, running and nothing changed);
``install --dry-run`` prints the unified diff of every file it would create or change.

The catalog goes to /usr/local/lib/systemd/catalog/, the first of the two folders journalctl reads
(systemd src/libsystemd/sd-journal/catalog.c, ``catalog_file_dirs``: /usr/local/lib/systemd/catalog/
and /usr/lib/systemd/catalog/); /usr/lib/systemd/catalog/ is the Debian package's
(debian/sparkguard.install), which dpkg owns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

import sparkguard
from sparkguard import __version__, docgen
from sparkguard.host import configfile, pathlink, sysctl, zram, zramboot
from sparkguard.host.files import (Changes, HostError, Manifest, MANIFEST_PATH, edited_reason, in_root,
                                   install_file, read_text, remove_empty_dirs, remove_file, shipped)
from sparkguard.host.systemctl import query, systemctl, systemd_running

UNIT_DIR = "/etc/systemd/system"
UNITS = ("sparkguard.service", "sparkguard-setup.service")
CONFIG_PATH = "/etc/sparkguard/sparkguard.yaml"
#: the current default configuration, written beside an edited config by ``install --force``
CONFIG_DIST = CONFIG_PATH + ".dist"
DROPIN_DIR = f"{UNIT_DIR}/sparkguard.service.d"
#: the sandbox a supervised engine needs (systemd/sparkguard.service.d/engine.conf)
ENGINE_DROPIN = f"{DROPIN_DIR}/engine.conf"
ENGINE_DROPIN_RES = "host/systemd/sparkguard.service.d/engine.conf"
STATE_DIR = "/var/lib/sparkguard"
#: the journal catalog (see the module docstring for the folder)
CATALOG_PATH = "/usr/local/lib/systemd/catalog/sparkguard.catalog"
CATALOG_RES = "catalog/sparkguard.catalog"
#: sparkguard(8); /usr/local/share/man is in man-db's default search path (/etc/manpath.config)
MAN_PATH = "/usr/local/share/man/man8/sparkguard.8"
#: bash-completion looks in $XDG_DATA_DIRS (default /usr/local/share:/usr/share)/bash-completion/completions
#: (bash-completion's __load_completion)
BASH_COMPLETION = "/usr/local/share/bash-completion/completions/sparkguard"

#: package data the link engineer ships: (option, resource, file name it is installed as)
EXTRAS = {
    "prometheus_rules": ("prometheus/sparkguard-rules.yml", "sparkguard-rules.yml"),
    "grafana_dashboard": ("grafana/sparkguard-dashboard.json", "sparkguard-dashboard.json"),
}


def package_parent() -> str:
    """The folder that holds this ``sparkguard`` package (site-packages or a checkout)."""
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


def _make_root(ch: Changes, args) -> str:
    """The install root as an absolute path; created (and said so) when it does not exist.

    Raises:
        HostError (status 2): it exists and is not a folder.
    """
    root = os.path.abspath(args.root)
    if os.path.isdir(root):
        return root
    if os.path.lexists(root):
        raise HostError(f"--root {args.root}: exists and is not a folder", 2)
    if not ch.dry_run:
        try:
            os.makedirs(root, 0o755)
        except OSError as e:
            raise HostError(f"--root {args.root}: cannot create it: {e.strerror}") from None
    ch.note("created", root + "/", "--root: the folder did not exist")
    return root


def engine_configured(root: str) -> tuple[bool, str]:
    """Does the config under ``root`` have an engine for the guard to supervise?

    True when ``engine.command`` is set (an ``engine:`` section whose command is null, as the
    rendered defaults have it, is guard-only).  Read as plain YAML, so that it works whether or
    not this build's :mod:`sparkguard.config` knows the section.  Returns (answer, why).
    """
    path = in_root(root, CONFIG_PATH)
    text = read_text(path)
    if text is None:
        return False, f"no {CONFIG_PATH}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return False, f"{CONFIG_PATH} is not valid YAML ({str(e).splitlines()[0]})"
    engine = data.get("engine") if isinstance(data, dict) else None
    if isinstance(engine, dict) and engine.get("command"):
        return True, f"engine.command is set in {CONFIG_PATH}"
    return False, f"no engine.command in {CONFIG_PATH}"


def _engine_sandbox(ch: Changes, root: str, args, manifest: Manifest) -> bool:
    """Install, keep or remove the engine sandbox drop-in (see systemd/sparkguard.service.d/engine.conf).

    ``args.engine_sandbox``: True install it, False remove it, None (default) install it when
    the config has an engine command and otherwise leave an existing one alone (saying so).
    Returns True when the drop-in was (or would be) written or removed.
    """
    engine, why = engine_configured(root)
    want = args.engine_sandbox
    if want or (want is None and engine):
        verb = install_file(ch, root, ENGINE_DROPIN, shipped(ENGINE_DROPIN_RES), manifest, force=args.force,
                            detail=("--engine-sandbox" if want else why) + ": ProtectSystem=full, ProtectHome=no, "
                            "root engine capabilities")
        return verb in ("created", "updated")
    if want is False:
        removed = _remove_ours(ch, root, ENGINE_DROPIN, manifest, purge=args.force,
                               kept_detail="changed since sparkguard wrote it; --force removes it")
        remove_empty_dirs(ch, root, DROPIN_DIR)
        return removed
    if os.path.lexists(in_root(root, ENGINE_DROPIN)):
        ch.note("kept", ENGINE_DROPIN, f"{why}; --no-engine-sandbox removes it and restores the guard-only sandbox")
    return False


def update_catalog(ch: Changes) -> None:
    """Run ``journalctl --update-catalog`` (journalctl(1)) so that ``journalctl -x`` knows a changed
    catalog; reported like every step.  A missing journalctl or a failure is a warning: the files are
    in place and the next run of it (or of systemd's own trigger) picks them up."""
    ch.note("ran", "journalctl --update-catalog")
    if ch.dry_run:
        return
    exe = shutil.which("journalctl")
    if not exe:
        ch.warn("journalctl not found: the catalog is installed but not compiled; run journalctl --update-catalog")
        return
    try:
        p = subprocess.run([exe, "--update-catalog"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        ch.warn(f"journalctl --update-catalog did not finish: {e}")
        return
    if p.returncode != 0:
        ch.warn(f"journalctl --update-catalog failed (exit {p.returncode}): {p.stderr.strip()}")


def install_generated(ch: Changes, root: str, manifest: Manifest, force: bool) -> dict[str, str | None]:
    """Write sparkguard(8) to :data:`MAN_PATH` and the bash completion to :data:`BASH_COMPLETION`
    under ``root`` (:mod:`sparkguard.docgen`).

    Only on ``/`` (install() decides): both are generated by optional libraries whose output
    differs between their versions, so a ``--root`` tree (a package's staging area: the .deb makes
    its own, debian/rules) stays made of shipped files only.  Without argparse-manpage or shtab
    that file is not written and nothing is said (README "Install" says how to get them).
    Returns ``{path: verb of install_file, or None when its library is missing}``.
    """
    out: dict[str, str | None] = {}
    for path, make, detail in ((MAN_PATH, docgen.manpage, "man 8 sparkguard"),
                               (BASH_COMPLETION, lambda: docgen.completion("bash"), "bash completion")):
        try:
            text = make()
        except docgen.ToolMissing:
            out[path] = None
            continue
        out[path] = install_file(ch, root, path, text, manifest, force=force, detail=detail)
    return out


def _next_hint(ch: Changes, live: bool, units_changed: bool) -> None:
    """The closing ``next:`` line for an install on ``/``, from the guard's state now: restart when it
    runs with old units, nothing when it is enabled, running and nothing changed, else enable."""
    active = live and query("is-active", "sparkguard.service") == "active"
    enabled = live and query("is-enabled", "sparkguard.service") == "enabled"
    if active and units_changed:
        # a restart keeps a running engine (engine.on_daemon_restart: keep, docs/adoption.md), and with
        # it the old sandbox: stop and start give the engine the new one too
        ch.info("next: systemctl stop sparkguard && systemctl start sparkguard   (the running guard and its "
                "engine still have the old unit and sandbox; a restart would keep the engine as it is)")
    elif active and enabled:
        if ch.changed:
            ch.info("the guard runs: `systemctl reload sparkguard` applies a changed sparkguard.yaml")
    else:
        ch.info("next: systemctl enable --now sparkguard   (sparkguard-setup.service applies zram and sysctls "
                "first; `sparkguard doctor` checks the result)")


def install(args) -> int:
    """Handler of ``sparkguard install``; returns the exit status (see README "Host set-up")."""
    ch = Changes(args.dry_run, quiet_unchanged=True, show_diff=args.dry_run)
    extras = _extras(args)
    python = args.python or sys.executable
    pythonpath = None if args.python else needs_pythonpath(python)
    root = _make_root(ch, args)
    if root != "/":
        ch.info(f"installing under --root {root}: the paths below are the installed system's "
                f"(on this machine, /etc/... is {in_root(root, '/etc')}/...)")
    if pythonpath:
        ch.info(f"note: {python} does not import this sparkguard by itself; the units set PYTHONPATH={pythonpath}")
    manifest = Manifest(root)
    force = args.force
    zram_options = (args.zram_size, args.zram_priority, args.zram_algorithm)
    current = None if args.no_zram else zramboot.persisted_settings(root, manifest)
    base = current or zram.ZramSettings()
    settings = zram.ZramSettings(*(opt if opt is not None else dflt for opt, dflt in
                                   zip(zram_options, (base.size, base.priority, base.algorithm))))
    zram.validate(settings)

    units_changed = False  # the running guard needs a restart for these
    for unit in UNITS:
        verb = install_file(ch, root, f"{UNIT_DIR}/{unit}", render_unit(unit, python, pythonpath), manifest,
                            force=force)
        units_changed |= verb in ("created", "updated")
    install_file(ch, root, sysctl.SYSCTL_FILE, sysctl.render(sysctl.installed_values(root, manifest)), manifest,
                 force=force)
    if args.no_zram:
        ch.note("skipped", "zram boot configuration", "--no-zram")
    elif (zramboot.generator_installed(root) and zramboot.configured(root) == zramboot.GENERATOR_CONF
          and current is None and not force):
        ch.note("kept", zramboot.GENERATOR_CONF, "our [zram0] section no longer parses (edited?); --force replaces it")
    else:
        zramboot.persist(ch, root, settings, manifest, force=force)

    default = configfile.render()
    verb = install_file(ch, root, CONFIG_PATH, default, manifest, kept_detail=(
        "edited by you; kept: " + ("the new default goes beside it" if force else
                                   "--force writes the new default beside it as " + os.path.basename(CONFIG_DIST))))
    dist = in_root(root, CONFIG_DIST)
    if verb == "kept" and (force or os.path.exists(dist)):
        install_file(ch, root, CONFIG_DIST, default, manifest, force=True,
                     detail=f"the default configuration of this sparkguard; compare: diff {CONFIG_DIST} {CONFIG_PATH}")
    units_changed |= _engine_sandbox(ch, root, args, manifest)
    catalog = install_file(ch, root, CATALOG_PATH, shipped(CATALOG_RES), manifest, force=force,
                           detail="what `journalctl -x` says about an incident")
    script = pathlink.venv_script(python) if root == "/" and not args.python else None
    if script:
        pathlink.ensure(ch, root, script, manifest)
    if root == "/":
        install_generated(ch, root, manifest, force)
    for text, dest, fname in extras:
        # under --root like every other file (a package build stages the whole tree there);
        # the line names where it really went, since DIR was given as an absolute path
        path = f"{dest.rstrip('/')}/{fname}"
        where = "" if root == "/" else f"written to {in_root(root, path)}: under --root like every file"
        install_file(ch, root, path, text, manifest, force=force, detail=where,
                     kept_detail=(f"{edited_reason(manifest, path)}; --force replaces it"
                                  + (f"; it is {in_root(root, path)}" if where else "")))
    if not ch.dry_run:
        manifest.save(__version__)

    live = root == "/" and systemd_running()
    if live and units_changed:
        systemctl(ch, "daemon-reload")
    elif root == "/" and units_changed:
        ch.info("systemd is not running this machine: skipped systemctl daemon-reload")
    if root == "/" and catalog in ("created", "updated"):
        update_catalog(ch)
    ch.summary()
    if root == "/":
        _next_hint(ch, live, units_changed)
    else:
        ch.info(f"next, inside {root}: systemctl enable sparkguard")
    return 0


def _is_ours(root: str, path: str, text: str, manifest: Manifest) -> bool:
    """True when ``text`` at ``path`` is as sparkguard wrote it (recorded hash), or exactly what
    this sparkguard writes there without a record (files from before the record covered them)."""
    if manifest.untouched(path, text):
        return True
    if path == CONFIG_PATH:
        try:
            return text == configfile.render()
        except RuntimeError:
            return False
    if path == zramboot.CONF_PATH:
        return zramboot.conf_is_ours(root, manifest)
    if path == ENGINE_DROPIN:
        return text == shipped(ENGINE_DROPIN_RES)
    return False


def _remove_ours(ch: Changes, root: str, path: str, manifest: Manifest, purge: bool,
                 kept_detail: str = "") -> bool:
    """Remove ``path`` when sparkguard wrote it as it is (or ``purge``); else keep it and say so.
    Either way it leaves the manifest.  Returns True when it was (or would be) removed.

    Raises:
        HostError: it cannot be removed.
    """
    full = in_root(root, path)
    text = read_text(full) if os.path.isfile(full) else None
    removed = False
    if not os.path.lexists(full):
        pass
    elif purge or (text is not None and _is_ours(root, path, text, manifest)):
        removed = remove_file(ch, root, path)
    else:
        ch.note("kept", path, kept_detail or f"{edited_reason(manifest, path)}; --purge removes it")
    manifest.forget(path)
    return removed


def uninstall(args) -> int:
    """Handler of ``sparkguard uninstall``; returns the exit status.

    Every file install writes goes the same way: removed when it is as sparkguard wrote it
    (``install``, ``tune`` or ``install-zram``; hashes in the manifest), kept and reported when
    someone edited it, removed anyway with ``--purge``.
    """
    root = os.path.abspath(args.root)
    ch = Changes(args.dry_run)
    if not os.path.isdir(root):
        raise HostError(f"--root {args.root}: no such folder (nothing is installed there)", 2)
    if root != "/":
        ch.info(f"removing under --root {root}: the paths below are the installed system's "
                f"(on this machine, /etc/... is {in_root(root, '/etc')}/...)")
    manifest = Manifest(root)
    live = root == "/" and systemd_running()
    if live and os.path.exists(f"{UNIT_DIR}/sparkguard.service"):
        systemctl(ch, "disable", "--now", "sparkguard.service", check=False)
        systemctl(ch, "stop", "sparkguard-setup.service", check=False)

    pathlink.remove(ch, root, manifest)
    catalog_removed = False
    known = [*(f"{UNIT_DIR}/{u}" for u in UNITS), ENGINE_DROPIN, sysctl.SYSCTL_FILE, zramboot.CONF_PATH,
             CONFIG_PATH, CONFIG_DIST, CATALOG_PATH, MAN_PATH, BASH_COMPLETION]
    # extras (prometheus rules, dashboards) recorded by install come after what we know by name
    for path in known + sorted(p for p in manifest.files if p not in known):
        if path == CONFIG_PATH:
            _remove_ours(ch, root, path, manifest, args.purge, kept_detail="edited by you; --purge removes it")
        else:
            removed = _remove_ours(ch, root, path, manifest, args.purge)
            catalog_removed |= removed and path == CATALOG_PATH
    zramboot.unpersist_generator(ch, root)
    remove_empty_dirs(ch, root, DROPIN_DIR)
    dropins = in_root(root, DROPIN_DIR)
    if os.path.isdir(dropins):
        for name in sorted(os.listdir(dropins)):
            if f"{DROPIN_DIR}/{name}" != ENGINE_DROPIN:  # ours was removed or reported above
                ch.note("kept", f"{DROPIN_DIR}/{name}", "not written by sparkguard install; remove it yourself")
    remove_file(ch, root, MANIFEST_PATH)
    # the catalog's folder and its parent (/usr/local/lib/systemd: no Debian package ships it), when empty
    remove_empty_dirs(ch, root, "/etc/sparkguard", os.path.dirname(CATALOG_PATH),
                      os.path.dirname(os.path.dirname(CATALOG_PATH)))

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
    if root == "/" and catalog_removed:
        update_catalog(ch)
    ch.summary()
    if root == "/":
        ch.info("live state is left as it is: `sparkguard install-zram --remove` takes the zram swap away; "
                "sysctls return to the kernel defaults at the next boot")
    return 0

"""Putting a venv's ``sparkguard`` on PATH: the /usr/local/bin/sparkguard symlink of install and uninstall.

A sparkguard installed into a virtual environment (``python3 -m venv /opt/sparkguard``, the
README's first command, needed on Debian 12 and Ubuntu 24.04 where PEP 668 refuses ``pip install``
into the system Python) has its console script in the venv's ``bin/``, which is not on PATH.
``sparkguard install`` links ``/usr/local/bin/sparkguard`` to it, so that ``sparkguard run``,
``sparkguard doctor`` and the rest work as typed; ``/usr/local/bin`` is on root's PATH on Debian
and Ubuntu (/etc/profile, and login.defs ENV_SUPATH) and is the local administrator's
(Filesystem Hierarchy Standard 3.0, section 4.9 "/usr/local").

Rules:

* a link is made only when the script lives outside the system PATH folders (:data:`SYSTEM_PATH`):
  the .deb's /usr/bin/sparkguard, or pip's /usr/local/bin/sparkguard, are on PATH already;
* an existing /usr/local/bin/sparkguard that already leads to this script (pipx's own link with
  ``PIPX_BIN_DIR=/usr/local/bin``) is left alone and not recorded: uninstall never removes it;
* any other existing file there is foreign and never overwritten (reported as ``kept``);
* the link made is recorded in the install manifest (:class:`sparkguard.host.files.Manifest`) as
  the hash of ``symlink -> TARGET``; uninstall removes it only while it still points there.
"""

from __future__ import annotations

import os

from sparkguard.host.files import Changes, HostError, Manifest, in_root, remove_file

#: the link ``sparkguard install`` makes (path on the target)
LINK = "/usr/local/bin/sparkguard"
#: folders on root's PATH on Debian and Ubuntu (login.defs ENV_SUPATH, /etc/profile)
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def venv_script(python: str) -> str | None:
    """The ``sparkguard`` console script beside interpreter ``python`` when that folder is not on the
    system PATH (a venv's ``bin/``), else None.

    Args:
        python: absolute path of the interpreter the units run (not resolved: a venv's
            ``bin/python3`` is a symlink to the system interpreter, and the venv is its folder).
    """
    folder = os.path.dirname(python)
    script = os.path.join(folder, "sparkguard")
    if os.path.normpath(folder) in SYSTEM_PATH or not (os.path.isfile(script) and os.access(script, os.X_OK)):
        return None
    return script


def _record_text(target: str) -> str:
    return f"symlink -> {target}"


def ensure(ch: Changes, root: str, script: str, manifest: Manifest) -> str:
    """Make ``LINK`` under ``root`` a symlink to ``script`` unless something else is there.

    Returns:
        str, one of "created", "updated" (our old link pointed elsewhere), "unchanged" (ours, or a
        link that already leads to ``script``), "kept" (a foreign file: left alone and reported).
    Raises:
        HostError: the link cannot be made (names it and the OS error).
    """
    full = in_root(root, LINK)
    ours = LINK in manifest.files
    if os.path.lexists(full):
        if os.path.islink(full) and os.readlink(full) == script:
            if ours:
                manifest.record(LINK, _record_text(script))
            return "unchanged"
        if not ours and os.path.realpath(full) == os.path.realpath(script):
            return "unchanged"  # another tool's link (pipx) to the same script: not ours to keep or remove
        if not (ours and os.path.islink(full) and manifest.untouched(LINK, _record_text(os.readlink(full)))):
            ch.note("kept", LINK, f"not sparkguard's link to {script}; `{script}` runs this sparkguard")
            return "kept"
        verb = "updated"
    else:
        verb = "created"
    if not ch.dry_run:
        tmp = f"{full}.sparkguard-tmp"
        try:
            os.makedirs(os.path.dirname(full), 0o755, exist_ok=True)
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(script, tmp)
            os.rename(tmp, full)  # atomic over our old link: rename(2)
        except OSError as e:
            raise HostError(f"cannot link {full} -> {script}: {e.strerror}") from None
    ch.note(verb, LINK, f"-> {script}: puts sparkguard on PATH")
    manifest.record(LINK, _record_text(script))
    return verb


def remove(ch: Changes, root: str, manifest: Manifest) -> bool:
    """Remove ``LINK`` when it is the link install made and still points where it did; forget it.

    Returns:
        True when it was (or would be) removed.
    Raises:
        HostError: it cannot be removed.
    """
    full = in_root(root, LINK)
    recorded = LINK in manifest.files
    still = os.path.islink(full) and manifest.untouched(LINK, _record_text(os.readlink(full)))
    manifest.forget(LINK)
    if not recorded:
        return False
    if not still:
        if os.path.lexists(full):
            ch.note("kept", LINK, "replaced since sparkguard linked it; not sparkguard's")
        return False
    return remove_file(ch, root, LINK)

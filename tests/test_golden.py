"""Golden files: today's observable output, frozen, compared byte for byte.

One folder per case under ``tests/golden/NN-name/`` (the way zram-generator's ``tests/NN-name/``
read): ``case.yaml`` is the input, ``expected/`` the output.  The kinds:

* ``incident``: a real ``sparkguard run`` guards a real fake-vLLM tree that fills real memory past a
  line placed relative to the MemAvailable read at the start; ``expected/incident.json`` is the
  incident file and ``expected/journal.txt`` the journal entries of the incident, both normalised.
  The daemon runs in a private mount namespace whose /run/systemd/journal is a folder of the test,
  where the test's socket stands in for journald (the native protocol, ``tests/test_journal.py``).
* ``install``: ``sparkguard install --root`` into an empty folder; ``expected/tree/`` is the tree
  (paths replaced, numbers kept), ``files.txt`` the modes, ``stdout.txt`` what install said.
* ``status``: ``sparkguard status`` against a real running daemon guarding a real fake-vLLM tree.

What varies from run to run is replaced before comparing (:func:`normalise`): every number becomes
``#`` in text and ``"<int>"``/``"<float>"`` in JSON, and the model name, temp folder, host name, boot
id, incident id and interpreter path become placeholders; lists that describe the host
(zram devices, top consumers) are only checked to be lists.  Key order is kept: it is part
of the output.

To record a case again (only when the output is meant to change): ``SG_GOLDEN_UPDATE=1 pytest
tests/test_golden.py``, then review the diff of ``tests/golden``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, line_above_now, line_below_now, run_sparkguard
from guardrun import GuardProc
from test_journal import JournalStandIn

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SG_GOLDEN_UPDATE") == "1"
GiB = 1024**3
#: the line sits this far under the MemAvailable read at the start: other processes of a shared
#: host come and go by less, so the crossing is the fill's and the memory comes back above it
MARGIN = 2 * GiB
#: journal MESSAGE_IDs are 32 hex digits; incident ids are "YYYYmmddTHHMMSS-xxxxxx"-like
_HEX32 = re.compile(r"\b[0-9a-f]{32}\b")
_NUM = re.compile(r"\d+(?:\.\d+)?")
#: the fake vLLM's own path in its argv (where the test double lives is not sparkguard's output)
_FAKE = re.compile(r"\S*/vllm(?= serve|$)")
#: a size as units.format_size writes it: the unit follows the value (memory use on a shared host)
_SIZE = re.compile(r"# [KMGT]iB\b")
#: journal fields whose values are fixed by the event, kept verbatim
VERBATIM = {"PRIORITY", "MESSAGE_ID", "SYSLOG_IDENTIFIER", "SPARKGUARD_DRY_RUN", "SPARKGUARD_DRILL"}
#: lists whose length is the host's, not sparkguard's
HOST_LISTS = {"zram", "top_consumers", "swaps"}
#: lists of lines whose order is the scheduler's (an engine's processes write to one pipe)
UNORDERED = {"last_lines"}


def cases(kind: str) -> list[Path]:
    out = []
    for d in sorted(GOLDEN.iterdir()):
        if d.is_dir() and yaml.safe_load((d / "case.yaml").read_text())["kind"] == kind:
            out.append(d)
    return out


class Subst:
    """Placeholders for the values of one run: ``text -> placeholder``, longest first."""

    def __init__(self, **pairs: str):
        self.pairs = sorted(((v, f"<{k}>") for k, v in pairs.items() if v), key=lambda p: -len(p[0]))

    def paths(self, s: str) -> str:
        """Only the placeholders: numbers kept (for files whose numbers are all sparkguard's)."""
        for v, p in self.pairs:
            s = s.replace(v, p)
        return re.sub(r"\b[0-9a-f]{64}\b", "<sha256>", s)

    def text(self, s: str) -> str:
        for v, p in self.pairs:
            s = s.replace(v, p)
        s = _FAKE.sub("<fake-vllm>/vllm", s)
        kept: list[str] = []

        def hexid(m: re.Match) -> str:
            if m.group(0) not in KEEP_HEX:
                return "<hex>"
            kept.append(m.group(0))
            return "\0"
        s = _SIZE.sub("# <size>", _NUM.sub("#", _HEX32.sub(hexid, s)))
        return re.sub("\0", lambda m: kept.pop(0), s)


#: the MESSAGE_IDs (journal.py) are part of the contract: kept verbatim
KEEP_HEX: set[str] = set()


def host_meminfo_fields() -> list[str]:
    with open("/proc/meminfo") as f:
        return [line.split(":", 1)[0] for line in f if ":" in line]


def normalise(obj, sub: Subst, key: str | None = None):
    if key == "meminfo" and isinstance(obj, dict) and list(obj) == host_meminfo_fields() \
            and all(type(v) is int for v in obj.values()):
        return "<every /proc/meminfo field in the kernel's order, as int>"
    if isinstance(obj, dict):
        return {k: normalise(v, sub, k) for k, v in obj.items()}
    if isinstance(obj, list):
        if key in HOST_LISTS:
            return f"<the host's {key}: a list>"
        out = [normalise(v, sub) for v in obj]
        if key in UNORDERED:      # the fake's fill lines race the SIGTERM: not compared
            out = sorted((v for v in out if "fill" not in str(v)), key=str)
        return out
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, int):
        return "<int>"
    if isinstance(obj, float):
        return "<float>"
    return sub.text(str(obj))


def compare(path: Path, text: str) -> None:
    """Assert ``text`` equals the golden file ``path`` (or write it under SG_GOLDEN_UPDATE=1)."""
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} missing: record it with SG_GOLDEN_UPDATE=1"
    want = path.read_text()
    if text != want:
        import difflib
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "this run"))
        pytest.fail(f"output differs from {path}:\n{diff}")


def message_ids() -> set[str]:
    """The MESSAGE_IDs of journal.py's catalog table (its module docstring): part of the contract."""
    from sparkguard import journal
    return set(re.findall(r"^\S+\s+([0-9a-f]{32})\s", journal.__doc__, re.M))


# ------------------------------------------------------------------ incident

#: a private mount namespace where /run/systemd/journal is the test's folder ("$1")
JOURNAL_NS = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs -o size=1m,mode=0755 tmpfs /run/systemd && mkdir /run/systemd/journal && '
              'mount --bind "$0" /run/systemd/journal && exec "$@"')


def _wait_incident(directory: str, g: GuardProc, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    try:
                        inc = json.load(f)
                    except ValueError:
                        continue
                if inc.get("ended_at") and inc.get("summary"):
                    return inc
        g.notify.recv(0.2)
    raise AssertionError(f"no finished incident within {timeout}s; log:\n{g.log()[-3000:]}")


@pytest.mark.parametrize("case", cases("incident"), ids=lambda p: p.name)
def test_incident(case: Path, engine_factory, tmp_path):
    """``case.yaml``: ``fill`` (bytes TP0 fills past a line MARGIN under MemAvailable) or no fill (the
    line 512 MiB over MemAvailable, crossed at once); ``engine`` (fake vLLM options); ``config`` with
    ``"<line>"`` and ``<model>`` filled in; ``then_reload`` (a STATUS word; once sd_notify says it,
    the line is lowered to 64 MiB and the daemon gets SIGHUP, which ends a dry-run incident)."""
    spec = yaml.safe_load((case / "case.yaml").read_text())
    fill = spec.get("fill")
    opts = ["--fill-rate", "max", "--fill-size", str(fill), "--fill-on-signal"] if fill else []
    fe = engine_factory(*opts, *spec.get("engine", []))
    line = line_below_now(MARGIN) if fill else line_above_now()
    cfg = json.loads(json.dumps(spec["config"]).replace('"<line>"', str(line)).replace("<model>", fe.model))
    cfg.setdefault("incidents", {})["journal"] = "on"
    jdir = tmp_path / "journal"
    jdir.mkdir()
    standin = JournalStandIn(jdir / "socket")
    g = GuardProc(cfg, wrap=(*JOURNAL_NS, str(jdir)))
    try:
        g.wait_ready()
        if fill:
            fe.start_fill()
        if spec.get("then_reload"):
            g.notify.wait_for(lambda m: spec["then_reload"] in m.get("STATUS", ""), timeout=30)
            g.write_config({**g.cfg, "guard": {**g.cfg["guard"], "term_below": "64MiB"}})
            g.proc.send_signal(signal.SIGHUP)
        inc = _wait_incident(g.cfg["incidents"]["dir"], g)
        wanted = message_ids()
        entries = []
        deadline = time.monotonic() + 20
        report = "664d84b2b89942f2ac3a8c34e6254450"      # the full incident report (journal.py)
        while time.monotonic() < deadline and not any(e.get("MESSAGE_ID") == report for e in entries):
            standin.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                fields, _, _ = standin.recv()
            except socket.timeout:
                break
            if fields.get("MESSAGE_ID") in wanted:
                entries.append(fields)
    finally:
        g.stop()
        standin.close()
    KEEP_HEX.clear()
    KEEP_HEX.update(message_ids())
    sub = Subst(model=fe.model, tmp=g.tmp, host=socket.gethostname(), boot_id=inc.get("boot_id", ""),
                id=inc.get("id", ""), python=sys.executable, repo=str(ROOT))
    compare(case / "expected" / "incident.json", json.dumps(normalise(inc, sub), indent=2) + "\n")
    lines = []
    for e in entries:
        lines.append(f"--- {e.get('MESSAGE_ID')}")
        for k, v in e.items():
            if k == "SPARKGUARD_REPORT":
                v = json.dumps(normalise(json.loads(v), sub), separators=(",", ":"))
            elif k not in VERBATIM:
                v = sub.text(v)
            lines.append(f"{k}={v}")
    compare(case / "expected" / "journal.txt", "\n".join(lines) + "\n")


# ------------------------------------------------------------------ install

#: lines install writes only when the interpreter does not import this checkout by itself (a
#: checkout not pip-installed): the machine's, not the case's
_LOCATED = re.compile(r"^(note: <python> does not import this sparkguard by itself; .*|Environment=PYTHONPATH=<repo>)\n",
                      re.M)


def _unlocated(text: str) -> str:
    return _LOCATED.sub("", text)


@pytest.mark.parametrize("case", cases("install"), ids=lambda p: p.name)
def test_install(case: Path, tmp_path):
    spec = yaml.safe_load((case / "case.yaml").read_text())
    root = tmp_path / "root"
    r = run_sparkguard("install", "--root", str(root), *spec.get("args", []))
    assert r.returncode == spec.get("rc", 0), r.stderr
    sub = Subst(root=str(root), python=sys.executable, repo=str(ROOT))
    expected = case / "expected"
    compare(expected / "stdout.txt", _unlocated(sub.paths(r.stdout)))
    got = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            got[rel] = f"{oct(p.stat().st_mode & 0o7777)}\n" + _unlocated(sub.paths(p.read_text()))
    listing = "".join(f"{rel} {v.split(chr(10), 1)[0]}\n" for rel, v in got.items())
    compare(expected / "files.txt", listing)
    for rel, v in got.items():
        compare(expected / "tree" / rel, v.split("\n", 1)[1])
    if not UPDATE:
        on_disk = {str(p.relative_to(expected / "tree")) for p in (expected / "tree").rglob("*") if p.is_file()}
        assert on_disk == set(got), "files in expected/tree that install no longer writes"


# ------------------------------------------------------------------ status

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: sections of the status screen that describe the host, not sparkguard (other tests add zram
#: devices and swap while this one runs)
HOST_SECTIONS = ("Swap",)


def _screen(text: str) -> str:
    out, skip = [], False
    for line in text.splitlines():
        if line and not line.startswith(" "):
            skip = line.split()[0] in HOST_SECTIONS
            if skip:
                out.append(line + "   (host-dependent lines left out)")
                continue
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("case", cases("status"), ids=lambda p: p.name)
def test_status(case: Path, engine_factory, tmp_path):
    spec = yaml.safe_load((case / "case.yaml").read_text())
    fe = engine_factory(*spec.get("engine", []))
    port = _free_port()
    cfg = json.loads(json.dumps(spec["config"]).replace("<model>", fe.model))
    cfg.setdefault("metrics", {})["listen"] = f"127.0.0.1:{port}"
    g = GuardProc(cfg)
    try:
        g.wait_ready()
        g.wait_log("metrics on")
        r = run_sparkguard("status", "--config", g.config_path, *spec.get("args", []))
    finally:
        g.stop()
    assert r.returncode == spec.get("rc", 0), r.stderr
    sub = Subst(model=fe.model, tmp=g.tmp, python=sys.executable, host=socket.gethostname())
    # columns padded to a number's width: any padding next to a number reads as two spaces; a
    # duration's unit follows its value (uptime, the last poll's age)
    screen = re.sub(r"(?<=\S) {2,}(?=#)|(?<=#) {2,}", "  ", sub.text(_screen(r.stdout)))
    screen = re.sub(r"# (us|ms|s|min|h)\b", "# <duration>", screen)
    compare(case / "expected" / "stdout.txt", screen)


# ------------------------------------------------------------------ supervised

@pytest.mark.parametrize("case", cases("supervised"), ids=lambda p: p.name)
def test_supervised(case: Path, tmp_path):
    """A guard incident that hits the engine sparkguard supervises: the incident carries the engine
    part and is reported again, same id, with the restart it caused.  ``case.yaml``: ``fill``
    (bytes TP0 fills, ``fill_delay`` after ready, past a line MARGIN under MemAvailable),
    ``engine`` (more engine: keys), ``guard`` (guard: keys over the test's)."""
    from supervisor_helpers import Daemon, engine_config, fake_cmd, unique
    spec = yaml.safe_load((case / "case.yaml").read_text())
    model = unique()
    cmd = fake_cmd(model, None, "--fill-rate", "max", "--fill-size", str(spec["fill"]),
                   "--fill-delay", str(spec["fill_delay"]))
    cfg = engine_config(tmp_path, model, cmd, None, **spec.get("engine", {}))
    cfg["guard"].update(spec.get("guard", {}))
    cfg["guard"]["term_below"] = line_below_now(MARGIN)
    d = Daemon(tmp_path, cfg)
    try:
        # the report again, same id, once the restart happened: the log names the file it saved
        m = d.wait_line(r"incident \S+: .*; engine restarted \[saved (\S+\.json)\]", timeout=90)
        with open(m.group(1)) as f:
            inc = json.load(f)
    finally:
        d.stop()
    sub = Subst(model=model, tmp=str(tmp_path), host=socket.gethostname(), boot_id=inc.get("boot_id", ""),
                id=inc.get("id", ""), python=sys.executable, repo=str(ROOT))
    compare(case / "expected" / "incident.json", json.dumps(normalise(inc, sub), indent=2) + "\n")

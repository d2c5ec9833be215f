"""journald native protocol: real datagrams to a socket the test binds, and a real journald.

The stand-in is a unix datagram socket bound by the test where journald's would be; the
test parses what arrives with its own parser of the native protocol (text and binary
length-prefixed forms; sealed memfd passed with SCM_RIGHTS).  The last tests run the
distribution's real systemd-journald inside a private mount+PID namespace (tmpfs over
/run and /var/log/journal, so the host's journal is untouched) and read entries back with
journalctl.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sparkguard import journal

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "sparkguard" / "data" / "catalog" / "sparkguard.catalog"


# --- helpers shared with test_reporter / test_incidents -----------------------------------

def parse_native(data: bytes) -> list[tuple[str, bytes]]:
    """Parse one native-protocol entry into ``[(NAME, value bytes)]`` (independent of journal.py)."""
    out = []
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out.append((k.decode("ascii"), v))
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            v = data[nl + 9:nl + 9 + n]
            assert len(v) == n, "truncated binary field"
            assert data[nl + 9 + n:nl + 10 + n] == b"\n", "binary field not terminated by newline"
            out.append((line.decode("ascii"), v))
            i = nl + 10 + n
    return out


class JournalStandIn:
    """A unix datagram socket bound where journald's would be; receives native entries.

    ``recv()`` returns ``(fields: dict[str, str], how: "datagram"|"memfd", seals: int|None)``.
    """

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(10)

    def recv_raw(self) -> tuple[bytes, str, int | None]:
        fds = array.array("i")
        data, anc, flags, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(4 * fds.itemsize))
        assert not flags & socket.MSG_TRUNC
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
        if not fds:
            return data, "datagram", None
        assert len(fds) == 1 and data == b"", "journald wants one fd in an empty datagram"
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
            return os.pread(fd, size, 0), "memfd", seals
        finally:
            os.close(fd)

    def recv(self) -> tuple[dict[str, str], str, int | None]:
        raw, how, seals = self.recv_raw()
        fields: dict[str, str] = {}
        for k, v in parse_native(raw):
            assert k not in fields, f"field {k} repeated"
            fields[k] = v.decode()
        return fields, how, seals

    def pending(self) -> bool:
        import select
        return bool(select.select([self.sock], [], [], 0)[0])

    def close(self):
        self.sock.close()


@pytest.fixture
def standin(tmp_path):
    s = JournalStandIn(tmp_path / "journal.sock")
    yield s
    s.close()


def journald_binary() -> str | None:
    for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald"):
        if os.access(p, os.X_OK):
            return p
    return None


DRIVER = r"""
set -u
# Private mount + PID namespace: nothing here touches the host's /run or journal.
mount -t tmpfs -o mode=0755,size=64m tmpfs /run
mkdir -p /run/systemd/journal /run/log
if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=2755,size=64m tmpfs /var/log/journal; fi
"$JOURNALD" >/dev/null 2>&1 &
i=0
while [ ! -S /run/systemd/journal/socket ]; do
  i=$((i+1)); [ $i -gt 200 ] && { echo "journald did not start" >&2; exit 97; }
  sleep 0.05
done
"$@"
"""


def run_with_journald(tmp_path: Path, argv: list[str], timeout: float = 120,
                      env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` beside a real systemd-journald in a private mount+PID namespace.

    journald and everything else in the namespace die with it (PID namespace init exits).
    Skips when journald or unshare is missing or namespaces are not permitted.
    """
    jd = journald_binary()
    if os.geteuid() != 0 or not jd or not shutil.which("unshare"):
        pytest.skip("needs root, unshare and systemd-journald")
    driver = tmp_path / "with-journald.sh"
    driver.write_text(DRIVER)
    e = dict(env if env is not None else os.environ)
    e["JOURNALD"] = jd
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc",
                        "--propagation", "private", "sh", str(driver), *argv],
                       capture_output=True, text=True, timeout=timeout, env=e)
    if r.returncode != 0 and r.stderr.startswith("unshare:"):
        pytest.skip(f"namespaces not permitted here: {r.stderr.strip()}")
    return r


# --- tests ---------------------------------------------------------------------------------

def test_fields_arrive_as_one_datagram_with_multiline_values_in_binary_form(standin):
    how = journal.send({
        "MESSAGE": "sparkguard: SIGTERM to 123 (vllm serve m)",
        "MESSAGE_ID": journal.message_id("sigterm"),
        "PRIORITY": journal.priority("sigterm"),
        "SPARKGUARD_DETAIL": "line one\nline two\n",
        "SPARKGUARD_AVAILABLE_BYTES": 805306368,
        "SPARKGUARD_DRY_RUN": False,
        "SPARKGUARD_UNSET": None,
    }, standin.path)
    assert how == "datagram"
    raw, how, _ = standin.recv_raw()
    assert how == "datagram"
    # the multi-line value really uses the length-prefixed form on the wire
    assert b"SPARKGUARD_DETAIL\n" + struct.pack("<Q", 18) + b"line one\nline two\n\n" in raw
    fields = dict((k, v.decode()) for k, v in parse_native(raw))
    assert fields == {
        "MESSAGE": "sparkguard: SIGTERM to 123 (vllm serve m)",
        "MESSAGE_ID": "48e06cb02cb345de9342309dac34c2ec",
        "PRIORITY": "4",
        "SPARKGUARD_DETAIL": "line one\nline two\n",
        "SPARKGUARD_AVAILABLE_BYTES": "805306368",
        "SPARKGUARD_DRY_RUN": "0",
        "SYSLOG_IDENTIFIER": "sparkguard",
    }


def test_entry_over_the_datagram_limit_goes_through_a_sealed_memfd(standin):
    big = json.dumps({"tree": ["x" * 100] * 3000})  # ~300 KB, over the 208 KiB default sndbuf
    assert len(big) > 300_000
    how = journal.send({"MESSAGE": "report", "MESSAGE_ID": journal.message_id("report"),
                        "SPARKGUARD_REPORT": big, "SPARKGUARD_NOTE": "a\nb"}, standin.path)
    assert how == "memfd"
    fields, how, seals = standin.recv()
    assert how == "memfd"
    want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
    assert seals & want == want, "journald refuses a memfd that is not sealed"
    assert fields["SPARKGUARD_REPORT"] == big
    assert fields["SPARKGUARD_NOTE"] == "a\nb"
    assert fields["MESSAGE_ID"] == journal.MESSAGE_IDS["report"]


def test_list_values_repeat_the_field(standin):
    journal.send({"MESSAGE": "m", "SPARKGUARD_PID": [1, 2, 3]}, standin.path)
    raw, _, _ = standin.recv_raw()
    assert [v for k, v in parse_native(raw) if k == "SPARKGUARD_PID"] == [b"1", b"2", b"3"]


@pytest.mark.parametrize("name", ["_PID", "message", "1ABC", "A" * 65, "SPARK-GUARD", "", "É"])
def test_invalid_field_names_are_refused_before_sending(standin, name):
    with pytest.raises(ValueError, match="invalid journal field name"):
        journal.send({"MESSAGE": "m", name: "x"}, standin.path)
    assert not standin.pending()


def test_message_ids_are_distinct_128_bit_hex_and_priorities_valid():
    ids = list(journal.MESSAGE_IDS.values())
    assert len(set(ids)) == len(ids)
    for i in ids:
        assert len(i) == 32 and int(i, 16) >= 0 and i == i.lower()
    assert journal.message_id("would_term") == journal.message_id("would_kill") == journal.MESSAGE_IDS["would_signal"]
    assert journal.message_id("engine_restart") == journal.MESSAGE_IDS["event"]
    assert journal.priority("sigkill") == 3 and journal.priority("recovered") == 5
    assert all(0 <= p <= 7 for p in journal.PRIORITIES.values())


def test_available_only_when_someone_listens(tmp_path, standin):
    assert journal.available(standin.path)
    assert not journal.available(str(tmp_path / "missing.sock"))
    regular = tmp_path / "file"
    regular.write_text("")
    assert not journal.available(str(regular))
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: a dead journald
    assert not journal.available(str(stale))
    with pytest.raises(OSError) as e:
        journal.send({"MESSAGE": "m"}, str(stale))
    assert e.value.errno == errno.ECONNREFUSED
    with pytest.raises(OSError) as e:
        journal.send({"MESSAGE": "m"}, str(tmp_path / "missing.sock"))
    assert e.value.errno == errno.ENOENT


def test_catalog_compiles_and_covers_every_message_id(tmp_path):
    if not shutil.which("journalctl"):
        pytest.skip("journalctl missing")
    cat = tmp_path / "usr/lib/systemd/catalog"
    cat.mkdir(parents=True)
    shutil.copy(CATALOG, cat)
    r = subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "rror" not in r.stderr, r.stderr
    r = subprocess.run(["journalctl", f"--root={tmp_path}", "--list-catalog"],
                       capture_output=True, text=True, timeout=60)
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert set(journal.MESSAGE_IDS.values()) <= listed


SENDER = r"""
import json, subprocess, sys, time
from sparkguard import journal
tag = sys.argv[1]
big = "r" * 300_000
hows = [journal.send({"MESSAGE": "small " + tag, "MESSAGE_ID": journal.message_id("crossed"),
                      "PRIORITY": 4, "SPARKGUARD_TAG": tag, "SPARKGUARD_MULTI": "x\ny"}),
        journal.send({"MESSAGE": "big " + tag, "MESSAGE_ID": journal.message_id("report"),
                      "SPARKGUARD_TAG": tag, "SPARKGUARD_REPORT": big})]
out = []
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    r = subprocess.run(["journalctl", "-o", "json", "--all", "--no-pager", "SPARKGUARD_TAG=" + tag],
                       capture_output=True, text=True, timeout=30)
    out = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    if len(out) >= 2:
        break
    time.sleep(0.1)  # journald writes asynchronously; journalctl has no wait-for-entry
print(json.dumps({"hows": hows, "entries": out}))
"""


def test_real_journald_stores_small_multiline_and_memfd_entries(tmp_path):
    tag = uuid.uuid4().hex
    r = run_with_journald(tmp_path, [sys.executable, "-c", SENDER, tag])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hows"] == ["datagram", "memfd"]
    by_msg = {e["MESSAGE"]: e for e in res["entries"]}
    small, big = by_msg["small " + tag], by_msg["big " + tag]
    assert small["MESSAGE_ID"] == journal.MESSAGE_IDS["crossed"]
    assert small["PRIORITY"] == "4"
    assert small["SYSLOG_IDENTIFIER"] == "sparkguard"
    assert small["SPARKGUARD_MULTI"] == "x\ny"
    assert big["SPARKGUARD_REPORT"] == "r" * 300_000
    assert big["_TRANSPORT"] == "journal"


def test_a_fragmented_start_has_its_own_message_id_and_is_an_error(tmp_path, standin):
    """The start gate's ``fragmented`` incident (docs/start-gate.md), opened as the supervisor opens
    it (``supervisor/reports.py`` ``EngineIncidents.open``, the real Reporter, a socket standing in for
    journald): its event and its report are found by MESSAGE_ID, at PRIORITY 3 (a start that
    waits for a reboot needs a person), and the catalog explains the id."""
    import time

    from sparkguard import config
    from sparkguard.reporter import Reporter
    from sparkguard.supervisor.reports import EngineIncidents
    from sparkguard.supervisor.memgate import fragmented_detail
    rep = Reporter(str(tmp_path / "inc"), journal="on", journal_socket=standin.path)
    detail = fragmented_detail(37227 * 1024**2, 160 * 1024**2)
    (tmp_path / "sparkguard.yaml").write_text("guard: {term_below: 1GiB}\n")
    reports = EngineIncidents(rep)
    inc = reports.open("fragmented", config.load(str(tmp_path / "sparkguard.yaml")), None, "fragmented", detail,
                       {}, [], "engine start blocked by fragmentation: " + detail)
    inc.outcome, inc.ended_at = "blocked", time.time()
    reports.finish(inc)
    rep.close()
    ev, _, _ = standin.recv()
    assert ev["MESSAGE_ID"] == journal.MESSAGE_IDS["fragmented"] == "250a5fc9ab854a85af67458906434ada"
    assert ev["PRIORITY"] == "3" and ev["SPARKGUARD_EVENT"] == "fragmented" and "reboot recommended" in ev["MESSAGE"]
    report, _, _ = standin.recv()
    assert report["MESSAGE_ID"] == journal.MESSAGE_IDS["report"] and report["PRIORITY"] == "3"
    assert report["SPARKGUARD_OUTCOME"] == "blocked"
    assert f"-- {journal.MESSAGE_IDS['fragmented']}\n" in CATALOG.read_text()
    assert f"| fragmented | `{journal.MESSAGE_IDS['fragmented']}` | 3 err |" in (ROOT / "docs" / "journal.md").read_text()

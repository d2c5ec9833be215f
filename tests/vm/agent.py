#!/usr/bin/python3
"""Test agent inside the VM: runs the host's commands that arrive on a virtio-serial port.

Installed into the VM image by ``tests/vm/image.py`` as ``/usr/local/sbin/sg-test-agent`` and
started at every boot by ``sg-test-agent.service``; stdlib only (the guest's /usr/bin/python3).

Protocol, one JSON object per line (UTF-8) on the port named :data:`PORT_NAME`:

* guest -> host at start: ``{"hello": BOOT_ID}`` with the kernel's boot id
  (/proc/sys/kernel/random/boot_id), so the host can tell one boot from the next;
* host -> guest: ``{"id": N, "argv": [...], "input": str|null, "timeout": seconds}`` (run at
  oom_score_adj 0, not the agent's -1000), answered by
  ``{"id": N, "rc": int, "stdout": str, "stderr": str}`` (rc -9 and ``"timeout": true`` when the
  command ran past ``timeout`` and was SIGKILLed, with its process group);
* host -> guest: ``{"id": N, "put": PATH, "data": BASE64, "mode": int}``: write a file
  (atomically: a temporary file renamed), answered by ``{"id": N, "rc": 0, ...}``.

Each request runs in a thread of its own, so a long command never holds up another; answers are
written whole under a lock.  The port's device is found through /sys/class/virtio-ports/*/name
(the kernel's virtio_console driver; udev's /dev/virtio-ports/ symlinks are not needed).
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

PORT_NAME = "org.sparkguard.test.agent"


def find_port(timeout=120.0):
    """Path of the /dev node of :data:`PORT_NAME` (e.g. /dev/vport1p1); waits up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for dev in os.listdir("/sys/class/virtio-ports"):
                with open(f"/sys/class/virtio-ports/{dev}/name") as f:
                    if f.read().strip() == PORT_NAME and os.path.exists(f"/dev/{dev}"):
                        return f"/dev/{dev}"
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"sg-test-agent: no virtio port named {PORT_NAME}")
        time.sleep(0.2)


class Agent:
    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR)
        self.lock = threading.Lock()

    def send(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        with self.lock:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]

    def handle(self, req):
        rid = req.get("id")
        try:
            if "put" in req:
                path = req["put"]
                os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
                tmp = f"{path}.sgagent-tmp"
                with open(tmp, "wb") as f:
                    f.write(base64.b64decode(req["data"]))
                os.chmod(tmp, int(req.get("mode", 0o644)))
                os.rename(tmp, path)
                self.send({"id": rid, "rc": 0, "stdout": "", "stderr": ""})
                return
            # The agent runs at OOMScoreAdjust=-1000, which children inherit (proc(5)): each command
            # starts at 0, like one from a login shell, so the kernel's OOM killer may choose it.
            argv = ["/bin/sh", "-c", 'echo 0 > /proc/self/oom_score_adj && exec "$@"', "sh", *req["argv"]]
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                      "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
                                      "HOME": "/root"})
            try:
                out, err = p.communicate((req.get("input") or "").encode(), timeout=req.get("timeout") or 600)
                self.send({"id": rid, "rc": p.returncode, "stdout": out.decode(errors="replace"),
                           "stderr": err.decode(errors="replace")})
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                out, err = p.communicate()
                self.send({"id": rid, "rc": -9, "timeout": True, "stdout": out.decode(errors="replace"),
                           "stderr": err.decode(errors="replace")})
        except Exception as e:  # any failure is the answer, never the end of the agent
            self.send({"id": rid, "rc": 255, "stdout": "", "stderr": f"sg-test-agent: {type(e).__name__}: {e}"})

    def serve(self):
        with open("/proc/sys/kernel/random/boot_id") as f:
            self.send({"hello": f.read().strip()})
        buf = b""
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:  # no host connected to the port: wait for one
                time.sleep(0.2)
                continue
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = json.loads(line)
                except ValueError:
                    continue
                threading.Thread(target=self.handle, args=(req,), daemon=True).start()


if __name__ == "__main__":
    Agent(find_port()).serve()
    sys.exit(0)
